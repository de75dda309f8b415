from zoo_gym.client.cli import app

app(prog_name="gym-client")
