"""gRPC transport: the servicer, wire checks, streams, slots, admission and metrics."""
