"""A preference round end to end: one real `gym-client join --stage dpo`, one `--stage kto`, both on the
built-in answer pairs; the server's validation data holds pairs, so it reports preference accuracy and
margin and scores both contributions by them. The round publishes, the margin rises, and both are paid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from e2e_processes import ENV, status, wait_for
from e2e_processes import server_cmd
from zoo_gym.proto.tls import make_certificates

STEPS = 12


def _join(root: Path, name: str, port: int, stage: str, shard: int) -> subprocess.Popen:
    work = root / name
    work.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "zoo_gym.client", "join", "--server", f"127.0.0.1:{port}",
           "--root-certificates", str(root / "tls" / "ca.pem"), "--rounds", "1", "--stage", stage,
           "--shard", str(shard), "--n-shards", "8", "--workdir", str(work), "--key", str(work / "key.pem"),
           "--max-steps", str(STEPS), "--warmup-steps", "0", "--learning-rate", "5e-3", "--batch-size", "8",
           "--threads", "1", "--quiet", "--json", "--name", name]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(work / "client.log", "w"), env=ENV, text=True)


def test_dpo_and_kto_contributors_are_published_and_paid(tmp_path):
    from zoo_gym.gym_train import builtin_examples

    root = tmp_path
    pairs = builtin_examples("preference", split="validation", n=48)
    validation = root / "pairs.jsonl"
    validation.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    state_dir, port_file = root / "server", root / "port"
    subprocess.run(server_cmd("init", "--state-dir", str(state_dir), "--base-model", "tiny"), check=True, env=ENV,
                   capture_output=True)
    tls = make_certificates(root / "tls", hosts=("127.0.0.1", "localhost"))
    server = subprocess.Popen(server_cmd("serve", "--state-dir", str(state_dir), "--port", "0", "--port-file",
                                         str(port_file), "--min-contributors", "2", "--aggregator", "mean",
                                         "--validation-data", str(validation), "--round-timeout", "900",
                                         "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)),
                              stderr=open(root / "server.log", "w"), env=ENV)
    clients = []
    try:
        port = wait_for(lambda: port_file.exists() and port_file.read_text().strip() and int(port_file.read_text()),
                        timeout=120, what="the server to listen", procs=[server])
        clients = [_join(root, "dpo", port, "dpo", 0), _join(root, "kto", port, "kto", 1)]
        summaries = {}
        for name, p in zip(("dpo", "kto"), clients):
            out, _ = p.communicate(timeout=900)
            assert p.returncode == 0, (root / name / "client.log").read_text()[-3000:]
            summaries[name] = json.loads(out)[0]
        published = wait_for(lambda: [r for r in status(state_dir)["rounds"] if r["id"] == 1
                                      and r["state"] == "published"], timeout=300, what="round 1 to be published",
                             procs=[server])
    finally:
        for p in clients:
            if p.poll() is None:
                p.kill()
        server.terminate()
        server.wait(timeout=30)
    report = published[0]["report"]
    pref = report["preference"]
    assert pref["after"]["preference_margin"] > pref["before"]["preference_margin"], pref
    assert report["rewards"]["scoring_loss"].startswith("preference")
    ids = {name: s["contributor"] for name, s in summaries.items()}
    payouts = {p["contributor"]: p for p in report["rewards"]["payouts"]}
    for name, cid in ids.items():
        assert payouts[cid]["paid"] and payouts[cid]["amount"] > 0, (name, payouts[cid])
