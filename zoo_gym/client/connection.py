"""A channel to gym-server with retries: an unreachable server is retried with backoff, and said so."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from zoo_gym.proto import gym_pb2_grpc

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
MiB = 1 << 20


class ServerUnreachable(RuntimeError):
    """The server did not answer within the retry budget."""


def open_stub(address: str) -> tuple[grpc.Channel, gym_pb2_grpc.GymStub]:
    channel = grpc.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 80 * MiB),
        ("grpc.max_send_message_length", 80 * MiB),
    ])
    return channel, gym_pb2_grpc.GymStub(channel)


def with_retries(call: Callable[[], T], *, what: str, say: Callable[[str], None], max_wait: float = 300.0,
                 base_delay: float = 0.5, max_delay: float = 15.0) -> T:
    """Run `call`; on UNAVAILABLE/DEADLINE_EXCEEDED retry with jittered exponential backoff up to `max_wait` s."""
    deadline = time.monotonic() + max_wait
    delay = base_delay
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerUnreachable(f"{what}: the server is unreachable ({exc.details()}); gave up after "
                                        f"{max_wait:.0f} s") from exc
            wait = min(delay * (1 + random.random() * 0.25), max_delay, left)
            say(f"{what}: server unreachable ({exc.code().name}); retrying in {wait:.1f} s")
            time.sleep(wait)
            delay = min(delay * 2, max_delay)
