"""One federated round with the server on the CPU and one contributor on the GPU: real `gym-server` and
`gym-client join --device cuda` processes (tests/e2e/e2e_processes.py), over TLS; the round is published
and the contributor paid. The server's process sees no GPU (CUDA_VISIBLE_DEVICES empty)."""

from __future__ import annotations

import subprocess

import pytest

from e2e_processes import ENV, client, join_summaries, published_round, serve_tls, server_cmd, stop

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_gpu_contributor_is_published_and_paid(tmp_path):
    state_dir, cpu_env = tmp_path / "server", {**ENV, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(server_cmd("init", "--state-dir", str(state_dir), "--base-model", "tiny"), check=True, env=cpu_env,
                   capture_output=True)
    server, port = serve_tls(tmp_path, state_dir, "--min-contributors", "1", "--aggregator", "mean",
                             "--round-timeout", "600", env=cpu_env)
    gpu = {}
    try:
        gpu = {"gpu": client(tmp_path, "gpu", port, rounds=1, steps=40, shard=0, extra=("--device", "cuda", "--bf16"))}
        summary = join_summaries(tmp_path, gpu, timeout=600)["gpu"]
        published = published_round(state_dir, 1, timeout=300, procs=[server])
    finally:
        stop([*gpu.values(), server])
    payouts = {p["contributor"]: p for p in published["report"]["rewards"]["payouts"]}
    mine = payouts[summary["contributor"]]
    assert mine["paid"] and mine["amount"] > 0, mine
