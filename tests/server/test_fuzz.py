"""A reflection-driven fuzz of every RPC: no request a stranger can send gives INTERNAL or UNKNOWN (issue 14 item 5).

The services, methods and message types are discovered from the running server's reflection service (as a
stranger's tool would see them), not from our generated stubs. Each method of zoo_gym.v1.Gym and of the
health service gets, for each of 3 seeds: the empty message, random messages (integers across each field's
whole range, 2^64 - 1 and negative int64 included, random bytes and unicode strings, random repeated
lengths, nested messages, now and then an id or hash the server knows so deeper checks run), valid signed
requests of our client with one field changed (to reach the checks behind the signature), and garbage bytes
sent raw (identity serializers). Every answer must be OK or a precise refusal; the server must serve after.
"""

from __future__ import annotations

import random
import string

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from zoo_gym import codec
from zoo_gym.client.upload import build_header, get_round_request, register_request, request_stream
from zoo_gym.proto import gym_pb2

SERVICES = ("zoo_gym.v1.Gym", "grpc.health.v1.Health")
SEEDS = (0, 1, 2)
RANDOM_PER_METHOD = 30  # random messages per method and seed
MUTATED_PER_METHOD = 15  # valid requests with one field changed, per method and seed
GARBAGE_PER_METHOD = 10  # raw byte strings per method and seed
CALL_TIMEOUT = 3.0  # seconds; an answer to a malformed request is immediate
MAX_STREAM_ITEMS = 8  # a server stream (ledger, download) is read this far, then cancelled
OPEN_ENDED = {"Watch"}  # health Watch answers once, then waits for changes: read its first answer only
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

_RANGES = {  # the whole range of each integer wire type
    FD.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), FD.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FD.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1), FD.TYPE_ENUM: (-(1 << 31), (1 << 31) - 1),
    FD.TYPE_INT64: (-(1 << 63), (1 << 63) - 1), FD.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    FD.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    FD.TYPE_UINT32: (0, (1 << 32) - 1), FD.TYPE_FIXED32: (0, (1 << 32) - 1),
    FD.TYPE_UINT64: (0, (1 << 64) - 1), FD.TYPE_FIXED64: (0, (1 << 64) - 1),
}


class Fuzzer:
    """Random values for a message descriptor; `known` holds ids and hashes the server has (for depth)."""

    def __init__(self, seed: int, known: list[str]) -> None:
        self.rng = random.Random(seed)
        self.known = known

    def integer(self, lo: int, hi: int) -> int:
        edges = [lo, hi, 0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, (1 << 63) - 1, 1 << 63, -1, -(1 << 63)]
        if self.rng.random() < 0.5:
            return self.rng.choice([e for e in edges if lo <= e <= hi])
        return self.rng.randint(lo, hi)

    def text(self) -> str:
        r = self.rng.random()
        if r < 0.1:  # parsers' worst cases: deep nesting, numbers past float, lone surrogate escapes
            return self.rng.choice(["[" * 100_000, '{"a":' * 50_000, "1e999", "NaN", '"\\ud800"', "{}"])
        if r < 0.3 and self.known:
            return self.rng.choice(self.known)
        if r < 0.5:
            return "".join(self.rng.choices("0123456789abcdef", k=self.rng.choice([0, 31, 32, 33, 64, 65])))
        alphabet = string.printable + "\0\u00e9\u4e2d\U0001f600\ud7ff\ufffd"
        return "".join(self.rng.choices(alphabet, k=self.rng.choice([0, 1, 16, 64, 300, 5000])))

    def blob(self) -> bytes:
        n = self.rng.choice([0, 1, 15, 16, 31, 32, 64, 65, 1000, 70_000])
        return self.rng.randbytes(n)

    def scalar(self, field):
        t = field.type
        if t in _RANGES:
            return self.integer(*_RANGES[t])
        if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
            value = self.rng.choice([0.0, -0.0, 1.0, -1.0, 1e308, -1e308, 1e-320, float("inf"), float("-inf"),
                                     float("nan"), self.rng.uniform(-1e6, 1e6)])
            return value if t == FD.TYPE_DOUBLE or not 3e38 < abs(value) < float("inf") else 3e38
        if t == FD.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == FD.TYPE_STRING:
            return self.text()
        if t == FD.TYPE_BYTES:
            return self.blob()
        raise AssertionError(f"unhandled field type {t} of {field.full_name}")

    def fill(self, msg, depth: int = 0) -> None:
        for field in msg.DESCRIPTOR.fields:
            if self.rng.random() < 0.3:
                continue  # leave some fields unset
            if field.is_repeated:
                for _ in range(self.rng.choice([0, 1, 2, 5, 40])):
                    if field.type == FD.TYPE_MESSAGE:
                        if depth < 3:
                            self.fill(getattr(msg, field.name).add(), depth + 1)
                    else:
                        getattr(msg, field.name).append(self.scalar(field))
            elif field.type == FD.TYPE_MESSAGE:
                if depth < 3:
                    self.fill(getattr(msg, field.name), depth + 1)
            else:
                setattr(msg, field.name, self.scalar(field))

    def message(self, cls):
        msg = cls()
        self.fill(msg)
        return msg

    def mutate(self, msg):
        """A copy of a valid message with one field, at any depth, set to a random value or cleared."""
        out = type(msg)()
        out.CopyFrom(msg)
        target = out
        while True:
            field = self.rng.choice(target.DESCRIPTOR.fields)
            if field.type != FD.TYPE_MESSAGE or field.is_repeated or self.rng.random() < 0.3:
                break
            target = getattr(target, field.name)
        if self.rng.random() < 0.2:
            target.ClearField(field.name)
        elif field.is_repeated:
            target.ClearField(field.name)
            for _ in range(self.rng.choice([1, 2, 40])):
                if field.type == FD.TYPE_MESSAGE:
                    self.fill(getattr(target, field.name).add(), 1)
                else:
                    getattr(target, field.name).append(self.scalar(field))
        elif field.type == FD.TYPE_MESSAGE:  # a whole nested message replaced by a random one
            target.ClearField(field.name)
            self.fill(getattr(target, field.name), 1)
        else:
            setattr(target, field.name, self.scalar(field))
        return out

    def garbage(self) -> bytes:
        r = self.rng.random()
        if r < 0.3:  # a valid tag, then a length that lies
            return bytes([0x0A, 0xFF, 0xFF, 0xFF, 0x0F]) + self.rng.randbytes(self.rng.randint(0, 32))
        if r < 0.5:  # a string field holding invalid UTF-8
            return bytes([0x0A, 0x03, 0xFF, 0xFE, 0xFD])
        return self.rng.randbytes(self.rng.choice([1, 2, 7, 64, 1000]))


def _discover(channel) -> dict[str, list]:
    """service name -> its method descriptors, from the server's reflection service."""
    db = ProtoReflectionDescriptorDatabase(channel)
    listed = set(db.get_services())
    pool = DescriptorPool(db)
    return {name: list(pool.FindServiceByName(name).methods) for name in SERVICES if name in listed}


def _cases(fuzz: Fuzzer, method, valid=None) -> list[tuple[str, object, bool]]:
    """(kind, request, raw) for one method: the empty message, random ones, mutations of `valid` (a valid
    request of ours, or a list of them for a client stream), garbage bytes."""
    cls = GetMessageClass(method.input_type)
    cases = [("empty", cls(), False)]
    for _ in range(RANDOM_PER_METHOD):
        if method.client_streaming:  # SubmitDelta: a stream of 1-3 random SubmitRequests
            cases.append(("random", [fuzz.message(cls) for _ in range(fuzz.rng.randint(1, 3))], False))
        else:
            cases.append(("random", fuzz.message(cls), False))
    if valid is not None:  # one field of a valid (signed) request changed: reaches the checks past the signature
        for _ in range(MUTATED_PER_METHOD):
            if isinstance(valid, list):  # a stream: change its header, or drop, repeat or cut its chunks
                items = [cls.FromString(m.SerializeToString()) for m in valid]
                choice = fuzz.rng.randrange(4)
                if choice == 0:
                    items[0] = fuzz.mutate(items[0])
                elif choice == 1:
                    items = items[:-1] or items
                elif choice == 2:
                    items = items + items[-1:]
                else:
                    items[-1] = cls(chunk=items[-1].chunk[: fuzz.rng.randint(0, len(items[-1].chunk))])
                cases.append(("mutated", items, False))
            else:
                cases.append(("mutated", fuzz.mutate(cls.FromString(valid.SerializeToString())), False))
    return cases + [("garbage", fuzz.garbage(), True) for _ in range(GARBAGE_PER_METHOD)]


def _valid_requests(fed, key, cid) -> dict[str, object]:
    """method full name -> a valid request of our own client (a list of them for SubmitDelta)."""
    info = fed.round()
    payload = codec.encode(fed.small_delta(), codec="fp16")
    header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                          payload=payload, metadata={"fuzz": True})
    return {
        "zoo_gym.v1.Gym.Register": register_request(key, "fuzz"),
        "zoo_gym.v1.Gym.GetRound": get_round_request(key, cid),
        "zoo_gym.v1.Gym.DownloadCheckpoint": gym_pb2.DownloadRequest(checkpoint_sha256=info.base_sha256),
        "zoo_gym.v1.Gym.SubmitDelta": list(request_stream(header, payload, chunk_bytes=1 << 14)),
        "zoo_gym.v1.Gym.GetBalance": gym_pb2.BalanceRequest(contributor_id=cid),
        "zoo_gym.v1.Gym.StreamLedger": gym_pb2.LedgerRequest(contributor_id=cid, limit=3),
        "grpc.health.v1.Health.Check": health_pb2.HealthCheckRequest(service="zoo_gym.v1.Gym"),
    }


def _call(channel, method, request, *, raw: bool) -> tuple[grpc.StatusCode, str]:
    """Send one request (a message, a list of them for a client stream, or raw bytes); (status, details)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    ser = None if raw else (lambda m: m.SerializeToString())
    try:
        if method.client_streaming:
            items = request if isinstance(request, list) else [request]
            channel.stream_unary(path, request_serializer=ser)(iter(items), timeout=CALL_TIMEOUT)
        elif method.server_streaming:
            call = channel.unary_stream(path, request_serializer=ser)(request, timeout=CALL_TIMEOUT)
            for i, _ in enumerate(call):
                if i + 1 >= (1 if method.name in OPEN_ENDED else MAX_STREAM_ITEMS):
                    call.cancel()
                    break
        else:
            channel.unary_unary(path, request_serializer=ser)(request, timeout=CALL_TIMEOUT)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_no_request_gives_internal_or_unknown(federation):
    fed = federation
    key, cid = fed.register()
    known = [cid, fed.round().base_sha256]
    valid = _valid_requests(fed, key, cid)
    methods = _discover(fed.channel)
    assert set(methods) == set(SERVICES), f"reflection lists {sorted(methods)}"
    assert {m.name for m in methods["zoo_gym.v1.Gym"]} >= {"Register", "GetRound", "DownloadCheckpoint",
                                                          "SubmitDelta", "GetBalance", "StreamLedger"}
    failures, seen = [], {}
    for seed in SEEDS:
        fuzz = Fuzzer(seed, known)
        for service, descs in methods.items():
            for method in descs:
                for kind, request, raw in _cases(fuzz, method, valid.get(method.full_name)):
                    code, details = _call(fed.channel, method, request, raw=raw)
                    if code in FORBIDDEN:
                        failures.append(f"seed {seed} {method.full_name} {kind}: {code.name} {details!r} "
                                        f"for {request!r:.300}")
                    seen.setdefault(method.name, set()).add(code.name)
    assert not failures, f"{len(failures)} INTERNAL/UNKNOWN answers:\n" + "\n".join(failures[:20])
    assert "INVALID_ARGUMENT" in seen["StreamLedger"] and "INVALID_ARGUMENT" in seen["SubmitDelta"]  # refused

    # still serving
    health = health_pb2_grpc.HealthStub(fed.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="zoo_gym.v1.Gym"), timeout=CALL_TIMEOUT).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert fed.stub.GetRound(gym_pb2.GetRoundRequest(), timeout=CALL_TIMEOUT).state == gym_pb2.ROUND_STATE_OPEN


@pytest.mark.parametrize("metadata_json", ["[" * 100_000, '{"a":' * 50_000])
def test_deeply_nested_metadata_json_is_invalid_argument(federation, metadata_json):
    """metadata_json is not covered by the signature, so any registered key can send a parser's worst case."""
    key, cid = federation.register()
    info = federation.round()
    payload = codec.encode(federation.small_delta(), codec="fp16")
    header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                          payload=payload, metadata={})
    header.metadata_json = metadata_json
    with pytest.raises(grpc.RpcError) as refused:
        federation.stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16), timeout=CALL_TIMEOUT * 5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "metadata_json" in refused.value.details()
    assert federation.stored_submissions() == 0
