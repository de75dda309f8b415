"""`gym-client pull` writes the latest published checkpoint as a Hugging Face directory with a model card."""

from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.cli import app


def _publish_round_one(fed) -> str:
    for seed in range(2):  # min_contributors = 2
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="bitdelta"))
    deadline = time.monotonic() + 120
    while fed.round().round_id == 1:
        assert time.monotonic() < deadline, "round 1 was not published in 120 s"
        time.sleep(0.2)
    return fed.round().base_sha256


def test_pull_writes_a_loadable_model_with_a_card(federation, tmp_path):
    from transformers import AutoModelForCausalLM

    runner = CliRunner()
    address = f"127.0.0.1:{federation.port}"
    early = runner.invoke(app, ["pull", str(tmp_path / "early"), "--server", address, "--insecure",
                                "--workdir", str(tmp_path / "w")])
    assert early.exit_code == 2 and "nothing has been published" in early.output
    sha = _publish_round_one(federation)

    out = tmp_path / "model"
    res = runner.invoke(app, ["pull", str(out), "--server", address, "--insecure", "--workdir", str(tmp_path / "w"),
                              "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["sha256"] == sha and summary["round"] == 1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.num_parameters() > 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card and sha[:12] in card

    again = runner.invoke(app, ["pull", str(out), "--server", address, "--insecure", "--workdir", str(tmp_path / "w")])
    assert again.exit_code == 2 and "not an empty directory" in again.output  # nothing overwritten

    gg = runner.invoke(app, ["pull", str(tmp_path / "gguf"), "--server", address, "--insecure", "--workdir",
                             str(tmp_path / "w"), "--format", "gguf", "--quantization", "q8_0"])
    assert gg.exit_code == 0, gg.output
    assert f"checkpoint {sha[:12]} (weights " in gg.output
    [path] = (tmp_path / "gguf").glob("*.gguf")
    assert path.name.endswith("-zoo-gym-r1-q8_0.gguf") and "library_name: gguf" in (tmp_path / "gguf" / "README.md").read_text()
