"""Out-of-range wire integers and malformed ids are INVALID_ARGUMENT, never INTERNAL (issue 14 item 5, in part)."""

from __future__ import annotations

import grpc
import pytest

from zoo_gym.proto import gym_pb2


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_ledger_since_seq_past_sqlite_range_is_invalid_argument(federation):
    too_big = (1 << 64) - 1  # was "OverflowError: Python int too large to convert to SQLite INTEGER": INTERNAL
    assert _code(lambda: list(federation.stub.StreamLedger(gym_pb2.LedgerRequest(since_seq=too_big)))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert list(federation.stub.StreamLedger(gym_pb2.LedgerRequest(since_seq=(1 << 63) - 1))) == []
    assert federation.round().round_id == 1  # still serving


@pytest.mark.parametrize("bad_id", ["x", "A" * 32, "0" * 31, "0" * 10_000])
def test_malformed_contributor_ids_are_invalid_argument(federation, bad_id):
    stub = federation.stub
    assert _code(lambda: stub.GetBalance(gym_pb2.BalanceRequest(contributor_id=bad_id))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: list(stub.StreamLedger(gym_pb2.LedgerRequest(contributor_id=bad_id)))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: stub.GetRound(gym_pb2.GetRoundRequest(contributor_id=bad_id))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    key, cid = federation.register()
    assert stub.GetBalance(gym_pb2.BalanceRequest(contributor_id=cid)).balance == 0  # well-formed still answered
