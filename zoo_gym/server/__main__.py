from zoo_gym.server.cli import app

app(prog_name="gym-server")
