"""Prometheus metrics and the operator's RPC log lines, without touching a handler.

One `ServerMetrics` per server, each with its own `CollectorRegistry` (tests run many servers in one
process) holding the process_* and python_info series, fed by `RpcInterceptor` (RPCs and their latency by
method and status code, message bytes, submissions accepted and refused by status, and one line per
registration and per submission, a refusal with the reason the peer was given: INFO for the first 50 of a
kind, then DEBUG with an INFO line every 10 s counting them, `LogSummary`), `PhaseTimer` (a logging handler
on the round manager's thread timing each publish phase `publish.py` logs as `round N phase=X`) and
`StateCollector` (a few cheap queries at scrape time: rounds published, the current round and its
submissions, epsilon spent, the last held-out loss, registered contributors)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("zoo_gym.server")

# seconds; a tiny model aggregates in well under a second, a 7B one in minutes
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# seconds of one RPC: a health check takes a millisecond, an upload of a 7B delta minutes
_RPC_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
_PHASE = re.compile(r"^round (\d+) phase=(\S+)$")


class ServerMetrics:
    """Every metric of one server, registered in its own registry (served at /metrics)."""

    def __init__(self, state) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, fds
        PlatformCollector(registry=r)  # python_info
        self.rpcs = Counter("zoo_gym_rpcs", "gRPC calls by method and status code", ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("zoo_gym_rpc_seconds", "Seconds from a gRPC call's start to its end "
                                     "(its last response sent), by method and status code", ["method", "code"],
                                     buckets=_RPC_SECONDS, registry=r)
        self.received = Counter("zoo_gym_received_bytes", "Bytes of request messages received", registry=r)
        self.sent = Counter("zoo_gym_sent_bytes", "Bytes of response messages sent", registry=r)
        self.accepted = Counter("zoo_gym_submissions_accepted", "Submissions stored", registry=r)
        self.refused = Counter("zoo_gym_submissions_refused", "Submissions refused, by gRPC status",
                               ["code"], registry=r)
        self.aggregation = Histogram("zoo_gym_aggregation_seconds", "Seconds of a round's aggregation phase",
                                     buckets=_SECONDS, registry=r)
        self.publish = Histogram("zoo_gym_publish_seconds", "Seconds from a round's close to its publication "
                                 "(load, aggregation, scoring, write, evaluation, commit)", buckets=_SECONDS,
                                 registry=r)
        self.phases = Histogram("zoo_gym_round_phase_seconds", "Seconds of each publish phase", ["phase"],
                                buckets=_SECONDS, registry=r)
        r.register(StateCollector(state))
        self.log_summary = LogSummary()  # per-contributor lines past the first 50 of a kind: DEBUG, counted
        self.interceptor = RpcInterceptor(self)

    def phase_timer(self, thread: threading.Thread) -> PhaseTimer:
        return PhaseTimer(self, thread)


class PhaseTimer(logging.Handler):
    """Times the phases `publish_round` logs, from records emitted on one round manager's thread."""

    def __init__(self, metrics: ServerMetrics, thread: threading.Thread) -> None:
        super().__init__(level=logging.INFO)
        self.metrics, self.thread = metrics, thread
        self._current: tuple[str, float] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread() is not self.thread or record.name != "zoo_gym.server":
            return
        m = _PHASE.match(record.getMessage())
        if m is None:
            return
        now, phase = time.perf_counter(), m.group(2)
        if self._current is not None:
            name, started = self._current
            self.metrics.phases.labels(phase=name).observe(now - started)
            if name == "aggregation":
                self.metrics.aggregation.observe(now - started)
        self._current = None if phase == "done" else (phase, now)


class StateCollector(Collector):
    """Gauges read from the database at scrape time (a handful of indexed queries)."""

    def __init__(self, state) -> None:
        self.state = state

    def collect(self) -> Iterator:
        from zoo_gym.server.store.queries import summary

        s = summary(self.state)
        yield CounterMetricFamily("zoo_gym_rounds_published", "Rounds published", value=s["rounds_published"])
        yield GaugeMetricFamily("zoo_gym_current_round", "Id of the current round", value=s["current_round"])
        yield GaugeMetricFamily("zoo_gym_current_round_submissions", "Submissions stored in the current round",
                                value=s["current_submissions"])
        yield GaugeMetricFamily("zoo_gym_dp_epsilon_spent", "Differential-privacy epsilon spent so far",
                                value=s["epsilon_spent"] or 0.0)
        yield GaugeMetricFamily("zoo_gym_last_heldout_loss", "Held-out loss of the latest measured checkpoint",
                                value=float("nan") if s["last_heldout_loss"] is None else s["last_heldout_loss"])
        yield GaugeMetricFamily("zoo_gym_registered_contributors", "Registered contributors",
                                value=s["contributors"])


# ------------------------------------------------------------------------------------------ interceptor

class LogSummary:
    """One line per contributor at INFO for the first `each` events of each kind (a registration, an accepted
    or a refused submission), then at DEBUG, and every `every` seconds one INFO line counting what those said
    (issue 51: 10,000 contributors made 20,000 INFO lines). Thread-safe; `flush` is called by the round loop."""

    def __init__(self, *, each: int = 50, every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.each, self.every, self._clock = each, every, clock
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._since = clock()

    def level(self, kind: str, what: str) -> int:
        """The level of the next `kind` line ("submission", "registration"); `what` is counted for the summary."""
        with self._lock:
            self._seen[kind] = self._seen.get(kind, 0) + 1
            quiet = self._seen[kind] > self.each
            if quiet:
                self._pending[what] = self._pending.get(what, 0) + 1
        if quiet:
            self.flush()
        return logging.DEBUG if quiet else logging.INFO

    def flush(self, *, force: bool = False) -> None:
        """Say the counts held back, when `every` seconds have passed since the last summary (or `force`)."""
        with self._lock:
            now = self._clock()
            if not self._pending or (now - self._since < self.every and not force):
                return
            pending, since, self._pending, self._since = self._pending, self._since, {}, now
        counts = ", ".join(f"{n} {what}" for what, n in sorted(pending.items()))
        log.info("in the last %.0f s: %s (one line each past the first %d of a kind: DEBUG)", now - since, counts,
                 self.each, extra={"event": "summary", "counts": pending, "seconds": round(now - since, 3)})


class _Call:
    """What one RPC carried, for its counters and its log line."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.received = 0
        self.first = None  # the first request message (a SubmitDelta header)
        self.started = time.perf_counter()

    def requests(self, iterator):
        for msg in iterator:
            self.received += msg.ByteSize()
            if self.first is None:
                self.first = msg
            yield msg


class RpcInterceptor(grpc.ServerInterceptor):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, method, False), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary, method, True), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, method, False), **kw)
        return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream, method, True), **kw)

    def _unary(self, behavior: Callable, method: str, streaming_in: bool):
        def wrapped(request, context):
            call = _Call(method)
            request = self._requests(call, request, streaming_in)
            try:
                response = behavior(request, context)
            except BaseException:
                self._finish(call, context, None, failed=True)
                raise
            self._finish(call, context, response, failed=False)
            return response

        return wrapped

    def _stream(self, behavior: Callable, method: str, streaming_in: bool):
        def wrapped(request, context):
            call = _Call(method)
            request = self._requests(call, request, streaming_in)
            try:
                for response in behavior(request, context):
                    self.metrics.sent.inc(response.ByteSize())
                    yield response
            except BaseException:
                self._finish(call, context, None, failed=True)
                raise
            self._finish(call, context, None, failed=False)

        return wrapped

    @staticmethod
    def _requests(call: _Call, request, streaming_in: bool):
        if streaming_in:
            return call.requests(request)
        call.received = request.ByteSize()
        call.first = request
        return request

    def _finish(self, call: _Call, context, response, *, failed: bool) -> None:
        try:
            self._count(call, context, response, failed=failed)
        except Exception:  # noqa: BLE001 - counting or logging must never change an RPC's outcome
            log.exception("metrics of %s failed", call.method)

    def _count(self, call: _Call, context, response, *, failed: bool) -> None:
        m = self.metrics
        code = context.code() or (grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK)
        m.rpcs.labels(method=call.method, code=code.name).inc()
        m.rpc_seconds.labels(method=call.method, code=code.name).observe(time.perf_counter() - call.started)
        m.received.inc(call.received)
        if response is not None:
            m.sent.inc(response.ByteSize())
        if call.method == "SubmitDelta":
            self._log_submission(call, code, context.details(), response)
        elif call.method == "Register":
            self._log_registration(call, code, context.details(), response)

    def _log_submission(self, call: _Call, code: grpc.StatusCode, details, response) -> None:
        h = call.first.header if call.first is not None and call.first.WhichOneof("part") == "header" else None
        who = h.contributor_id if h is not None else "?"
        rnd = h.round_id if h is not None else 0
        summary = self.metrics.log_summary
        if code == grpc.StatusCode.OK:
            self.metrics.accepted.inc()
            log.log(summary.level("submission", "submissions accepted"),
                    "submission accepted: contributor %s round %d, %d bytes (%d in the round)", who,
                    response.round_id, h.payload_size, response.submissions,
                    extra={"event": "submission", "outcome": "accepted", "contributor": who,
                           "round": response.round_id, "bytes": h.payload_size})
        else:
            self.metrics.refused.labels(code=code.name).inc()
            log.log(summary.level("submission", f"submissions refused {code.name}"),
                    "submission refused: contributor %s round %d: %s: %s", who, rnd, code.name, _text(details),
                    extra={"event": "submission", "outcome": "refused", "contributor": who, "round": rnd,
                           "code": code.name, "reason": _text(details)})

    def _log_registration(self, call: _Call, code: grpc.StatusCode, details, response) -> None:
        name = call.first.display_name if call.first is not None else ""
        summary = self.metrics.log_summary
        if code == grpc.StatusCode.OK:
            log.log(summary.level("registration", "registrations" if response.created else "keys confirmed"),
                    "registration: contributor %s (%r) %s", response.contributor_id, name,
                    "registered" if response.created else "already registered, key confirmed",
                    extra={"event": "registration", "outcome": "accepted", "contributor": response.contributor_id,
                           "new": response.created})
        else:
            log.log(summary.level("registration", f"registrations refused {code.name}"),
                    "registration refused (%r): %s: %s", name, code.name, _text(details),
                    extra={"event": "registration", "outcome": "refused", "code": code.name,
                           "reason": _text(details)})


def _text(details) -> str:
    if isinstance(details, bytes):
        return details.decode("utf-8", "replace")
    return details or ""
