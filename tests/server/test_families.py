"""Any causal LM: a full federated round on random-init small bases of four families (issue 13 item 3),
then `gym-server export` of the published checkpoint (item 6).

Each family: `init_state` (which itself tries one client LoRA step and the server's evaluator), two
contributors train a LoRA delta with `gym_train.train` on the base they download, submit it through the
real gRPC service, the round publishes, and the published checkpoint loads with `from_pretrained` and
has a recorded held-out loss. GPT-2 (Conv1D weights stored (in, out)) and Llama are built without a chat
template, so they run on the plain fallback; GPT-2 also has no pad token.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time

import grpc
import pytest
import torch
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.gym_train import TrainConfig, builtin_examples, train
from zoo_gym.evaluation.chat import PLAIN_TEMPLATE
from zoo_gym.gym_train.families import make_random_base
from zoo_gym.proto import archive, gym_pb2, gym_pb2_grpc
from zoo_gym.server.cli import app
from zoo_gym.server.config import build_config
from zoo_gym.server.store.models import Checkpoint, Round, RoundState
from zoo_gym.server.transport.servicer import build_server
from zoo_gym.server.genesis import init_state

CASES = [  # family, ships a chat template, has a pad token
    ("qwen3", True, True),
    ("llama", False, True),
    ("gpt2", False, False),
    ("gemma", True, True),
]


def _wait_published(state, round_id: int, timeout: float = 240.0) -> Round:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with state.session() as s:
            r = s.get(Round, round_id)
            if r.state in (RoundState.PUBLISHED, RoundState.HALTED):
                return r
            if r.message and r.state == RoundState.OPEN and "waiting" in r.message:
                pytest.fail(f"round {round_id} reopened: {r.message}")
        time.sleep(0.2)
    pytest.fail(f"round {round_id} did not publish within {timeout} s")


def _submit(stub, state, key, examples, seed: int) -> None:
    cid = stub.Register(register_request(key, "test")).contributor_id
    info = stub.GetRound(gym_pb2.GetRoundRequest(contributor_id=cid))
    base_dir = state.checkpoint_dir(info.base_sha256)  # what the client downloads (same tar, same sha256)
    cfg = TrainConfig(method="lora", max_steps=4, batch_size=4, learning_rate=5e-3, warmup_steps=0, seed=seed)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(base_dir, examples, cfg, base_sha256=info.base_sha256, eval_examples=[])
    payload = codec.encode(result.delta, codec="lora", metadata={"base_sha256": info.base_sha256, **result.metadata})
    header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                          payload=payload, metadata=result.metadata)
    resp = stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16))
    assert resp.accepted if hasattr(resp, "accepted") else True


@pytest.mark.parametrize("family,template,pad", CASES, ids=[c[0] for c in CASES])
def test_full_round_then_export(tmp_path, family, template, pad):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Prepare: a random-init base of this family, a federation over it
    base = make_random_base(family, tmp_path / "base", chat_template=template, pad_token=pad)
    state = init_state(tmp_path / "state", base_model=str(base))
    meta = json.loads((tmp_path / "state" / "state.json").read_text())
    assert meta["chat_template"] == ("base" if template else "plain")
    config = build_config({}, port=0, insecure=True, min_contributors=2, aggregator="mean", round_timeout=600,
                          validation_examples=16, max_payload_bytes=16 << 20, max_chunk_bytes=1 << 20)
    server, port, rounds = build_server(state, config)
    server.start()
    rounds.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = gym_pb2_grpc.GymStub(channel)
        # Execute: two contributors on their own shards, through the real service
        for i in range(2):
            _submit(stub, state, Ed25519PrivateKey.generate(), builtin_examples(n=32, seed=10 + i), seed=i)
        rnd = _wait_published(state, 1)
    finally:
        channel.close()
        server.stop(grace=None)
        rounds.stop()

    # Assert: published, loadable, held-out loss recorded; the template travelled with the checkpoint
    assert rnd.state == RoundState.PUBLISHED, rnd.message
    with state.session() as s:
        ckpt = s.get(Checkpoint, rnd.published_sha256)
        genesis = s.get(Checkpoint, rnd.base_sha256)
    assert ckpt.heldout_loss is not None and math.isfinite(ckpt.heldout_loss)
    assert genesis.heldout_loss is not None and ckpt.heldout_loss != genesis.heldout_loss  # the deltas changed it
    out = tmp_path / "export"
    res = CliRunner().invoke(app, ["export", "--state-dir", str(tmp_path / "state"), str(out)])
    assert res.exit_code == 0, res.output
    assert f"round 1 checkpoint {rnd.published_sha256[:12]}" in res.output
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == family
    if not template:
        assert tok.chat_template == PLAIN_TEMPLATE and tok.pad_token is not None
    ids = torch.tensor([tok("### Instruction:\n1+1", add_special_tokens=False)["input_ids"]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
    card = (out / "README.md").read_text()
    # Hub metadata: a local base is no Hub id, so no base_model; nothing of the operator's paths
    assert card.startswith("---\n") and "library_name: transformers" in card and "base_model" not in card.split("---")[1]
    assert "pipeline_tag: text-generation" in card and str(tmp_path) not in card
    assert f"{ckpt.heldout_loss:.4f}" in card and f"{genesis.heldout_loss:.4f}" in card
    assert "rounds: 1; contributors: 2" in card
    assert json.loads((out / archive.LINEAGE).read_text())["round"] == 1
    state.engine.dispose()
