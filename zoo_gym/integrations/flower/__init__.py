"""Flower (flwr, extra `flower`): `strategy.DeltaSoupStrategy` runs DeltaSoup as a Flower strategy, and `apps`
holds a ClientApp (train, BitDelta-encode) and a ServerApp (Poisson-sampled DeltaSoup, central DP) from the tiny base.

Importing this package needs nothing; importing either module needs flwr and says so in one line without it.
"""
