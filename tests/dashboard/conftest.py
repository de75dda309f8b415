"""One real in-process round (tests/server/conftest.py's federation) shared by the dashboard tests."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import grpc
import pytest

from zoo_gym import codec

_spec = importlib.util.spec_from_file_location("server_conftest", Path(__file__).parents[1] / "server" / "conftest.py")
server_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_conftest)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def one_round(tmp_path_factory):
    """Round 1 with three registered contributors: two small deltas accepted, one 1000x larger refused by
    validation, and one late submission refused with FAILED_PRECONDITION after the round closed."""
    logger = logging.getLogger("zoo_gym.server")
    records, old_level = Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    fed = server_conftest.start_federation(tmp_path_factory.mktemp("dash") / "state", min_contributors=3,
                                           aggregator="mean")
    try:
        people, payload_bytes = [], 0
        for i in range(3):
            key, cid = fed.register()
            payload = codec.encode(fed.small_delta(seed=i, scale=1e-3 if i < 2 else 1.0), codec="fp16")
            payload_bytes += len(payload)
            fed.submit(key, cid, payload)
            people.append((key, cid))
        deadline = time.monotonic() + 120
        while fed.round().round_id < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fed.round().round_id == 2, "round 1 was not published within 120 s"
        key, cid = people[0]
        late = codec.encode(fed.small_delta(seed=9), codec="fp16")
        with pytest.raises(grpc.RpcError) as refused:
            fed.submit(key, cid, late, round_id=1)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        yield {"fed": fed, "people": people, "payload_bytes": payload_bytes, "late_bytes": len(late),
               "log": records.lines}
    finally:
        fed.stop()
        logger.removeHandler(records)
        logger.setLevel(old_level)


@pytest.fixture
def federation_with(tmp_path):
    started = []

    def start(**overrides):
        started.append(server_conftest.start_federation(tmp_path / f"state{len(started)}", **overrides))
        return started[-1]

    yield start
    for fed in started:
        fed.stop()
