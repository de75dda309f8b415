"""Every call's first message must arrive in time, and only a few calls may wait for theirs at once.

`FirstMessageDeadline`, the outermost server interceptor, serves unary methods as client-streaming ones
(the bytes on the wire are the same), so their request is read through `BoundedStream`: a request not
there within `GRACE_S` is waited for `header_timeout` seconds more, and only on a `PendingSlots` slot,
taken without waiting. SubmitDelta takes one of the same slots until its signed header verifies
(upload_slots.py). No free slot: RESOURCE_EXHAUSTED "server busy ... retry later" at once.
Why: docs/design/transport.md.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import grpc

from zoo_gym.proto.busy import busy_message
from zoo_gym.server.errors import GymError, ResourceExhausted
from zoo_gym.server.transport.streams import NOT_YET, BoundedStream

GRACE_S = 0.25  # a request that arrives this soon takes no pending slot, so bursts of honest calls never wait


def peer_host(peer: str) -> str:
    """The address part of grpc's `context.peer()` ("ipv4:1.2.3.4:5678" -> "ipv4:1.2.3.4")."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


class PendingSlots:
    """Calls whose first message has not arrived: at most `total`, and `per_peer` from one address."""

    def __init__(self, *, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self._free = total
        self._by_host: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, peer: str) -> str:
        """Take a slot for `peer` without waiting; returns the key to `give_back`. ResourceExhausted if none."""
        host = peer_host(peer)
        with self._lock:
            if self._by_host[host] >= self.per_peer:
                raise ResourceExhausted(busy_message(f"{self.per_peer} calls from your address are still "
                                                     "waiting for their first message"))
            if self._free <= 0:
                raise ResourceExhausted(busy_message(f"{self.total} calls are waiting for their first message"))
            self._free -= 1
            self._by_host[host] += 1
        return host

    def give_back(self, host: str) -> None:
        with self._lock:
            self._free += 1
            self._by_host[host] -= 1
            if self._by_host[host] <= 0:
                del self._by_host[host]


class FirstMessageDeadline(grpc.ServerInterceptor):
    """Unary methods read their request within GRACE_S + `timeout` seconds (the wait past GRACE_S on a slot)."""

    def __init__(self, slots: PendingSlots, *, timeout: float) -> None:
        self.slots, self.timeout = slots, timeout

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.stream_unary_rpc_method_handler(self._first(handler.unary_unary, method), **kw)
        return grpc.stream_stream_rpc_method_handler(self._first(handler.unary_stream, method), **kw)

    def _first(self, behavior: Callable, method: str) -> Callable:
        def wrapped(requests, context):
            return behavior(self._request(requests, context, method), context)

        return wrapped

    def _request(self, requests, context, method: str):
        stream = BoundedStream(requests, idle_timeout=self.timeout, what="call", first_what="request message")
        host = None
        try:
            request = stream.poll(GRACE_S)
            if request is NOT_YET:  # a slow or silent call waits for its request only on a pending slot
                host = self.slots.take(context.peer())
                request = next(stream)
        except StopIteration:
            request = None
        except GymError as exc:
            context.abort(exc.code, str(exc))
        finally:
            stream.close()
            if host is not None:
                self.slots.give_back(host)
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes exactly one request message; none came")
        return request
