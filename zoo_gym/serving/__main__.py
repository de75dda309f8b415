from zoo_gym.serving.cli import app

app(prog_name="gym-serve")
