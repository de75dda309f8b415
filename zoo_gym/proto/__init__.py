"""The wire contract: gym.proto (package zoo_gym.v1), its committed stubs, and what gets signed."""

from zoo_gym.proto import gym_pb2, gym_pb2_grpc

__all__ = ["gym_pb2", "gym_pb2_grpc"]
