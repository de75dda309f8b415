"""The gRPC face of the server: a thin servicer over handlers.py, plus health and reflection services.

Each method converts the request, calls one handler, and maps GymError to `context.abort(code, msg)`.
Unexpected exceptions become INTERNAL with a generic message (details go to the log, not to peers).
`build_server` serves beside a RoundManager (`gym-server serve`); ingest.py the same RPCs without one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from zoo_gym import codec
from zoo_gym.proto import gym_pb2, gym_pb2_grpc
from zoo_gym.server.transport import handlers
from zoo_gym.server.transport.admission import Admission
from zoo_gym.server.config import ServerConfig
from zoo_gym.server.transport.download_slots import DownloadSlots
from zoo_gym.server.errors import GymError, InvalidArgument, PermissionDenied
from zoo_gym.server.store.models import RoundState
from zoo_gym.server.metrics import ServerMetrics
from zoo_gym.server.rounds.manager import RoundManager
from zoo_gym.server.rounds.signed_state import ledger_head, sign_round_info
from zoo_gym.server.store.state import ServerState, count_submissions
from zoo_gym.server.transport.streams import BoundedStream
from zoo_gym.server.transport.wire import MalformedRequests
from zoo_gym.server.transport.first_message import FirstMessageDeadline, PendingSlots
from zoo_gym.server.transport.upload_slots import UploadSlots

log = logging.getLogger("zoo_gym.server")

_STATES = {
    RoundState.OPEN: gym_pb2.ROUND_STATE_OPEN,
    RoundState.AGGREGATING: gym_pb2.ROUND_STATE_AGGREGATING,
    RoundState.PUBLISHED: gym_pb2.ROUND_STATE_PUBLISHED,
    RoundState.HALTED: gym_pb2.ROUND_STATE_HALTED,
}


def _abort(exc: Exception, context, name: str):
    """Map a domain error to its status; anything unexpected to INTERNAL without leaking internals."""
    if isinstance(exc, GymError):
        context.abort(exc.code, str(exc))
    log.error("unexpected error in %s", name, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, "internal server error; the operator's log has details")


def _guard(method):
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped by _abort
            _abort(exc, context, method.__name__)

    wrapper.__name__ = method.__name__
    return wrapper


def _guard_stream(method):
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped by _abort
            _abort(exc, context, method.__name__)

    wrapper.__name__ = method.__name__
    return wrapper


class GymServicer(gym_pb2_grpc.GymServicer):
    """`policy`: the rounds' (sync or async) policy; `notify`: called after each accepted submission (the
    round manager's wake-up; an ingest process has none, and the manager polls the store every second).
    Each call reads the settings once, through `settings()` (an ingest process's follow `serve`'s)."""

    def __init__(self, state: ServerState, config: ServerConfig, policy, *, notify: Callable[[], None] | None = None,
                 pending: PendingSlots | None = None) -> None:
        self.state = state
        self._settings = (config, policy)
        self.notify = notify or (lambda: None)
        pending = pending or PendingSlots(total=config.max_pending_headers,
                                          per_peer=config.max_pending_headers_per_peer)
        self.upload_slots = UploadSlots(max_uploads=config.max_uploads, pending=pending, gate=handlers.UploadGate())
        self.admission = Admission.from_config(config, server_public_key=state.public_key)
        self.download_slots = DownloadSlots(max_streams=config.max_downloads,
                                            idle_timeout=config.download_idle_timeout)

    def settings(self) -> tuple[ServerConfig, object]:
        """(config, policy) for one call."""
        return self._settings

    @_guard
    def Register(self, request, context):
        self.settings()  # an ingest process's admission follows serve's
        cid, created = handlers.register(public_key=request.public_key, display_name=request.display_name,
                                         nonce=request.nonce, signature=request.signature, invite=request.invite,
                                         peer=context.peer(), state=self.state, admission=self.admission)
        return gym_pb2.RegisterResponse(contributor_id=cid, created=created, server_public_key=self.state.public_key)

    @_guard
    def GetRound(self, request, context):
        handlers.check_contributor_id(request.contributor_id, required=False)
        cfg, policy = self.settings()
        v = handlers.round_view(state=self.state, contributor_id=request.contributor_id, nonce=request.nonce,
                                signed_at_unix=request.signed_at_unix, signature=request.signature,
                                sample_rate=cfg.sample_rate, dp_delta=cfg.soup.dp_delta)
        sampled = {} if cfg.sample_rate >= 1.0 else {"sample_rate": cfg.sample_rate,
                                                       "selected_count": v.selected_count, "selected": v.selected}
        if cfg.client_lr_decay:
            sampled["client_lr_scale"] = cfg.client_lr_scale(v.round.id)
        info = gym_pb2.RoundInfo(
            round_id=v.round.id, state=_STATES[v.round.state], base_checkpoint_id=v.round.id - 1,
            base_sha256=v.round.base_sha256, base_size=v.base_size, deadline_unix=v.round.deadline_unix,
            accepted_codecs=list(codec.CODECS), submissions=v.submissions, min_contributors=cfg.min_contributors,
            you_submitted=v.you_submitted, message=v.round.message, aggregator=cfg.soup.aggregator,
            dp_epsilon_spent=v.dp_epsilon_spent, dp_delta=cfg.soup.dp_delta, dp_epsilon_round=v.dp_epsilon_round,
            dp_epsilon_spent_rdp=v.dp_epsilon_spent_rdp, **sampled,
            dp_participation=cfg.soup.dp_participation if cfg.soup.dp_enabled else "", mirrors=cfg.mirrors,
            server_public_key=self.state.public_key, mode=policy.name, **policy.round_info(),
            limits=gym_pb2.Limits(max_payload_bytes=cfg.max_payload_bytes, max_chunk_bytes=cfg.max_chunk_bytes,
                                  download_chunk_bytes=cfg.download_chunk_bytes,
                                  max_delta_norm=cfg.soup.max_delta_norm or 0.0))
        return sign_round_info(info, key=self.state.key)  # everything but you_submitted is signed (selected too)

    @_guard_stream
    def DownloadCheckpoint(self, request, context):
        sha = request.checkpoint_sha256
        chunks = handlers.download(sha256=sha, offset=request.offset, state=self.state, config=self.settings()[0])
        for offset, data, total in self.download_slots.stream(context, chunks):
            yield gym_pb2.CheckpointChunk(offset=offset, data=data, total_size=total, sha256=sha)

    @_guard
    def SubmitDelta(self, request_iterator, context):
        cfg, policy = self.settings()
        # A pending-header slot first, taken without waiting (RESOURCE_EXHAUSTED "server busy" if none);
        # the header must arrive within header_timeout, and the upload slot and the upload's own time
        # limits come only once it verified (slot.hold, entered by submit_delta). See upload_slots.py.
        with self.upload_slots.admit(context.peer()) as slot:
            stream = BoundedStream(request_iterator, idle_timeout=cfg.upload_idle_timeout,
                                   first_timeout=cfg.header_timeout)
            try:
                first = next(stream, None)
                if first is None or first.WhichOneof("part") != "header":
                    raise InvalidArgument("the first SubmitRequest must carry the SubmitHeader")
                h = first.header
                header = handlers.SubmitHeader(
                    contributor_id=h.contributor_id, round_id=h.round_id, base_sha256=h.base_sha256,
                    payload_sha256=h.payload_sha256, payload_size=h.payload_size,
                    manifest=tuple((t.name, tuple(t.shape), t.dtype, t.codec) for t in h.manifest),
                    nonce=h.nonce, signature=h.signature, metadata_json=h.metadata_json)
                slot.on_verified = lambda: stream.set_deadline(cfg.upload_deadline_s(header.payload_size))
                sub = handlers.submit_delta(header, _chunks(stream), state=self.state, config=cfg,
                                             policy=policy, gate=slot)
            finally:
                stream.close()
        self.notify()
        return gym_pb2.SubmitResponse(submission_id=sub.id, round_id=sub.round_id,
                                      payload_sha256=sub.payload_sha256,
                                      submissions=count_submissions(self.state, sub.round_id))

    @_guard
    def GetBalance(self, request, context):
        from zoo_gym.server.rounds.settlement import balance_of

        handlers.check_contributor_id(request.contributor_id)
        if self.settings()[0].soup.dp_enabled:  # a balance is a per-person figure outside the ε: its owner's only
            with self.state.session() as s:
                asker = handlers.signed_asker(s, contributor_id=request.contributor_id, nonce=request.nonce,
                                              signed_at_unix=request.signed_at_unix, signature=request.signature,
                                              method="GetBalance")
            if asker != request.contributor_id:
                raise PermissionDenied("this server runs with differential privacy: a balance is shown only to its "
                                       "owner; sign the request with the contributor's key (gym-client rewards does)")
        b = balance_of(self.state, request.contributor_id)
        return gym_pb2.Balance(contributor_id=request.contributor_id, balance=b["balance"],
                               reputation=b["reputation"], entries=b["entries"], last_seq=b["last_seq"])

    @_guard_stream
    def StreamLedger(self, request, context):
        from zoo_gym.server.rounds.settlement import ledger_entries

        handlers.check_ledger_query(contributor_id=request.contributor_id, since_seq=request.since_seq)
        with self.state.session() as s:
            asker = handlers.signed_asker(s, contributor_id=request.contributor_id, nonce=request.nonce,
                                          signed_at_unix=request.signed_at_unix, signature=request.signature,
                                          method="StreamLedger")
        soup = self.settings()[0].soup
        if (soup.dp_enabled and soup.dp_participation == "private" and request.contributor_id
                and not request.whole_ledger and asker != request.contributor_id):
            raise PermissionDenied("this server keeps participation private: only a contributor may ask for its own "
                                   "entries (sign the request with its key, as gym-client rewards does)")
        entries = ledger_entries(self.state, contributor=None if request.whole_ledger else request.contributor_id or None,
                                 since_seq=request.since_seq, limit=request.limit or None)
        if soup.dp_enabled:  # scores, pay and reasons come from un-noised deltas: their owner's only
            entries = handlers.private_ledger_view(entries, asker=asker, participation=soup.dp_participation)
        for e in self.download_slots.stream(context, iter(entries), what="ledger stream"):
            yield gym_pb2.LedgerEntry(**e)

    @_guard
    def GetLedgerHead(self, request, context):
        return ledger_head(self.state)


def _chunks(request_iterator) -> Iterator[bytes]:
    for req in request_iterator:
        if req.WhichOneof("part") != "chunk":
            raise InvalidArgument("only the first SubmitRequest may carry a header; the rest carry chunks")
        yield req.chunk


def _bind_error(host: str, port: int) -> OSError | None:
    """Why binding host:port as gRPC does (SO_REUSEADDR, no SO_REUSEPORT) fails; None if it would not."""
    import errno
    import socket

    try:
        addrs = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return OSError(f"cannot bind {host}:{port}: {exc.strerror}")
    failures = []
    for family, kind, proto, _, addr in addrs:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return OSError(f"port {port} is already in use on {host} (another gym-server or program "
                                   "listens there); stop it or choose another --port")
                failures.append(exc)
    if failures and len(failures) == len(addrs):  # gRPC binds what it can of several addresses
        return OSError(f"cannot bind {host}:{port}: {failures[0].strerror} (not an address of this machine?)")
    return None


def _grpc_server(config: ServerConfig, pending: PendingSlots, metrics: ServerMetrics) -> grpc.Server:
    """The gRPC server with its thread pool sized by the slots and its interceptors.

    One pool serves every RPC, and grpcio queues an RPC when all its threads are taken. A call takes a slot
    without waiting: a pending slot until its first message arrives (first_message.py), an upload slot while it
    uploads (upload_slots.py), a download slot while it streams (download_slots.py); the query_workers left over
    always answer health, GetRound, Register and balance queries. `maximum_concurrent_rpcs` stays unset: it is
    one counter over all methods, so reaching it would refuse health checks and GetRound too."""
    options = [
        # Large data travels in chunks; a message is at most one chunk plus a small header.
        ("grpc.max_receive_message_length", config.max_chunk_bytes + (1 << 20)),
        ("grpc.max_send_message_length", config.download_chunk_bytes + (1 << 20)),
        # One server per port: without this a second server binds the same port and takes half the clients.
        ("grpc.so_reuseport", 0),
    ]
    workers = config.max_uploads + config.max_pending_headers + config.max_downloads + config.query_workers
    return grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gym-rpc"),
                       options=options,
                       # outermost first: a unary call's request must arrive in time (first_message.py);
                       # bytes that do not parse are INVALID_ARGUMENT (wire.py), not INTERNAL
                       interceptors=[FirstMessageDeadline(pending, timeout=config.header_timeout),
                                     MalformedRequests(), metrics.interceptor])  # then metrics and logs


def _add_services(server: grpc.Server, servicer: GymServicer) -> None:
    gym_pb2_grpc.add_GymServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("zoo_gym.v1.Gym", health_pb2.HealthCheckResponse.SERVING)
    names = (gym_pb2.DESCRIPTOR.services_by_name["Gym"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)


def _bind(server: grpc.Server, config: ServerConfig) -> int:
    address = f"{config.host}:{config.port}"
    credentials = None
    if not config.insecure:
        from zoo_gym.proto.tls import server_credentials

        credentials = server_credentials(certfile=config.ssl_certfile, keyfile=config.ssl_keyfile,
                                         ca_certfile=config.ssl_ca_certfile)  # TLSError names a bad file
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpcio >= 1.5x raises where older ones returned 0
        port = 0
    if port == 0:  # taken between the check and here, or an address the check could not judge
        raise _bind_error(config.host, config.port) or OSError(
            f"cannot bind {config.host}:{config.port} (in use, or not an address of this machine)")
    return port


def listen(config: ServerConfig, metrics: ServerMetrics,
           servicer: Callable[[PendingSlots], GymServicer]) -> tuple[grpc.Server, int]:
    """Create (not start) a gRPC server with `servicer(pending)` on config.host:config.port; returns (server,
    bound port). Raises OSError naming the port when another process listens on it. grpcio's Python server sets
    SO_REUSEPORT by default, and then a second server on the port starts as well and the kernel splits
    the clients between two federations; it is turned off, and the port is tried with a plain socket
    first so that the refusal is one line (grpc's own bind failure also logs its C-core error)."""
    config.check_transport()
    if config.port != 0 and (refused := _bind_error(config.host, config.port)):
        raise refused
    pending = PendingSlots(total=config.max_pending_headers, per_peer=config.max_pending_headers_per_peer)
    server = _grpc_server(config, pending, metrics)
    _add_services(server, servicer(pending))
    return server, _bind(server, config)


def build_server(state: ServerState, config: ServerConfig) -> tuple[grpc.Server, int, RoundManager]:
    """`listen` with the servicer of `gym-server serve`, beside its round manager (not started either);
    returns (server, bound port, rounds). Scores on the state's validation file unless the config names one."""
    from zoo_gym.server.store.state import use_init_validation

    config.check_transport()
    use_init_validation(config, state)
    rounds = RoundManager(state, config)
    server, port = listen(config, rounds.metrics, lambda pending: GymServicer(state, config, rounds.policy,
                                                                            notify=rounds.notify, pending=pending))
    return server, port, rounds
