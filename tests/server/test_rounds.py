"""Rounds: close at quorum, publish a loadable checkpoint with lineage, settle the ledger, survive restarts."""

from __future__ import annotations

import json

from sqlmodel import select

from zoo_gym import codec
from zoo_gym.proto import archive
from zoo_gym.server.store.models import Checkpoint, Round, RoundState
from zoo_gym.server.rounds.manager import RoundManager
from zoo_gym.server.store.state import open_state


def test_round_publishes_at_quorum_with_lineage_and_ledger(federation, tmp_path):
    from transformers import AutoModelForCausalLM

    submitted = []
    for seed in range(2):  # min_contributors = 2
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="bitdelta"))
        submitted.append(cid)
    rnd = federation.wait_published(1)
    info = federation.round()
    assert info.round_id == 2 and info.base_sha256 == rnd.published_sha256
    with federation.state.session() as s:
        ckpt = s.get(Checkpoint, rnd.published_sha256)
    lineage = json.loads(ckpt.manifest_json)
    assert lineage["round"] == 1 and lineage["parent_sha256"] == rnd.base_sha256
    assert sorted(lineage["contributors"]) == sorted(submitted)
    model_dir = archive.unpack(federation.state.blobs.path(ckpt.sha256), tmp_path / "published")
    assert AutoModelForCausalLM.from_pretrained(model_dir).num_parameters() > 0
    assert ckpt.heldout_loss is not None
    from zoo_gym.server.rounds.settlement import ledger_entries
    from zoo_gym.server.store.queries import verify_ledger

    entries = ledger_entries(federation.state, contributor=None, since_seq=0, limit=None)
    assert sorted(e["contributor_id"] for e in entries) == sorted(submitted)
    assert verify_ledger(federation.state)["ok"]


def test_interrupted_aggregation_resumes_after_restart(federation):
    for seed in range(2):
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="fp16"))
    federation.wait_published(1)
    # Simulate a crash in the middle of round 2's aggregation: state AGGREGATING, nothing published.
    federation.rounds.stop()
    for seed in range(2, 4):
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="fp16"))
    with federation.state.write_lock, federation.state.session() as s:
        r = s.get(Round, 2)
        r.state = RoundState.AGGREGATING
        s.add(r)
        s.commit()
    reopened = open_state(federation.state.root)
    manager = RoundManager(reopened, federation.config)
    manager.step()  # what the restarted server's manager does first
    with reopened.session() as s:
        r2 = s.get(Round, 2)
        assert r2.state == RoundState.PUBLISHED and s.get(Round, 3).state == RoundState.OPEN
        assert len(list(s.exec(select(Checkpoint)))) == 3
    reopened.engine.dispose()


def test_lora_contributions_are_merged_as_products_not_factors(federation):
    """The published change is the mean of B_i @ A_i, not (mean B)(mean A) (naive federated LoRA)."""
    import torch
    from safetensors.torch import load_file

    from zoo_gym.codec import LoraFactors

    shapes = federation.base_shapes()
    name = next(k for k, s in shapes.items() if k.endswith("q_proj.weight"))
    out_f, in_f = shapes[name]
    g = torch.Generator().manual_seed(3)
    factors = [LoraFactors(A=torch.randn(2, in_f, generator=g) * 0.1, B=torch.randn(out_f, 2, generator=g) * 0.1)
               for _ in range(2)]
    for f in factors:
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode({name: f}, codec="lora", lora_codec="fp32"))
    rnd = federation.wait_published(1)
    before = load_file(str(federation.state.checkpoint_dir(rnd.base_sha256) / "model.safetensors"))[name]
    after = load_file(str(federation.state.checkpoint_dir(rnd.published_sha256) / "model.safetensors"))[name]
    products = (factors[0].merged() + factors[1].merged()) / 2
    naive = ((factors[0].B + factors[1].B) / 2) @ ((factors[0].A + factors[1].A) / 2)
    assert not torch.allclose(products, naive, atol=1e-3)  # the two really differ here
    torch.testing.assert_close(after - before, products, atol=1e-5, rtol=1e-4)


def test_health_and_reflection_services_answer(federation):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{federation.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "zoo_gym.v1.Gym"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "zoo_gym.v1.Gym" in names and "grpc.health.v1.Health" in names
    channel.close()


def test_concurrent_first_use_of_a_base_unpacks_it_once_for_everyone(federation):
    # two submissions arriving together used to unpack the base into one temporary directory and
    # break each other ("archive has no model.safetensors": an INTERNAL error for one contributor)
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    sha = federation.round().base_sha256
    shutil.rmtree(federation.state.work_dir / "checkpoints", ignore_errors=True)
    with ThreadPoolExecutor(max_workers=8) as pool:
        dirs = list(pool.map(lambda _: federation.state.checkpoint_dir(sha), range(8)))
    assert len(set(dirs)) == 1 and (dirs[0] / "model.safetensors").is_file()
    assert [p.name for p in dirs[0].parent.iterdir()] == [sha]  # no temporary directory left
