"""Admission against Sybils (issue 14 item 6): registration rate limits, idempotent re-registration, invites."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlmodel import func, select
from typer.testing import CliRunner

from zoo_gym.client.upload import register_request
from zoo_gym.proto import gym_pb2
from zoo_gym.server.transport.admission import RegistrationLimiter, make_invites, peer_address, shared_wait
from zoo_gym.server.cli import app as server_app
from zoo_gym.server.errors import ResourceExhausted
from zoo_gym.server.store.models import Contributor, SpentInvite, UsedNonce


def _rows(fed, table) -> int:
    with fed.state.session() as s:
        return int(s.exec(select(func.count()).select_from(table)).one())


def _all(fed, table) -> list:
    with fed.state.session() as s:
        return list(s.exec(select(table)))


def _register(fed, key=None, invite: str = ""):
    key = key or Ed25519PrivateKey.generate()
    return fed.stub.Register(register_request(key, "sybil", invite=invite))


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ----------------------------------------------------------------------------------------------- rate limits

def test_sybil_burst_from_one_address_is_refused_after_the_burst(federation_with):
    fed = federation_with(register_burst_per_peer=5, register_rate_per_peer=1.0)
    accepted, refusals = 0, []
    for _ in range(50):
        try:
            accepted += _register(fed).created
        except grpc.RpcError as exc:
            refusals.append(exc)
    assert accepted == 5 and len(refusals) == 45
    assert {e.code() for e in refusals} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert re.search(r"try again in (5\d|60) s", refusals[-1].details())  # 1 a minute: the next is ~60 s away
    assert _rows(fed, Contributor) == 5 and _rows(fed, UsedNonce) == 5


def test_default_limits_bound_a_thousand_identity_burst_but_admit_a_federation(federation_with):
    fed = federation_with()  # the defaults: a normal federation (and the demo's 3) registers at once
    outcomes = []
    for _ in range(1000):
        try:
            outcomes.append(_register(fed).created)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            outcomes.append(False)
    burst = fed.config.register_burst_per_peer
    assert all(outcomes[:burst])  # today's 1000 in 2.6 s became the burst plus the slow refill
    assert sum(outcomes) <= burst + 5 and _rows(fed, Contributor) == sum(outcomes)


def test_a_thousand_re_registrations_of_one_key_add_no_rows_and_spend_no_tokens(federation_with):
    fed = federation_with(register_burst_per_peer=2, register_rate_per_peer=1.0)
    key = Ed25519PrivateKey.generate()
    first = _register(fed, key)
    assert first.created
    rows = (_rows(fed, Contributor), _rows(fed, UsedNonce))
    for _ in range(1000):
        again = _register(fed, key)
        assert not again.created and again.contributor_id == first.contributor_id
    assert (_rows(fed, Contributor), _rows(fed, UsedNonce)) == rows == (1, 1)
    assert _register(fed).created  # the second token of the burst is still there


def test_a_known_key_still_proves_possession(federation_with):
    fed = federation_with()
    key = Ed25519PrivateKey.generate()
    _register(fed, key)
    req = register_request(key, "sybil")
    forged = gym_pb2.RegisterRequest(public_key=req.public_key, display_name="sybil", nonce=req.nonce,
                                     signature=bytes(64))
    exc = _refusal(lambda: fed.stub.Register(forged))
    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and "proof of possession" in exc.details()


def test_limiter_buckets_per_address_with_the_wait():
    now = [0.0]
    limiter = RegistrationLimiter(per_peer_per_minute=6, per_peer_burst=2, global_per_minute=60, global_burst=3,
                                  clock=lambda: now[0])
    limiter.admit("ipv4:10.0.0.1:1000")
    limiter.admit("ipv4:10.0.0.1:2000")  # another port, the same address
    with pytest.raises(ResourceExhausted, match=r"from 10\.0\.0\.1 recently: try again in 10 s"):
        limiter.admit("ipv4:10.0.0.1:3000")
    limiter.admit("ipv4:10.0.0.2:1000")  # another address has its own bucket
    now[0] = 10.0  # refilled: 1 token per 10 s per address
    limiter.admit("ipv4:10.0.0.1:4000")


def test_the_server_wide_limit_is_a_window_over_the_registration_times():
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    at = [t0 + timedelta(seconds=s) for s in (0, 1, 2)]
    # 3 per 3 minutes: the window is 180 s, and it opens again when the oldest of the last 3 leaves it
    assert shared_wait(at[:2], per_minute=1, burst=3, now=t0 + timedelta(seconds=5)) == 0.0
    assert shared_wait(at, per_minute=1, burst=3, now=t0 + timedelta(seconds=5)) == 175.0
    assert shared_wait(at, per_minute=1, burst=3, now=t0 + timedelta(seconds=180)) == 0.0
    naive = [t.replace(tzinfo=None) for t in at]  # as SQLite returns them
    assert shared_wait(naive, per_minute=1, burst=3, now=t0 + timedelta(seconds=60)) == 120.0


def test_the_server_wide_limit_refuses_the_key_past_the_burst_and_stores_nothing(federation_with):
    fed = federation_with(register_burst_global=2, register_rate_global=1.0)
    first, second = (_register(fed).contributor_id for _ in range(2))
    exc = _refusal(lambda: _register(fed))
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # 2 per 2 minutes: the next place opens about 120 s after the first registration
    assert re.search(r"on this server recently \(all its addresses\): try again in 1[12]\d s", exc.details())
    assert _rows(fed, Contributor) == 2 and {first, second} == {c.id for c in _all(fed, Contributor)}


def test_peer_address_strips_the_port_and_groups_ipv6_by_64():
    assert peer_address("ipv4:192.0.2.7:51234") == "192.0.2.7"
    assert peer_address("ipv6:[2001:db8:1:2:aaaa::1]:443") == "2001:db8:1:2::/64"
    assert peer_address("ipv6:%5B2001:db8:1:2::9%5D:443") == "2001:db8:1:2::/64"
    assert peer_address("ipv6:[::ffff:192.0.2.7]:1") == "192.0.2.7"


# ----------------------------------------------------------------------------------------------- invites

def test_invite_mode_admits_exactly_one_key_per_genuine_invite(federation_with):
    fed = federation_with(admission="invite")
    token, spare = make_invites(fed.state.key, count=2)

    exc = _refusal(lambda: _register(fed))
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED and "ask the operator for an invite" in exc.details()

    alice = Ed25519PrivateKey.generate()
    assert _register(fed, alice, invite=token).created

    exc = _refusal(lambda: _register(fed, invite=token))
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED and "already used" in exc.details()

    forged = make_invites(Ed25519PrivateKey.generate(), count=1)[0]  # right shape, another key
    for bad in (forged, spare[:-2] + ("A" if spare[-2] != "A" else "B") + spare[-1], "not-an-invite"):
        exc = _refusal(lambda: _register(fed, invite=bad))
        assert exc.code() == grpc.StatusCode.PERMISSION_DENIED and "ask the operator" in exc.details()

    assert _rows(fed, Contributor) == 1 and _rows(fed, SpentInvite) == 1
    again = _register(fed, alice)  # a known key needs no invite
    assert not again.created
    assert _register(fed, invite=spare).created  # the spare was never spent by the refusals


def test_invited_keys_pass_the_sybil_buckets_and_uninvited_ones_still_meet_them(federation_with):
    """A planned population (issue 51): 30 invited keys from one address all get in past a burst of 5, while a
    burst of uninvited (or forged-invite) keys is refused for want of an invitation, then by the buckets."""
    fed = federation_with(admission="invite", register_burst_per_peer=5, register_rate_per_peer=1.0)
    tokens = make_invites(fed.state.key, count=30)
    assert all(_register(fed, invite=t).created for t in tokens)
    forged = make_invites(Ed25519PrivateKey.generate(), count=1)[0]
    codes = [_refusal(lambda: _register(fed, invite=forged if i % 2 else "")).code() for i in range(12)]
    assert codes[:5] == [grpc.StatusCode.PERMISSION_DENIED] * 5  # within the burst: no invitation, no entry
    assert set(codes[5:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}  # past it: the buckets, as in open mode
    assert _rows(fed, Contributor) == 30 and _rows(fed, SpentInvite) == 30


def test_an_invite_is_bound_to_the_request_signature(federation_with):
    fed = federation_with(admission="invite")
    token, other = make_invites(fed.state.key, count=2)
    req = register_request(Ed25519PrivateKey.generate(), "bob", invite=token)
    req.invite = other  # swapped in transit: the proof of possession no longer covers it
    exc = _refusal(lambda: fed.stub.Register(req))
    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and _rows(fed, SpentInvite) == 0


def test_gym_server_invite_tokens_admit_gym_client_join(federation_with, tmp_path):
    from zoo_gym.client.cli import app as client_app

    fed = federation_with(admission="invite")
    res = CliRunner().invoke(server_app, ["invite", "--state-dir", str(fed.state.root), "--count", "2", "--json"])
    assert res.exit_code == 0, res.output
    tokens = json.loads(res.stdout)["invites"]
    assert len(tokens) == 2 and len(set(tokens)) == 2

    server = f"127.0.0.1:{fed.port}"
    args = ["join", "--server", server, "--insecure", "--workdir", str(tmp_path / "w"), "--max-steps", "2",
            "--warmup-steps", "0", "--no-wait", "--quiet", "--threads", "1"]
    refused = CliRunner().invoke(client_app, [*args, "--key", str(tmp_path / "mallory.pem")])
    assert refused.exit_code == 1 and "ask the operator for an invite" in refused.output, refused.output

    joined = CliRunner().invoke(client_app, [*args, "--key", str(tmp_path / "alice.pem"), "--invite", tokens[0]])
    assert joined.exit_code == 0, joined.output
    assert "registered" in joined.output and fed.stored_submissions() == 1
    assert _rows(fed, Contributor) == 1 and _rows(fed, SpentInvite) == 1


def test_invite_command_prints_one_token_a_line(federation_with):
    fed = federation_with(admission="invite")
    res = CliRunner().invoke(server_app, ["invite", "--state-dir", str(fed.state.root), "--count", "3"])
    assert res.exit_code == 0
    tokens = res.stdout.split()
    assert len(tokens) == 3 and all(_register(fed, invite=t).created for t in tokens)


def test_invite_issues_ten_thousand_distinct_genuine_tokens_at_once(federation_with):
    """A planned population's invitations in one call (issue 51): 10,000 distinct tokens, each this server's."""
    from zoo_gym.server.transport.admission import invite_id

    fed = federation_with(admission="invite")
    res = CliRunner().invoke(server_app, ["invite", "--state-dir", str(fed.state.root), "--count", "10000", "--json"])
    assert res.exit_code == 0, res.output
    tokens = json.loads(res.stdout)["invites"]
    ids = {invite_id(t, server_public_key=fed.state.public_key) for t in tokens}
    assert len(tokens) == len(ids) == 10000
    assert _register(fed, invite=tokens[-1]).created


def test_serve_refuses_an_unknown_admission_mode_in_one_line(tmp_path):
    res = CliRunner().invoke(server_app, ["serve", "--state-dir", str(tmp_path), "--insecure", "--admission", "opne"])
    assert res.exit_code == 2 and "`admission` must be open or invite" in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
