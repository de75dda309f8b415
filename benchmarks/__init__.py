"""Benchmark scripts (run as ``python benchmarks/NAME.py``) and what they and the tests share (``attacks``)."""
