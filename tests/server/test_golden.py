"""Golden rounds: fixed submissions publish the same checkpoints and pay the same ledger entries, release after release.

Two synchronous rounds under the default rule (the trimmed mean) and two asynchronous flushes (one with a stale
delta), with evaluation and first-order scoring on. Contributors' keys are fixed, and so are their deltas: a stored
gradient direction (golden/directions.safetensors) plus seeded float64 noise, rounded to float32, the same bytes on
every CPU (a gradient computed here would not be: float32 kernels differ by CPU). What the server computes with its
float32 kernels (held-out losses, scoring gradients and so scores, reputations) differs in the last bits from one
CPU to another (AVX2 and AVX-512 kernels sum in other orders; the bf16 gradient spill turns that into ~1e-4 of a
score), and the lineage in the archive carries those numbers, so the archive's sha256 does too. Compared exactly:
the published weights' sha256, every lineage and ledger field that is not such a number, the pool each round
pays. Compared to 2e-3 relative: those numbers (1.5e-2 where a message prints them to 3-4 digits); each payout
to one unit (a score's last digits can move a rounding). The rounds evaluate in float32 (`evaluation_dtype`; auto
would pick bf16 on a CPU that has it and float32 elsewhere); the bf16 test here checks that bf16 evaluation keeps
every round's score order and held-out losses. Re-record only for a change that is meant to alter
what is published: `ZOO_GYM_RECORD_GOLDEN=1 pytest tests/server/test_golden.py`; every case must then pass with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` too (other kernels, the way another CPU runs them).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym import codec

GOLDEN = Path(__file__).parent / "golden" / "rounds.json"
DIRECTIONS = Path(__file__).parent / "golden" / "directions.safetensors"  # the deltas' gradient parts
_RECORDED: dict = {}


def _recording() -> bool:
    return os.environ.get("ZOO_GYM_RECORD_GOLDEN") == "1"
CODECS = ("bitdelta", "fp16", "int8")


def _key(i: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32)


def _direction(fed, role: str, names: int = 4) -> dict:
    """Minus the held-out loss's gradient at the current base, `names` weight matrices of it: read from
    DIRECTIONS (bf16), or, when recording, computed there and kept for DIRECTIONS. The gradient comes from float32
    kernels, whose last bits differ by CPU: stored, every CPU submits the same bytes."""
    import torch
    from safetensors.torch import load_file

    if not _recording():
        return {k.split("/", 1)[1]: v for k, v in load_file(DIRECTIONS).items() if k.startswith(role + "/")}
    from zoo_gym.gym_train import default_validation_examples
    from zoo_gym.evaluation.server_evaluator import ServerEvaluator

    sha = fed.round().base_sha256
    grad = ServerEvaluator(fed.state.checkpoint_dir(sha), default_validation_examples(n=32)).gradient().grad
    chosen = [k for k, t in grad.items() if t.dim() == 2 and "embed" not in k][:names]
    out = {k: (-grad[k]).to(torch.bfloat16) for k in sorted(chosen)}  # the file's order
    _RECORDED.update({f"{role}/{k}": v for k, v in out.items()})
    return out


def _helpful(direction: dict, seed: int, *, scale: float = 1e-2) -> dict:
    """A delta the scoring pays for, different for every seed: the direction plus seeded noise, each of norm
    `scale`, in float64 (its float32 rounding the same on every CPU)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, d in direction.items():
        d = d.double()
        noise = torch.randn(d.shape, generator=g, dtype=torch.float64)  # float64: the same draws on every CPU
        out[k] = (scale * (d / d.norm() + 0.2 * noise / noise.norm())).float()
    return out


def _published(fed, sha: str) -> dict:
    """A published checkpoint: its weights' sha256 and its lineage (the signature, over CPU-dependent numbers, left out)."""
    import hashlib

    from zoo_gym.proto import archive

    model_dir, weights = fed.state.checkpoint_files(sha)
    with open(weights.path, "rb") as f:
        f.seek(weights.offset)
        digest = hashlib.sha256(f.read(weights.length)).hexdigest()
    lineage = json.loads((model_dir / archive.LINEAGE).read_text())
    lineage.pop("server_signature")
    # archives' sha256s (the parent's, the history's) cover their lineages' scores: the weights are compared instead
    lineage.pop("parent_sha256")
    for earlier in lineage["history"]:
        earlier.pop("sha256", None)
    return {"weights_sha256": digest, "lineage": lineage}


def _entries(fed) -> list[dict]:
    from zoo_gym.server.rounds.settlement import ledger_entries

    keep = ("seq", "round_id", "contributor_id", "kind", "amount", "reason")
    out = []
    for e in ledger_entries(fed.state, contributor=None, since_seq=0, limit=None):
        row = {k: e[k] for k in keep}
        row["score"] = e["score"]
        row["reputation_after"] = e["reputation_after"]
        out.append(row)
    return out


def _sync(fed) -> dict:
    keys = [_key(i) for i in range(3)]
    ids = [fed.register(k)[1] for k in keys]
    published = []
    for rnd in (1, 2):
        direction = _direction(fed, f"sync-{rnd}")
        deltas = [_helpful(direction, 10 * rnd + i, scale=5e-3 * (1 + i)) for i in range(3)]
        for i, (key, cid) in enumerate(zip(keys, ids)):
            fed.submit(key, cid, codec.encode(deltas[i], codec=CODECS[i]))
        published.append(_published(fed, fed.wait_published(rnd).published_sha256))
    return {"published": published, "ledger": _entries(fed)}


def _async(fed) -> dict:
    keys = [_key(10 + i) for i in range(4)]
    ids = [fed.register(k)[1] for k in keys]
    base0 = fed.round().base_sha256
    direction = _direction(fed, "async-1")
    stale = _helpful(direction, 50)  # trained on version 0, sent after version 1 is out
    first = [_helpful(direction, 40 + i) for i in range(3)]
    for i in range(3):
        fed.submit(keys[i], ids[i], codec.encode(first[i], codec="bitdelta"), round_id=1)
    v1 = fed.wait_published(1).published_sha256
    # one stale delta (trained on version 0) among two fresh ones
    fed.submit(keys[3], ids[3], codec.encode(stale, codec="bitdelta"), round_id=1,
               base_sha256=base0)
    direction = _direction(fed, "async-2")
    second = [_helpful(direction, 60 + i) for i in range(2)]
    for i in range(2):
        fed.submit(keys[i], ids[i], codec.encode(second[i], codec="fp16"), round_id=2)
    v2 = fed.wait_published(2).published_sha256
    return {"published": [_published(fed, v1), _published(fed, v2)], "ledger": _entries(fed)}


@pytest.fixture
def fixed_server_key(monkeypatch):
    """Every state directory gets the same server key: the published archives carry its signature."""
    from cryptography.hazmat.primitives import serialization

    from zoo_gym.proto import signing

    original = signing.load_or_create_key

    def load_or_create(path):
        path = Path(path)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_key(99).private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
        return original(path)

    monkeypatch.setattr(signing, "load_or_create_key", load_or_create)


@pytest.mark.slow
def test_fixed_submissions_publish_the_recorded_checkpoints_and_ledger(federation_with, db_backend, fixed_server_key):
    sync = _sync(federation_with(min_contributors=3, aggregator=None, validation_examples=32, reward_pool=1000,
                                 evaluation_dtype="float32"))
    flushes = _async(federation_with(mode="async", buffer_size=3, max_staleness=2, aggregator=None,
                                     validation_examples=32, reward_pool=1000, evaluation_dtype="float32"))
    got = {"sync": sync, "async": flushes}
    if _recording() and db_backend == "sqlite":
        from safetensors.torch import save_file

        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        save_file(_RECORDED, DIRECTIONS)
    want = json.loads(GOLDEN.read_text())
    for mode in ("sync", "async"):
        _assert_same(got[mode]["published"], want[mode]["published"], f"{mode}.published")
        _assert_same(got[mode]["ledger"], want[mode]["ledger"], f"{mode}.ledger")
        assert _pools(got[mode]["ledger"]) == _pools(want[mode]["ledger"])  # each round pays its whole pool


@pytest.mark.slow
def test_bfloat16_evaluation_keeps_the_score_order_and_the_heldout_losses(federation_with, fixed_server_key):
    """The same sync rounds with the held-out passes and the scoring gradient in bf16 (issue 29: bf16 weights,
    float32 accumulation): every round ranks its contributors as the recorded float32 rounds do, pays the same
    ones, and every published checkpoint's held-out loss is within 1e-3 of float32's."""
    got = _sync(federation_with(min_contributors=3, aggregator=None, validation_examples=32, reward_pool=1000,
                                evaluation_dtype="bfloat16"))
    want = json.loads(GOLDEN.read_text())["sync"]

    def ranking(ledger: list[dict]) -> dict:
        rounds: dict = {}
        for e in ledger:
            rounds.setdefault(e["round_id"], []).append((e["score"], e["contributor_id"], e["amount"] > 0))
        return {r: [(cid, paid) for _, cid, paid in sorted(rows, reverse=True)] for r, rows in rounds.items()}

    assert ranking(got["ledger"]) == ranking(want["ledger"])
    for g, w in zip(got["published"], want["published"], strict=True):
        for gh, wh in zip(g["lineage"]["history"], w["lineage"]["history"], strict=True):
            assert math.isclose(gh["heldout_loss"], wh["heldout_loss"], rel_tol=1e-3), (gh, wh)


_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")


def _assert_same(got, want, where: str) -> None:
    """`got` equals `want` but for the numbers a CPU's float kernels move (the module's docstring says how far)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, str):  # a message: its words exactly, the numbers it prints to 3-4 digits nearly
        assert isinstance(got, str) and _NUMBER.split(got) == _NUMBER.split(want), (where, got, want)
        for g, w in zip(_NUMBER.findall(got), _NUMBER.findall(want)):
            assert math.isclose(float(g), float(w), rel_tol=1.5e-2, abs_tol=1e-12), (where, got, want)
    elif isinstance(want, float):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=2e-3, abs_tol=1e-12), (where, got, want)
    elif where.endswith(".amount"):
        assert abs(got - want) <= 1, (where, got, want)
    else:
        assert got == want, (where, got, want)


def _pools(ledger: list[dict]) -> dict:
    out: dict = {}
    for e in ledger:
        out[e["round_id"]] = out.get(e["round_id"], 0) + e["amount"]
    return out
