"""Golden rounds: fixed submissions publish the same checkpoints and pay the same ledger entries, release after release.

Recorded on the main of 2026-11-26 (44aaf15), before the server was rebuilt; a change to the server's house must
leave every sha256 and every entry as it is. Two synchronous rounds under the default rule (the trimmed mean) and
two asynchronous flushes (one with a stale delta), with evaluation and first-order scoring on. Contributors' keys and
deltas are fixed, so contributor ids, checkpoints and pay are too; scores and reputations are compared to 6
significant digits (the last bits of a float32 matmul may depend on the CPU's kernels). Re-record only for a change
that is meant to alter what is published: `ZOO_GYM_RECORD_GOLDEN=1 pytest tests/server/test_golden.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym import codec

GOLDEN = Path(__file__).parent / "golden" / "rounds.json"
CODECS = ("bitdelta", "fp16", "int8")


def _key(i: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32)


def _helpful(fed, seed: int, *, scale: float = 1e-2, names: int = 4) -> dict:
    """Minus the held-out loss's gradient at the current base plus seeded noise: a delta the scoring pays for,
    different for every seed."""
    import torch

    from zoo_gym.gym_train import default_validation_examples
    from zoo_gym.server.rounds.evaluation import ServerEvaluator

    sha = fed.round().base_sha256
    grad = ServerEvaluator(fed.state.checkpoint_dir(sha), default_validation_examples(n=32)).gradient().grad
    g = torch.Generator().manual_seed(seed)
    chosen = [k for k, t in grad.items() if t.dim() == 2 and "embed" not in k][:names]
    out = {}
    for k in chosen:
        noise = torch.randn(grad[k].shape, generator=g)
        out[k] = -scale * (grad[k] / grad[k].norm() + 0.2 * noise / noise.norm())
    return out


def _entries(fed) -> list[dict]:
    from zoo_gym.server.rounds.settlement import ledger_entries

    keep = ("seq", "round_id", "contributor_id", "kind", "amount", "reason")
    out = []
    for e in ledger_entries(fed.state, contributor=None, since_seq=0, limit=None):
        row = {k: e[k] for k in keep}
        row["score"] = float(f"{e['score']:.6g}")
        row["reputation_after"] = float(f"{e['reputation_after']:.6g}")
        out.append(row)
    return out


def _sync(fed) -> dict:
    keys = [_key(i) for i in range(3)]
    ids = [fed.register(k)[1] for k in keys]
    published = []
    for rnd in (1, 2):
        deltas = [_helpful(fed, 10 * rnd + i, scale=5e-3 * (1 + i)) for i in range(3)]
        for i, (key, cid) in enumerate(zip(keys, ids)):
            fed.submit(key, cid, codec.encode(deltas[i], codec=CODECS[i]))
        published.append(fed.wait_published(rnd).published_sha256)
    return {"published": published, "ledger": _entries(fed)}


def _async(fed) -> dict:
    keys = [_key(10 + i) for i in range(4)]
    ids = [fed.register(k)[1] for k in keys]
    base0 = fed.round().base_sha256
    stale = _helpful(fed, 50)  # trained on version 0, sent after version 1 is out
    first = [_helpful(fed, 40 + i) for i in range(3)]
    for i in range(3):
        fed.submit(keys[i], ids[i], codec.encode(first[i], codec="bitdelta"), round_id=1)
    v1 = fed.wait_published(1).published_sha256
    # one stale delta (trained on version 0) among two fresh ones
    fed.submit(keys[3], ids[3], codec.encode(stale, codec="bitdelta"), round_id=1,
               base_sha256=base0)
    second = [_helpful(fed, 60 + i) for i in range(2)]
    for i in range(2):
        fed.submit(keys[i], ids[i], codec.encode(second[i], codec="fp16"), round_id=2)
    v2 = fed.wait_published(2).published_sha256
    return {"published": [v1, v2], "ledger": _entries(fed)}


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
    sync = _sync(federation_with(min_contributors=3, aggregator=None, validation_examples=32, reward_pool=1000))
    flushes = _async(federation_with(mode="async", buffer_size=3, max_staleness=2, aggregator=None,
                                     validation_examples=32, reward_pool=1000))
    got = {"sync": sync, "async": flushes}
    if os.environ.get("ZOO_GYM_RECORD_GOLDEN") == "1" and db_backend == "sqlite":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got["sync"]["published"] == want["sync"]["published"]
    assert got["async"]["published"] == want["async"]["published"]
    assert got["sync"]["ledger"] == want["sync"]["ledger"]
    assert got["async"]["ledger"] == want["async"]["ledger"]
