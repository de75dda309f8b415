"""Zoo Gym: federated community delta learning.

Parts (see DESIGN.md): proto (wire contract), codec (delta <-> bytes), gym_train (local training),
aggregation (DeltaSoup), rewards (scores, reputation, ledger), server, client.
"""

__version__ = "0.1.0"
