"""One pass per published base: the held-out loss of a new checkpoint takes the scoring set's part from
the forward pass of the next round's scoring gradient, and the next round's scoring gets that very
evaluator (and gradient) back, through the blob store's archive round trip."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from zoo_gym.gym_train import heldout_loss
from zoo_gym.proto import archive
from zoo_gym.server.config import build_config
from zoo_gym.evaluation.server_evaluator import ServerEvaluator
from zoo_gym.server.rounds.evaluation import Evaluators
from zoo_gym.server.genesis import init_state


def _publish_like(base_dir, out, *, seed: int):
    """Write base + a small change to `out` (as publish_round does) and return its blob sha256."""
    shutil.copytree(base_dir, out, ignore=shutil.ignore_patterns(archive.WEIGHTS, archive.LINEAGE))
    weights = load_file(str(base_dir / archive.WEIGHTS))
    gen = torch.Generator().manual_seed(seed)
    weights = {k: v + 1e-2 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(weights, str(out / archive.WEIGHTS), metadata={"format": "pt"})
    archive.write_lineage(out, {"round": 1, "parent_sha256": None})


def _commit(state, out) -> str:
    with state.blobs.writer() as w:
        archive.pack(out, w)
        return w.commit()


def test_published_base_is_scored_with_the_evaluator_that_measured_it(tmp_path):
    state = init_state(tmp_path / "state", base_model="tiny")
    # float32: compared with the whole model's float32 numbers (bf16 evaluation: test_golden.py, test_streamed.py)
    config = build_config({}, port=0, validation_examples=40, evaluation_dtype="float32")
    with state.session() as s:
        genesis = state.current_round(s).base_sha256
    evaluators = Evaluators(state, config)
    ev = evaluators.for_base(genesis)
    assert ev._gradient is None  # noqa: SLF001 (the first base: nothing computed yet)
    out = tmp_path / "ckpt"
    _publish_like(state.checkpoint_dir(genesis), out, seed=1)
    # Execute: what publish_round does with the new checkpoint, then the next round's lookup
    loss = evaluators.measure_published(ev, out)
    want = heldout_loss(out, list(ev.examples))  # the padded reference on all 40 examples
    sha = _commit(state, out)
    nxt = evaluators.for_base(sha)
    # Assert: the same held-out loss; the next round reuses the evaluator and its gradient
    assert loss == pytest.approx(want, rel=1e-5)  # float32 sums in another order: ~1e-7 here, CPU-dependent
    assert loss != pytest.approx(ev.loss(None), rel=1e-4)  # it measured the new weights
    assert nxt._gradient is not None  # noqa: SLF001 (computed in the held-out pass)
    fresh = ServerEvaluator(state.checkpoint_dir(sha), list(ev.examples))
    ref = fresh.gradient()
    g = nxt.gradient()
    assert g.base_loss == pytest.approx(ref.base_loss, rel=1e-5)  # float32 sums in another order: ~1e-7 here, CPU-dependent
    for k, v in ref.grad.items():
        assert float((g.grad[k] - v).norm()) <= 1e-4 * float(v.norm()) + 1e-9, k
    assert evaluators.for_base(sha) is nxt  # cached for the round
    # A checkpoint that was not measured this way gets a fresh evaluator (no stale gradient).
    other = tmp_path / "other"
    _publish_like(state.checkpoint_dir(genesis), other, seed=2)
    sha2 = _commit(state, other)
    assert evaluators.for_base(sha2)._gradient is None  # noqa: SLF001


def test_exact_scoring_measures_the_held_out_loss_without_a_backward(tmp_path):
    """Exact scoring under a rule without a reference direction reads no gradient: the held-out loss of a new
    checkpoint is the same number, measured with no gradient computed (the backward is the costlier pass)."""
    state = init_state(tmp_path / "state", base_model="tiny")
    config = build_config({}, port=0, validation_examples=40, evaluation_dtype="float32", scoring_method="exact")
    with state.session() as s:
        genesis = state.current_round(s).base_sha256
    evaluators = Evaluators(state, config)
    ev = evaluators.for_base(genesis)
    assert evaluators.prepare(genesis, heldout=True) == ["held-out loss"]  # the evaluator was built above
    assert not ev.has_gradient
    assert ev.loss(None) == pytest.approx(heldout_loss(state.checkpoint_dir(genesis), list(ev.examples)), rel=1e-5)
    out = tmp_path / "ckpt"
    _publish_like(state.checkpoint_dir(genesis), out, seed=1)
    loss = evaluators.measure_published(ev, out)
    assert loss == pytest.approx(heldout_loss(out, list(ev.examples)), rel=1e-5)
    assert not evaluators.for_base(_commit(state, out)).has_gradient
    # a rule that weighs by the descent direction still gets its gradient
    trust = Evaluators(state, build_config({}, port=0, validation_examples=40, scoring_method="exact",
                                           aggregator="trust-mean"))
    assert "scoring gradient" in trust.prepare(genesis, heldout=True)
