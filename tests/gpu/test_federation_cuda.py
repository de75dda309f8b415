"""One federated round with the server on the CPU and one contributor on the GPU: real `gym-server` and
`gym-client join --device cuda` processes (tests/e2e/e2e_processes.py), over TLS; the round is published
and the contributor paid. The server's process sees no GPU (CUDA_VISIBLE_DEVICES empty)."""

from __future__ import annotations

import json
import subprocess

import pytest

from e2e_processes import ENV, client, server_cmd, status, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_gpu_contributor_is_published_and_paid(tmp_path):
    from zoo_gym.proto.tls import make_certificates

    root, state_dir, port_file = tmp_path, tmp_path / "server", tmp_path / "port"
    cpu_env = {**ENV, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(server_cmd("init", "--state-dir", str(state_dir), "--base-model", "tiny"), check=True, env=cpu_env,
                   capture_output=True)
    tls = make_certificates(root / "tls", hosts=("127.0.0.1", "localhost"))
    server = subprocess.Popen(server_cmd("serve", "--state-dir", str(state_dir), "--port", "0", "--port-file",
                                         str(port_file), "--min-contributors", "1", "--aggregator", "mean",
                                         "--round-timeout", "600", "--ssl-certfile", str(tls.cert),
                                         "--ssl-keyfile", str(tls.key)),
                              stderr=open(root / "server.log", "w"), env=cpu_env)
    gpu = None
    try:
        port = wait_for(lambda: port_file.exists() and port_file.read_text().strip() and int(port_file.read_text()),
                        timeout=120, what="the server to listen", procs=[server])
        gpu = client(root, "gpu", port, rounds=1, steps=40, shard=0, extra=("--device", "cuda", "--bf16"))
        out, _ = gpu.communicate(timeout=600)
        assert gpu.returncode == 0, (root / "gpu" / "client.log").read_text()[-3000:]
        summary = json.loads(out)[0]
        published = wait_for(lambda: [r for r in status(state_dir)["rounds"] if r["id"] == 1
                                      and r["state"] == "published"], timeout=300, what="round 1 to be published",
                             procs=[server])
    finally:
        if gpu is not None and gpu.poll() is None:
            gpu.kill()
        server.terminate()
        server.wait(timeout=30)
    payouts = {p["contributor"]: p for p in published[0]["report"]["rewards"]["payouts"]}
    mine = payouts[summary["contributor"]]
    assert mine["paid"] and mine["amount"] > 0, mine
