"""`join --keep-variant` never blocks a round (issue 30: the variant's scale distillation ran between rounds,
9.5 min after round 1, so round-2 uploads reached the server seconds before its deadline): each round's
delta is kept aside, the next round trains at once, and every variant is distilled after the last round,
each with its own progress line."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym import codec
from zoo_gym.client import contribute as contribute_module
from zoo_gym.client.contribute import Contributor, RoundTrainer, contribute
from zoo_gym.client.download import Fetched
from zoo_gym.client.join import Rounds
from zoo_gym.gym_train import TrainConfig
from zoo_gym.proto import gym_pb2

PAYLOAD = codec.encode({"w": torch.ones(4, 4)}, codec="fp16")


def _info(round_id):
    return gym_pb2.RoundInfo(round_id=round_id, state=gym_pb2.ROUND_STATE_OPEN, base_sha256=f"{round_id:064x}",
                             base_size=1, max_staleness=4)


def test_the_next_round_trains_before_any_variant_is_distilled(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []

    def child(fn, *args, **kw):  # the training process, faked: what ran, in order
        if fn is contribute_module._train_and_encode:
            events.append(("train", kw["base_sha256"][-1]))
            kw["payload_path"].write_bytes(PAYLOAD)
            kw["delta_path"].write_bytes(b"delta")
            return {"loss_before": 2.0, "loss_after": 1.5}
        assert fn is contribute_module._keep_variant
        delta_path, model_dir = args
        assert delta_path.read_bytes() == b"delta" and model_dir == tmp_path / f"base{kw['checkpoint_sha256'][-1]}"
        assert kw["distill_steps"] == 7 and kw["device"] == "auto"  # join's --distill-steps and --device reach it
        events.append(("distil", kw["checkpoint_sha256"][-1]))
        kw["out"].write_bytes(b"variant")
        return {"path": str(kw["out"]), "bytes": 7}

    monkeypatch.setattr(contribute_module, "run_in_child", child)
    monkeypatch.setattr(contribute_module, "fetch",
                        lambda stub, sha, *a, **k: Fetched(tmp_path / f"base{sha[-1]}", "server"))
    said: list[str] = []
    opts = SimpleNamespace(workdir=tmp_path, progress=False, max_wait=60, keep_variant=True, distill_steps=7)
    (tmp_path / "variants").mkdir()
    trainer = RoundTrainer(opts, TrainConfig(), None, [{"instruction": "a", "output": "b"}], [], said.append)
    answers = iter([gym_pb2.SubmitResponse(round_id=r, payload_sha256=codec.sha256_hex(PAYLOAD), submissions=1)
                    for r in (3, 4)])
    stub = SimpleNamespace(SubmitDelta=lambda requests, timeout: next(answers))
    c = Contributor(stub=stub, cid="c" * 32, key=Ed25519PrivateKey.generate(), retry=lambda fn, what: fn(),
                    verified=lambda info: info, trainer=trainer, say=said.append, server_key=b"")

    results = [contribute(_info(r), contributor=c, opts=opts, cadence=Rounds(opts)) for r in (3, 4)]
    assert events == [("train", "3"), ("train", "4")]  # round 4 trained with round 3's variant not yet made
    variants = [r.variant for r in results]
    assert variants == [str(tmp_path / "variants" / f"cccccccc-round{r}.zgd") for r in (3, 4)]

    trainer.distil_variants()  # join() does this after its last round
    assert events[2:] == [("distil", "3"), ("distil", "4")]
    assert all(open(v, "rb").read() == b"variant" for v in variants)
    assert not list(tmp_path.glob("*.delta.pt"))  # the kept deltas are gone once distilled
    lines = [s for s in said if "variant" in s]
    assert lines[0].startswith("variant cccccccc-round3.zgd deferred")
    assert any(s.startswith("distilling variant 1/2") for s in said)
    assert lines[-1] == f"kept variant {variants[1]} (7 bytes)"
