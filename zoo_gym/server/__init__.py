"""`gym-server`: its floors, bottom up, are store, genesis, rounds and transport; `cli.py` wires them and the dashboard."""
