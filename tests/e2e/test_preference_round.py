"""A preference round end to end: one real `gym-client join --stage dpo`, one `--stage kto`, both on the
built-in answer pairs; the server's validation data holds pairs, so it reports preference accuracy and
margin and scores both contributions by them. The round publishes, the margin rises, and both are paid."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from e2e_processes import ENV, client, join_summaries, published_round, serve_tls, server_cmd, stop

STEPS = 12


def _join(root: Path, name: str, port: int, stage: str, shard: int) -> subprocess.Popen:
    return client(root, name, port, rounds=1, steps=STEPS, shard=shard,
                  extra=("--stage", stage, "--warmup-steps", "0", "--learning-rate", "5e-3", "--batch-size", "8"))


def test_dpo_and_kto_contributors_are_published_and_paid(tmp_path):
    from zoo_gym.gym_train import builtin_examples

    root = tmp_path
    pairs = builtin_examples("preference", split="validation", n=48)
    validation = root / "pairs.jsonl"
    validation.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    state_dir = root / "server"
    subprocess.run(server_cmd("init", "--state-dir", str(state_dir), "--base-model", "tiny"), check=True, env=ENV,
                   capture_output=True)
    server, port = serve_tls(root, state_dir, "--min-contributors", "2", "--aggregator", "mean",
                             "--validation-data", str(validation), "--round-timeout", "900")
    clients = {}
    try:
        clients = {"dpo": _join(root, "dpo", port, "dpo", 0), "kto": _join(root, "kto", port, "kto", 1)}
        summaries = join_summaries(root, clients, timeout=900)
        published = published_round(state_dir, 1, timeout=300, procs=[server])
    finally:
        stop([*clients.values(), server])
    report = published["report"]
    pref = report["preference"]
    assert pref["after"]["preference_margin"] > pref["before"]["preference_margin"], pref
    assert report["rewards"]["scoring_loss"].startswith("preference")
    ids = {name: s["contributor"] for name, s in summaries.items()}
    payouts = {p["contributor"]: p for p in report["rewards"]["payouts"]}
    for name, cid in ids.items():
        assert payouts[cid]["paid"] and payouts[cid]["amount"] > 0, (name, payouts[cid])
