"""RoundInfo.dp_participation (issue 46): with server DP on, GetRound names the participation mode, which decides
what the ε protects, and the server's signature covers it; without DP the field is empty and the signed bytes are
those of a RoundInfo from before the field existed, so older answers and older clients still verify."""

from __future__ import annotations

import pytest

from zoo_gym.client.contribute import server_dp_note
from zoo_gym.proto import gym_pb2, signing

DP = dict(aggregator="mean", dp_noise_multiplier=1.0, dp_clip=0.05, dp_expected_contributors=3)


class _WithoutParticipation:
    """A RoundInfo as a reader that has no dp_participation field sees it: every other field, that one absent."""

    def __init__(self, info: gym_pb2.RoundInfo) -> None:
        self._info = info

    def __getattr__(self, name):
        if name == "dp_participation":
            raise AttributeError(name)
        return getattr(self._info, name)


def _verifies(info) -> bool:
    try:
        signing.verify(bytes(info.server_public_key), bytes(info.signature), signing.round_info_bytes(info))
    except signing.SignatureError:
        return False
    return True


@pytest.mark.parametrize("mode", ["public", "private"])
def test_a_dp_server_signs_its_participation_mode(federation_with, mode):
    info = federation_with(**DP, dp_participation=mode).round()
    assert info.dp_participation == mode and info.dp_delta > 0
    assert _verifies(info)
    assert b'"dp_participation":"%s"' % mode.encode() in signing.round_info_bytes(info)
    # a RoundInfo whose mode was altered (or dropped) after signing no longer verifies
    for forged_mode in ({"public": "private", "private": "public"}[mode], ""):
        forged = gym_pb2.RoundInfo()
        forged.CopyFrom(info)
        forged.dp_participation = forged_mode
        assert not _verifies(forged), forged_mode
    # the contributor's training line says which mode the ε it is shown was accounted in
    note = server_dp_note(info)
    assert f"participation {mode}" in note and "ε 0.000 spent" in note


def test_without_dp_the_field_is_empty_and_the_bytes_are_as_before(federation_with):
    info = federation_with().round()
    assert info.dp_participation == "" and info.dp_epsilon_spent == 0
    assert _verifies(info)
    old = _WithoutParticipation(info)
    assert signing.round_info_bytes(info) == signing.round_info_bytes(old)
    assert b"dp_participation" not in signing.round_info_bytes(info)
    assert server_dp_note(info) == ""


def test_the_mode_is_covered_only_when_set():
    """The canonical JSON leaves the field out when empty and includes it, as a string, when set."""
    info = gym_pb2.RoundInfo(round_id=3, base_sha256="a" * 64, limits=gym_pb2.Limits(), dp_epsilon_spent=1.5,
                             dp_delta=1e-5)
    before = signing.round_info_bytes(info)
    assert before == signing.round_info_bytes(_WithoutParticipation(info))
    info.dp_participation = "private"
    assert signing.round_info_bytes(info) != before
    assert server_dp_note(info) == ("; server DP: ε 1.500 spent at δ 1e-05 (participation private: no public "
                                    "surface names who took part)")
