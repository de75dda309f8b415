"""`gym-client personalize` writes a servable variant with no server; `join --keep-variant` keeps the round's.

The variant is the codec's bitdelta (groups of 128 along each row, log8 scales) with a manifest naming
the base's weights sha256; it loads over that base and changes its output, and over any other base it is
refused in one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.cli import app
from serving_helpers import base_tensors
from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.gym_train.families import make_random_base
from zoo_gym.serving.model import MultiVariantModel
from zoo_gym.serving.variant import VariantMismatch, load_variant, weights_sha256

pytestmark = pytest.mark.slow


def _data(path, n: int = 12):
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"instruction": f"Say the number {i} twice.", "input": "",
                                 "output": f"{i} {i}"}) + "\n")
    return path


def test_personalize_writes_a_variant_of_this_base_only(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir(), base)
    out = tmp_path / "alice.zgd"
    r = CliRunner().invoke(app, ["personalize", "--data", str(_data(tmp_path / "mine.jsonl")), "--base", str(base),
                                 "--out", str(out), "--max-steps", "4", "--warmup-steps", "0", "--learning-rate", "5e-3",
                                 "--distill-steps", "3", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    payload = out.read_bytes()
    manifest = codec.read_manifest(payload)
    sha = weights_sha256(base)
    assert summary["base_sha256"] == sha == manifest.metadata["base_sha256"]
    assert manifest.metadata["zoo_gym_variant"] == 1 and manifest.metadata["distill_steps"] == 3
    two_d = [e for e in manifest.entries if len(e.shape) == 2]
    assert two_d and all(e.codec == "bitdelta" and e.group_size == 128 and e.scale_dtype == "log8" for e in two_d)

    serving = MultiVariantModel.from_dir(base)
    v = load_variant(out, base_sha256=sha)
    assert v.name == "alice"
    serving.check(v)
    ids = torch.tensor([[5, 17, 30, 41]])
    mask = torch.ones_like(ids)
    assert (serving.logits([v], ids, mask) - serving.logits([None], ids, mask)).abs().max() > 1e-4

    other = make_random_base("llama", tmp_path / "other")
    with pytest.raises(VariantMismatch) as err:
        load_variant(out, base_sha256=weights_sha256(other))
    assert "\n" not in str(err.value) and "built for base" in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--out", "alice.bin"], "NAME.zgd"),
    (["--out", "al ice.zgd"], "variant name"),
    (["--base", "no/such-model-here", "--out", "bob.zgd"], "--base"),
])
def test_bad_personalize_options_exit_2_with_one_line(tmp_path, args, message):
    base_args = ["personalize", "--data", str(_data(tmp_path / "d.jsonl")), "--base", "tiny", "--max-steps", "1"]
    r = CliRunner().invoke(app, base_args + [a if not a.endswith(".zgd") and not a.endswith(".bin") else
                                             str(tmp_path / a) for a in args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_join_keep_variant_keeps_the_round_delta(tmp_path):
    from zoo_gym.client.join import JoinOptions, join
    from zoo_gym.server.config import build_config
    from zoo_gym.server.transport.servicer import build_server
    from zoo_gym.server.genesis import init_state

    state = init_state(tmp_path / "state", base_model="tiny")
    # two contributors close the round: it stays open, so no aggregation thread of this process runs while
    # the client distils (an in-process server is not what a contributor runs beside its client)
    config = build_config({}, port=0, insecure=True, min_contributors=2, aggregator="mean", round_timeout=600)
    server, port, rounds = build_server(state, config)
    server.start()
    rounds.start()
    try:
        opts = JoinOptions(server=f"127.0.0.1:{port}", workdir=tmp_path / "home", key_path=tmp_path / "k.pem",
                           data=str(_data(tmp_path / "mine.jsonl", 16)), max_steps=2, insecure=True, train_overrides={"warmup_steps": 0},
                           wait_for_publish=False, progress=False, keep_variant=True, max_wait=60)
        summaries = join(opts, say=lambda _m: None)
    finally:
        server.stop(grace=None)
        rounds.stop()
    path = summaries[0]["variant"]
    assert path.endswith(f"-round{summaries[0]['round']}.zgd")
    meta = codec.read_manifest(open(path, "rb").read()).metadata
    base_dir = state.checkpoint_dir(meta["checkpoint_sha256"])  # the round's base, as the client downloaded it
    assert meta["base_sha256"] == weights_sha256(base_dir)
    v = load_variant(path, base_sha256=weights_sha256(base_dir))
    MultiVariantModel.from_dir(base_dir).check(v)
    assert v.packed


def test_join_keep_variant_in_async_mode_keeps_each_submitted_delta(tmp_path):
    from zoo_gym.client.join import JoinOptions, join
    from zoo_gym.server.config import build_config
    from zoo_gym.server.transport.servicer import build_server
    from zoo_gym.server.genesis import init_state

    state = init_state(tmp_path / "state", base_model="tiny")
    # a buffer of 2: the one delta stays in the buffer, so no flush runs in this process while the client distils
    config = build_config({}, port=0, insecure=True, mode="async", buffer_size=2, min_contributors=2,
                          aggregator="mean", round_timeout=600)
    server, port, rounds = build_server(state, config)
    server.start()
    rounds.start()
    try:
        opts = JoinOptions(server=f"127.0.0.1:{port}", workdir=tmp_path / "home", key_path=tmp_path / "k.pem",
                           data=str(_data(tmp_path / "mine.jsonl", 16)), max_steps=2, insecure=True,
                           train_overrides={"warmup_steps": 0}, wait_for_publish=False, progress=False,
                           keep_variant=True, distill_steps=0, max_wait=60)
        summaries = join(opts, say=lambda _m: None)
    finally:
        server.stop(grace=None)
        rounds.stop()
    assert summaries[0]["staleness"] == 0
    path = summaries[0]["variant"]
    assert path.endswith("-version0.zgd")
    assert codec.read_manifest(open(path, "rb").read()).metadata["distill_steps"] == 0  # --distill-steps 0 held
    meta = codec.read_manifest(open(path, "rb").read()).metadata
    base_dir = state.checkpoint_dir(meta["checkpoint_sha256"])
    v = load_variant(path, base_sha256=weights_sha256(base_dir))
    MultiVariantModel.from_dir(base_dir).check(v)


def test_a_variant_whose_distillation_runs_out_of_gpu_memory_is_distilled_on_the_cpu(tmp_path, monkeypatch, caplog):
    """The GPU runs out of memory (the distillation keeps every calibration batch's logits there): the variant is
    still written, distilled on the CPU, with a warning saying so. (No GPU here: the CUDA attempt is made to
    raise what torch raises there.)"""
    from zoo_gym.client import personalize as P
    from zoo_gym.gym_train import distill as D
    from zoo_gym.gym_train import builtin_examples

    real, devices = D.distill_bitdelta_scales, []

    def on_a_small_gpu(*args, device, **kw):
        devices.append(str(device))
        if str(device) == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, device=device, **kw)

    monkeypatch.setattr(D, "distill_bitdelta_scales", on_a_small_gpu)
    base = tiny_model_dir()
    delta = {k: 0.01 * torch.randn(v.shape) for k, v in base_tensors(base).items() if v.dim() == 2}
    out = tmp_path / "mine.zgd"
    with caplog.at_level("WARNING"):
        summary = P.save_variant(base, delta, out, calib_examples=builtin_examples("default", n=4), distill_steps=2,
                                 info={}, device="cuda")
    assert devices == ["cuda", "cpu"] and out.exists() and summary["bytes"] == out.stat().st_size
    assert "ran out of memory; distilling on the CPU" in caplog.text
