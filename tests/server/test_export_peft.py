"""gym-server export --format peft (issue 30 item 3): a published round's update (its checkpoint minus the
previous one) as a PEFT LoRA adapter by truncated SVD. PeftModel.from_pretrained on the exported previous
round gives the exported round's logits; ranks, errors and what a LoRA cannot carry are reported; a round
whose update cannot be computed is refused in one line."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.codec import LoraFactors
from zoo_gym.server.cli import app
from zoo_gym.server.store.models import Round

LINEAR = ("q_proj", "v_proj", "o_proj", "down_proj", "gate_proj")


def _export(state_dir, out, *args):
    res = CliRunner().invoke(app, ["export", "--state-dir", str(state_dir), str(out), *args])
    return res


def _lora_round(federation, scale: float = 0.15) -> dict:
    """Two contributors send rank-2 LoRA factors on some linear weights; round 1 publishes their mean."""
    shapes = federation.base_shapes()
    names = [k for k, s in shapes.items() if len(s) == 2 and any(p in k for p in LINEAR)]
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        factors = {k: LoraFactors(A=torch.randn(2, shapes[k][1], generator=g) * scale,
                                  B=torch.randn(shapes[k][0], 2, generator=g) * scale) for k in names}
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(factors, codec="lora", lora_codec="fp32"))
    return {"round": federation.wait_published(1), "names": names}


def _logits(model, tok) -> torch.Tensor:
    prompts = ["### Instruction:\n2+3", "### Instruction:\n7+1\n\n### Response:\n", "1 2 3 4"]
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])).logits[0]
                          for p in prompts])


def test_a_rounds_lora_update_loads_with_peft_on_the_previous_round_and_gives_its_logits(federation, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zoo_gym.serving.variant import weights_sha256

    done = _lora_round(federation)
    state_dir = federation.state.root
    for rnd in (0, 1):
        assert _export(state_dir, tmp_path / f"r{rnd}", "--round", str(rnd)).exit_code == 0
    res = _export(state_dir, tmp_path / "adapter", "--format", "peft", "--round", "1")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    # names its base: round 0's checkpoint and the weights sha256 an export of it has
    assert doc["base"] == {"round": 0, "checkpoint_sha256": done["round"].base_sha256,
                           "weights_sha256": weights_sha256(tmp_path / "r0")}
    assert set(doc["tensors"]) == set(done["names"]) and doc["left_out"] == {}
    assert all(t["rank"] == 4 for t in doc["tensors"].values())  # the mean of two rank-2 products
    assert doc["max_relative_error"] <= 1e-3
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert done["round"].base_sha256[:12] in card and "library_name: peft" in card

    tok = AutoTokenizer.from_pretrained(tmp_path / "r0")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "r0")
    before = _logits(base, tok)
    target = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "r1"), tok)
    got = _logits(PeftModel.from_pretrained(base, str(tmp_path / "adapter")), tok)
    tolerance = dict(atol=1e-2, rtol=1.6e-2)  # bf16's
    torch.testing.assert_close(got, target, **tolerance)
    assert not torch.allclose(before, target, **tolerance)  # the check can fail: the round moved the logits
    assert (before - target).abs().max() > 20 * (got - target).abs().max()

    # an explicit small rank: that rank, and the larger error it costs, measured
    res = _export(state_dir, tmp_path / "rank1", "--format", "peft", "--round", "1", "--rank", "1")
    assert res.exit_code == 0, res.output
    small = json.loads(res.output)
    assert all(t["rank"] == 1 for t in small["tensors"].values())
    assert all(small["tensors"][n]["relative_error"] > max(0.1, doc["tensors"][n]["relative_error"])
               for n in doc["tensors"])
    assert json.loads((tmp_path / "rank1" / "adapter_config.json").read_text())["r"] == 1


def test_what_a_lora_cannot_carry_is_reported_and_rounds_without_an_update_are_refused(federation, tmp_path):
    shapes = federation.base_shapes()
    norm = next(k for k, s in shapes.items() if len(s) == 1 and "norm" in k)
    embed = next(k for k in shapes if "embed_tokens" in k)
    linear = next(k for k in shapes if k.endswith("q_proj.weight"))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        key, cid = federation.register()
        delta = {k: torch.randn(shapes[k], generator=g) * 1e-2 for k in (norm, embed, linear)}
        federation.submit(key, cid, codec.encode(delta, codec="fp16"))
    federation.wait_published(1)
    state_dir = federation.state.root

    res = _export(state_dir, tmp_path / "adapter", "--format", "peft")  # the latest published round
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["round"] == 1 and set(doc["left_out"]) == {norm, embed}
    assert all(t["relative_size"] > 0 for t in doc["left_out"].values())
    [(name, t)] = doc["tensors"].items()  # a dense random update: the rank the 1e-3 error needs, at most full
    assert name == linear and 1 < t["rank"] <= min(shapes[linear]) and t["relative_error"] <= 1e-3
    assert norm in (tmp_path / "adapter" / "README.md").read_text()

    for args, said in [(["--round", "9"], "round 9 does not exist"),
                       (["--round", "2"], "round 2 is open: it has published no checkpoint yet"),
                       (["--round", "0"], "round 0 is the base"),
                       (["--round", "1", "--rank", "0"], "--rank must be at least 1")]:
        res = _export(state_dir, tmp_path / "refused", "--format", "peft", *args)
        assert res.exit_code == 2 and said in res.output and len(res.output.strip().splitlines()) == 1, res.output
    with federation.state.session() as s:
        base_sha = s.get(Round, 1).base_sha256
    federation.state.blobs.remove(base_sha)  # what sweeping old checkpoints does
    res = _export(state_dir, tmp_path / "refused", "--format", "peft", "--round", "1")
    assert res.exit_code == 2 and "no longer stored (swept)" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()


def test_a_bf16_gpt2_round_is_factored_from_its_float32_masters_in_the_conv1d_layout(tmp_path):
    """A bf16 base: rounding makes the published difference full-rank, the stored float32 masters are the update;
    GPT-2 stores Conv1D weights (in, out), which PEFT loads with fan_in_fan_out."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zoo_gym.gym_train.families import make_random_base
    from tests.server.conftest import Federation
    from zoo_gym.server.config import build_config
    from zoo_gym.server.genesis import init_state
    from zoo_gym.server.transport.servicer import build_server

    base = make_random_base("gpt2", tmp_path / "base")
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(base)
    state = init_state(tmp_path / "state", base_model=str(base))
    config = build_config({}, port=0, insecure=True, min_contributors=2, aggregator="mean", round_timeout=600,
                          validation_examples=8, max_payload_bytes=16 << 20, max_chunk_bytes=1 << 20)
    server, port, rounds = build_server(state, config)
    server.start()
    rounds.start()
    federation = Federation(state, config, server, port, rounds)
    try:
        shapes = federation.base_shapes()
        names = [k for k, s in shapes.items() if len(s) == 2 and any(p in k for p in ("c_attn", "c_fc", "c_proj"))]
        g = torch.Generator().manual_seed(5)
        for _ in range(2):  # the base layout, as the trainer sends them: B @ A is (in, out) for Conv1D
            factors = {k: LoraFactors(A=torch.randn(2, shapes[k][1], generator=g) * 0.1,
                                      B=torch.randn(shapes[k][0], 2, generator=g) * 0.1) for k in names}
            key, cid = federation.register()
            federation.submit(key, cid, codec.encode(factors, codec="lora", lora_codec="fp32"))
        federation.wait_published(1)
    finally:
        federation.stop()
    for rnd in (0, 1):
        assert _export(tmp_path / "state", tmp_path / f"r{rnd}", "--round", str(rnd)).exit_code == 0
    res = _export(tmp_path / "state", tmp_path / "adapter", "--format", "peft", "--round", "1")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["update_source"] == "float32 masters" and set(doc["tensors"]) == set(names)
    assert all(t["rank"] == 4 for t in doc["tensors"].values()) and doc["max_relative_error"] <= 1e-3
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["fan_in_fan_out"] is True

    tok = AutoTokenizer.from_pretrained(tmp_path / "r0")
    base_model = AutoModelForCausalLM.from_pretrained(tmp_path / "r0", dtype=torch.float32)
    before = _logits(base_model, tok)
    target = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "r1", dtype=torch.float32), tok)
    got = _logits(PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")), tok)
    tolerance = dict(atol=1e-2, rtol=1.6e-2)  # round 1 is the float32 update rounded to bf16
    torch.testing.assert_close(got, target, **tolerance)
    assert not torch.allclose(before, target, **tolerance)
