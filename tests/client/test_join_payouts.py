"""`gym-client join` says after each round what this contributor was paid and why, one line per round, from its
own ledger entries (a signed query, checked against the pinned server key); with --json the same is the round's
"payout". Under server DP only the owner sees its figures, which is what the client asks for."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.cli import app
from zoo_gym.client.rewards import payout


def _entry(seq, kind, amount, reason, round_id=2):
    return {"seq": seq, "round_id": round_id, "kind": kind, "amount": amount, "score": 0.16,
            "reputation_after": 0.2, "reason": reason}


def test_one_line_per_round_says_the_pay_or_why_not():
    field, line = payout(2, [_entry(7, "reward", 131, "paid 131 of 1000: score 0.1612 x reputation 0.1; gain")])
    assert line == "round 2: paid 131 of 1000: score 0.1612 x reputation 0.1; gain"
    assert (field["paid"], field["amount"], field["kind"], field["seq"]) == (True, 131, "reward", [7])
    field, line = payout(3, [_entry(9, "refusal", 0, "held-out loss did not improve", round_id=3)])
    assert line == "round 3: not paid: held-out loss did not improve" and field["paid"] is False
    field, line = payout(4, [])
    assert line.startswith("round 4: not paid: no ledger entry") and field["amount"] == 0
    assert all("\n" not in payout(r, e)[1] for r, e in ((2, [_entry(1, "reward", 5, "x")]), (4, [])))


def test_join_says_the_rounds_pay_from_its_own_signed_entries_under_server_dp(tmp_path):
    from tests.server.conftest import start_federation
    from zoo_gym.server.rounds.settlement import ledger_entries

    fed = start_federation(tmp_path / "state", aggregator="mean", min_contributors=3, dp_noise_multiplier=1.0,
                           dp_clip=0.05, dp_expected_contributors=3, dp_target_epsilon=1000.0, reward_pool=1000)
    try:
        for seed in range(2):  # two others; the joining client's delta closes round 1
            key, cid = fed.register()
            fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp16"))
        res = CliRunner().invoke(app, ["join", "--server", f"127.0.0.1:{fed.port}", "--insecure", "--rounds", "1",
                                       "--max-steps", "8", "--threads", "1", "--workdir", str(tmp_path / "home"),
                                       "--key", str(tmp_path / "k.pem"), "--quiet", "--json"])
        assert res.exit_code == 0, res.output[-3000:]
        [summary] = json.loads(res.stdout)
        mine = [e for e in ledger_entries(fed.state, contributor=summary["contributor"], since_seq=0, limit=None)
                if e["round_id"] == 1]
    finally:
        fed.stop()
    assert summary["round"] == 1 and len(mine) == 1
    entry = mine[0]
    assert (summary["payout"]["kind"], summary["payout"]["amount"], summary["payout"]["reason"]) == (
        entry["kind"], entry["amount"], entry["reason"])
    said = [line for line in res.stderr.splitlines() if line.startswith(("round 1: paid", "round 1: not paid"))]
    assert said == [payout(1, [{**entry, "round_id": 1}])[1]]  # once, after the publish
    assert said[0].startswith("round 1: paid " if entry["kind"] == "reward" else "round 1: not paid: ")
    lines = res.stderr.splitlines()
    assert lines.index(said[0]) > lines.index("round 1 published; round 2 is open")


def test_rounds_are_said_once_each_when_settled_and_a_failed_query_does_not_stop_the_join(monkeypatch):
    from types import SimpleNamespace

    from zoo_gym.client import rewards
    from zoo_gym.client.contribute import say_payouts
    from zoo_gym.client.rewards import RewardsError

    answers = [[_entry(4, "reward", 10, "paid 10 of 100: score 0.2 x reputation 0.1; gain")], [],
               RewardsError("the server withheld the figures of your own ledger entry 5")]

    def own_entries(stub, **kw):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(rewards, "own_entries", own_entries)
    said = []
    c = SimpleNamespace(stub=None, key=None, cid="c" * 32, server_key=b"", say=said.append,
                        retry=lambda fn, what: fn())
    summaries = [{"round": 2, "payout": None}, {"round": 3, "payout": None}]
    assert say_payouts(c, summaries, 0, settled_through=None) == 4  # async: buffer 3 has not flushed yet
    assert said == ["round 2: paid 10 of 100: score 0.2 x reputation 0.1; gain"] and summaries[1]["payout"] is None
    assert say_payouts(c, summaries, 4, settled_through=3) == 4  # published without an entry: said unpaid
    assert said[1].startswith("round 3: not paid: no ledger entry") and summaries[1]["payout"]["paid"] is False
    summaries.append({"round": 4, "payout": None})
    assert say_payouts(c, summaries, 4, settled_through=4) == 4
    assert said[2] == "round 4: pay not shown (the server withheld the figures of your own ledger entry 5)"
    assert summaries[2]["payout"] is None and len(said) == 3
