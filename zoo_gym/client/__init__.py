"""`gym-client`: identity keys, the join loops (sync and async), the one contribution path, pull, rewards."""
