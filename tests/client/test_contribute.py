"""One contribution path for both joins: what each cadence (sync rounds, async versions) says, returns and
raises around the shared fetch -> train -> sign -> upload, with the server, download and training faked."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym import codec
from zoo_gym.client import contribute as contribute_module
from zoo_gym.client import join_async
from zoo_gym.client.contribute import Contributor, JoinError, contribute
from zoo_gym.client.download import DownloadError, Fetched
from zoo_gym.client.join import Rounds
from zoo_gym.gym_train import TrainConfig
from zoo_gym.proto import gym_pb2

PAYLOAD = codec.encode({"w": torch.ones(4, 4)}, codec="fp16")
METADATA = {"loss_before": 2.0, "loss_after": 1.5, "steps": 4, "train_seconds": 3.25}


class Refused(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "said the server"


def _info(round_id, **kw):
    return gym_pb2.RoundInfo(round_id=round_id, state=gym_pb2.ROUND_STATE_OPEN, base_sha256=f"{round_id:064x}",
                             base_size=1, max_staleness=4, **kw)


def _setup(tmp_path, monkeypatch, answers, rounds=(3,), keep=True):
    """A Contributor whose SubmitDelta gives `answers` in turn (an exception is raised) and whose GetRound
    gives RoundInfos for `rounds` in turn (the last repeats); the said lines and the kept delta's file."""
    monkeypatch.setattr(contribute_module, "fetch", lambda *a, **k: Fetched(tmp_path, "server"))
    monkeypatch.setattr(join_async.time, "sleep", lambda s: None)
    kept = tmp_path / "kept.delta.pt"
    kept.write_bytes(b"x")
    said, answers, infos = [], list(answers), list(rounds)

    def submit(requests, timeout):
        assert next(iter(requests)).header.round_id  # the stream starts with the signed header
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    trainer = SimpleNamespace(config=TrainConfig(), train=lambda model_dir, sha, lr_scale=1.0: (PAYLOAD, dict(METADATA),
                                                                                kept if keep else None),
                              keep_variant=lambda path, model_dir, out, checkpoint_sha256: str(out))
    stub = SimpleNamespace(SubmitDelta=submit, GetRound=lambda req, timeout: _info(infos.pop(0) if len(infos) > 1
                                                                                   else infos[0]))
    c = Contributor(stub=stub, cid="c" * 32, key=Ed25519PrivateKey.generate(), retry=lambda fn, what: fn(),
                    verified=lambda info: info, trainer=trainer, say=said.append, server_key=b"")
    opts = SimpleNamespace(workdir=tmp_path, progress=False, max_wait=60)
    return c, opts, said, kept


def _ok(round_id, n=1):
    return gym_pb2.SubmitResponse(round_id=round_id, payload_sha256=codec.sha256_hex(PAYLOAD), submissions=n)


def test_a_sync_round_submits_once_and_keeps_the_variant(tmp_path, monkeypatch):
    c, opts, said, _ = _setup(tmp_path, monkeypatch, [_ok(3, n=2)])
    r = contribute(_info(3), contributor=c, opts=opts, cadence=Rounds(opts))
    assert r.summary(round=3) == {"round": 3, "contributor": "c" * 32, "payload_bytes": len(PAYLOAD),
                                  "payload_sha256": codec.sha256_hex(PAYLOAD), "submissions_in_round": 2,
                                  "loss_before": 2.0, "loss_after": 1.5, "steps": 4, "train_seconds": 3.25,
                                  "codecs": ["fp16"],
                                  "learning_rate": TrainConfig().learning_rate,  # no schedule in this RoundInfo
                                  "variant": str(tmp_path / "variants" / "cccccccc-round3.zgd"),
                                  "checkpoint_source": "server"}
    assert said == [f"round 3: training (sft+lora) on base {'0' * 12}",
                    f"round 3: submitted {len(PAYLOAD)} bytes; local held-out loss 2.0000 -> 1.5000"]


def test_the_training_line_names_the_servers_epsilon_and_participation_mode(tmp_path, monkeypatch):
    c, opts, said, _ = _setup(tmp_path, monkeypatch, [_ok(3)])
    info = _info(3, dp_epsilon_spent=2.25, dp_delta=1e-5, dp_participation="public")
    contribute(info, contributor=c, opts=opts, cadence=Rounds(opts))
    assert said[0] == (f"round 3: training (sft+lora) on base {'0' * 12}; server DP: ε 2.250 spent at δ 1e-05 "
                       "(participation public: the ledger names who took part; the ε covers what each delta "
                       "contains)")


def test_a_sync_round_that_closed_first_is_not_taken_and_leaves_no_variant(tmp_path, monkeypatch):
    c, opts, said, kept = _setup(tmp_path, monkeypatch, [Refused(grpc.StatusCode.FAILED_PRECONDITION)])
    assert contribute(_info(3), contributor=c, opts=opts, cadence=Rounds(opts)) is None
    assert said[-1] == "round 3 closed before the upload finished (said the server); training again on the next base"
    assert not kept.exists()


@pytest.mark.parametrize("cadence", [Rounds, join_async.Versions])
def test_a_refused_submission_stops_in_one_line(tmp_path, monkeypatch, cadence):
    c, opts, _, kept = _setup(tmp_path, monkeypatch, [Refused(grpc.StatusCode.PERMISSION_DENIED)])
    with pytest.raises(JoinError, match=r"^submission refused \(PERMISSION_DENIED\): said the server$"):
        contribute(_info(3), contributor=c, opts=opts, cadence=cadence(opts))
    assert not kept.exists()


@pytest.mark.parametrize("cadence, name", [(Rounds, "round 3"), (join_async.Versions, "version 2")])
def test_a_base_that_does_not_verify_is_refused(tmp_path, monkeypatch, cadence, name):
    c, opts, _, _ = _setup(tmp_path, monkeypatch, [])

    def bad(*a, **k):
        raise DownloadError("sha256 mismatch")

    monkeypatch.setattr(contribute_module, "fetch", bad)
    with pytest.raises(JoinError, match=f"^{name}: refusing the base checkpoint: sha256 mismatch$"):
        contribute(_info(3), contributor=c, opts=opts, cadence=cadence(opts))


def test_async_waits_for_a_buffer_that_takes_it_and_reports_staleness(tmp_path, monkeypatch):
    c, opts, said, _ = _setup(tmp_path, monkeypatch, [Refused(grpc.StatusCode.ALREADY_EXISTS), _ok(4)],
                              rounds=(3, 4), keep=False)
    r = contribute(_info(3), contributor=c, opts=opts, cadence=join_async.Versions(opts))
    assert (r.trained_on, r.round_id, r.staleness, r.variant) == (3, 4, 1, None)
    assert said == [f"version 2 (round 3): training (sft+lora) on base {'0' * 12}",
                    f"submitted {len(PAYLOAD)} bytes to round 4's buffer (trained on version 2, staleness 1); "
                    "local held-out loss 2.0000 -> 1.5000"]


def test_async_drops_a_delta_grown_too_stale(tmp_path, monkeypatch):
    c, opts, said, kept = _setup(tmp_path, monkeypatch, [], rounds=(8,))
    assert contribute(_info(3), contributor=c, opts=opts, cadence=join_async.Versions(opts)) is None
    assert said[-1] == ("the delta trained on version 2 is 5 versions old (the server takes at most 4); "
                        "dropping it and training on version 7")
    assert not kept.exists()
