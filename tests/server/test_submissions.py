"""Every refusal: the precise gRPC status, a message that says what to fix, nothing stored, still serving."""

from __future__ import annotations

import grpc
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym import codec
from zoo_gym.client.upload import build_header, get_round_request
from zoo_gym.proto import gym_pb2


def _refused(call, code: grpc.StatusCode, match: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()
    return info.value


def test_accepted_submission_is_stored_and_counted(federation):
    key, cid = federation.register()
    payload = codec.encode(federation.small_delta(), codec="fp16")
    resp = federation.submit(key, cid, payload)
    assert resp.submissions == 1 and resp.payload_sha256 == codec.sha256_hex(payload)
    assert federation.state.blobs.exists(resp.payload_sha256)
    assert federation.stub.GetRound(get_round_request(key, cid)).you_submitted  # signed: only the owner learns it


def test_forged_signature_is_unauthenticated_and_nothing_is_stored(federation):
    key, cid = federation.register()
    payload = codec.encode(federation.small_delta(), codec="fp16")
    info = federation.round()
    header = build_header(key=Ed25519PrivateKey.generate(), contributor_id=cid, round_id=info.round_id,
                          base_sha256=info.base_sha256, payload=payload, metadata={})
    blobs = federation.blob_count()
    _refused(lambda: federation.submit(key, cid, payload, header=header), grpc.StatusCode.UNAUTHENTICATED,
             "signature")
    assert federation.stored_submissions() == 0 and federation.blob_count() == blobs
    federation.submit(key, cid, payload)  # the server keeps serving: the genuine request goes through
    assert federation.stored_submissions() == 1


def test_unregistered_contributor_is_unauthenticated(federation):
    key = Ed25519PrivateKey.generate()
    from zoo_gym.proto import signing

    cid = signing.contributor_id(signing.public_bytes(key))
    payload = codec.encode(federation.small_delta(), codec="fp16")
    _refused(lambda: federation.submit(key, cid, payload), grpc.StatusCode.UNAUTHENTICATED, "not registered")


def test_replayed_nonce_and_resubmission_are_already_exists(federation):
    key, cid = federation.register()
    payload = codec.encode(federation.small_delta(), codec="fp16")
    nonce = b"\x07" * 16
    federation.submit(key, cid, payload, nonce=nonce)
    _refused(lambda: federation.submit(key, cid, payload, nonce=nonce), grpc.StatusCode.ALREADY_EXISTS, "nonce")
    other = codec.encode(federation.small_delta(seed=1), codec="fp16")
    _refused(lambda: federation.submit(key, cid, other), grpc.StatusCode.ALREADY_EXISTS, "already")
    assert federation.stored_submissions() == 1


def test_stale_round_and_base_are_failed_precondition(federation):
    key, cid = federation.register()
    payload = codec.encode(federation.small_delta(), codec="fp16")
    _refused(lambda: federation.submit(key, cid, payload, round_id=7), grpc.StatusCode.FAILED_PRECONDITION,
             "not open")
    _refused(lambda: federation.submit(key, cid, payload, base_sha256="ab" * 32),
             grpc.StatusCode.FAILED_PRECONDITION, "download the current base")
    assert federation.stored_submissions() == 0


def test_tampered_body_is_invalid_argument(federation):
    key, cid = federation.register()
    payload = codec.encode(federation.small_delta(), codec="fp16")
    info = federation.round()
    header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                          payload=payload, metadata={})
    tampered = bytearray(payload)
    tampered[-1] ^= 0xFF
    _refused(lambda: federation.submit(key, cid, bytes(tampered), header=header), grpc.StatusCode.INVALID_ARGUMENT,
             "sha256")
    assert federation.stored_submissions() == 0


def test_wrong_shape_unknown_tensor_and_nan_are_invalid_argument(federation):
    key, cid = federation.register()
    delta = federation.small_delta(names=1)
    name, t = next(iter(delta.items()))
    cases = [({name: torch.zeros(t.shape[0] + 1, t.shape[1])}, "shape"),
             ({"model.not_a_parameter.weight": torch.zeros(4, 4)}, "not a parameter")]
    for bad, match in cases:
        _refused(lambda: federation.submit(key, cid, codec.encode(bad, codec="fp32")),
                 grpc.StatusCode.INVALID_ARGUMENT, match)
    # Our encoder refuses NaN, so forge the payload a hostile client would send: same bytes, NaN body.
    marker = torch.full(t.shape, 1.2345)
    payload = codec.encode({name: marker}, codec="fp32")
    needle = marker[0, :4].numpy().tobytes()
    nan = torch.full((4,), float("nan")).numpy().tobytes()
    forged = payload.replace(needle, nan, 1)
    assert forged != payload
    _refused(lambda: _submit_raw(federation, key, cid, forged, manifest_from=payload),
             grpc.StatusCode.INVALID_ARGUMENT, "")
    assert federation.stored_submissions() == 0


def test_lora_and_bitdelta_measured_from_what_was_sent_still_refuse_nan_and_overflow(federation):
    """Float32 LoRA factors and BitDelta are measured without decoding (Gram matrices, scales); a NaN in a factor or
    a scale, and factors whose product overflows float32, are still refused, and nothing is stored."""
    from zoo_gym.codec.lora import LoraFactors

    key, cid = federation.register()
    name, t = next(iter(federation.small_delta(names=1).items()))
    out_f, in_f = t.shape
    a, b = torch.full((2, in_f), 1.2345), torch.full((out_f, 2), 1.2345)
    lora = codec.encode({name: LoraFactors(a, b)}, codec="lora", lora_codec="fp32")
    bits = codec.encode({name: torch.full(t.shape, 1.2345)}, codec="bitdelta", group_size=None, scale_dtype="float32")
    nan = torch.full((1,), float("nan")).numpy().tobytes()
    scale = float(codec.read_bitdelta(bits, name).scales.reshape(-1)[0])
    for payload, value, match in ((lora, 1.2345, "NaN or inf"), (bits, scale, "scales must be finite")):
        forged = payload.replace(torch.full((1,), value).numpy().tobytes(), nan, 1)  # a factor's or scale's first
        assert forged != payload
        _refused(lambda: _submit_raw(federation, key, cid, forged, manifest_from=payload),
                 grpc.StatusCode.INVALID_ARGUMENT, match)
    huge = codec.encode({name: LoraFactors(torch.full((2, in_f), 1e30), torch.full((out_f, 2), 1e30))},
                        codec="lora", lora_codec="fp32")
    _refused(lambda: federation.submit(key, cid, huge), grpc.StatusCode.INVALID_ARGUMENT, "NaN or inf")
    assert federation.stored_submissions() == 0
    federation.submit(key, cid, lora)  # the same contributor's honest factors are taken
    assert federation.stored_submissions() == 1


def test_oversized_payload_and_chunk_are_resource_exhausted(federation):
    key, cid = federation.register()
    big = codec.encode(federation.small_delta(names=4), codec="fp32")
    federation.config.max_payload_bytes = len(big) - 1
    _refused(lambda: federation.submit(key, cid, big), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit")
    federation.config.max_payload_bytes = 64 << 20
    payload = codec.encode(federation.small_delta(), codec="fp32")
    assert len(payload) > 4096
    federation.config.max_chunk_bytes = 1024
    _refused(lambda: federation.submit(key, cid, payload, chunk=4096), grpc.StatusCode.RESOURCE_EXHAUSTED, "chunk")
    assert federation.stored_submissions() == 0


def test_garbage_payload_is_invalid_argument(federation):
    key, cid = federation.register()
    payload = b"\x00not a delta at all" * 10
    _refused(lambda: _submit_raw(federation, key, cid, payload),
             grpc.StatusCode.INVALID_ARGUMENT, "not a valid delta")


def _submit_raw(federation, key, cid, payload, manifest_from=None):
    from zoo_gym.client.upload import request_stream
    from zoo_gym.proto import signing

    info = federation.round()
    nonce = signing.new_nonce()
    sha = codec.sha256_hex(payload)
    msg = signing.canonical_bytes(method="SubmitDelta", contributor=cid, round_id=info.round_id,
                                  payload_sha256=sha, nonce=nonce, base_sha256=info.base_sha256)
    header = gym_pb2.SubmitHeader(contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                                  payload_sha256=sha, payload_size=len(payload), nonce=nonce,
                                  signature=signing.sign(key, msg))
    if manifest_from is not None:
        header.manifest.extend(gym_pb2.TensorSpec(name=e.name, shape=list(e.shape), dtype=e.dtype, codec=e.codec,
                                                  nbytes=e.nbytes) for e in codec.read_manifest(manifest_from).entries)
    return federation.stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16))


def test_register_proof_of_possession(federation):
    from zoo_gym.client.upload import register_request

    key = Ed25519PrivateKey.generate()
    req = register_request(key, "alice")
    forged = gym_pb2.RegisterRequest(public_key=req.public_key, display_name="alice", nonce=req.nonce,
                                     signature=bytes(64))
    _refused(lambda: federation.stub.Register(forged), grpc.StatusCode.UNAUTHENTICATED, "proof of possession")
    assert federation.stub.Register(req).created
    _refused(lambda: federation.stub.Register(req), grpc.StatusCode.ALREADY_EXISTS, "nonce")
    again = federation.stub.Register(register_request(key, "alice"))
    assert not again.created and again.contributor_id
