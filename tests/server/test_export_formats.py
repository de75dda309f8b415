"""gym-server export: Hub-valid cards with no operator path, readable files, GGUF read back against the
safetensors (issue 30 items 4, 5)."""

from __future__ import annotations

import json
import stat

import numpy as np
import pytest
from typer.testing import CliRunner

from zoo_gym.gym_train.families import make_random_base
from zoo_gym.proto.model_card import model_card, public_base_name, round_summary
from zoo_gym.server.cli import app
from zoo_gym.server.genesis import init_state

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("operator-secret")
    base = make_random_base("llama", root / "bases" / "model")
    init_state(root / "state", base_model=str(base)).engine.dispose()
    return root


def _no_operator_path(out, root) -> None:
    for p in out.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            assert str(root).encode() not in data and b"operator-secret" not in data, p.name
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644) for p in out.rglob("*"))


def _card_data(out):
    from huggingface_hub import ModelCard

    return ModelCard((out / "README.md").read_text()).data.to_dict()


def test_hf_export_card_is_hub_valid_and_names_no_path(state_dir):
    out = state_dir / "hf"
    res = CliRunner().invoke(app, ["export", "--state-dir", str(state_dir / "state"), str(out),
                                   "--license", "apache-2.0"])
    assert res.exit_code == 0, res.output
    data = _card_data(out)
    assert "base_model" not in data  # a local directory is not a Hub id
    assert data["license"] == "apache-2.0" and data["pipeline_tag"] == "text-generation"
    assert data["library_name"] == "transformers"
    assert {"zoo-gym", "federated-learning", "bitdelta"} <= set(data["tags"])
    assert "`model`" in (out / "README.md").read_text()
    _no_operator_path(out, state_dir)
    # one name for a base: the card maps the checkpoint sha256 to the weights sha256 gym-serve prints
    from zoo_gym.proto.model_card import base_label
    from zoo_gym.serving.variant import weights_sha256

    ckpt, weights = data["zoo_gym"]["checkpoint_sha256"], weights_sha256(out)
    assert base_label(out, weights) == f"checkpoint {ckpt[:12]} (weights {weights[:12]})"
    assert f"exported round 0 checkpoint {ckpt[:12]} (weights {weights[:12]})" in res.output


@pytest.mark.parametrize("quantization", ["f16", "bf16", "q8_0"])
def test_gguf_export_reads_back_equal_to_the_safetensors(state_dir, quantization):
    from zoo_gym.proto.gguf_export import tensors

    out = state_dir / f"gguf-{quantization}"
    res = CliRunner().invoke(app, ["export", "--state-dir", str(state_dir / "state"), str(out), "--format", "gguf",
                                   "--quantization", quantization])
    assert res.exit_code == 0, res.output
    [path] = out.glob("*.gguf")
    assert path.name == f"model-zoo-gym-r0-{quantization}.gguf"
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == reader.fields["llama.vocab_size"].contents()
    assert reader.fields["tokenizer.ggml.merges"].contents()
    got = {t.name: t for t in reader.tensors}
    hf = state_dir / "hf-src"
    if not hf.exists():
        CliRunner().invoke(app, ["export", "--state-dir", str(state_dir / "state"), str(hf)])
    cfg = json.loads((hf / "config.json").read_text())
    expected = list(tensors(hf, "llama", cfg))
    assert set(got) == {name for name, _, _ in expected}
    tol = {"f16": 1e-3, "bf16": 8e-3, "q8_0": 1e-2}[quantization]
    for name, _, data in expected:
        t = got[name]
        back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(data.shape)
        assert list(t.shape[::-1]) == list(data.shape), name
        np.testing.assert_allclose(back, data, atol=tol * np.abs(data).max(), rtol=0, err_msg=name)
    assert _card_data(out)["library_name"] == "gguf"
    _no_operator_path(out, state_dir)


def test_card_names_a_hub_base_and_carries_the_held_out_loss():
    rows = [round_summary({"round": 0, "base_model": "Qwen/Qwen3-0.6B"}, sha256="a" * 64, heldout_loss=5.5),
            round_summary({"round": 1, "parent_sha256": "a" * 64}, sha256="b" * 64, heldout_loss=2.25)]
    from huggingface_hub import ModelCard

    data = ModelCard(model_card(rows, base_model="Qwen/Qwen3-0.6B")).data
    assert data.base_model == "Qwen/Qwen3-0.6B" and data.license == "unknown"
    [ev] = data.eval_results
    assert ev.metric_type == "loss" and ev.metric_value == 2.25
    assert public_base_name("/srv/x/model") == "model" and public_base_name("tiny") == "tiny"


def test_a_checkpoint_cache_directory_is_named_by_its_checkpoint(tmp_path):
    from zoo_gym.proto.archive import LINEAGE
    from zoo_gym.proto.model_card import base_label

    d = tmp_path / ("ab" * 32)
    d.mkdir()
    (d / LINEAGE).write_text("{}")
    assert base_label(d, "f" * 64) == f"checkpoint {'ab' * 6} (weights {'f' * 12})"
    assert base_label(tmp_path, "f" * 64) == f"weights {'f' * 12}"
