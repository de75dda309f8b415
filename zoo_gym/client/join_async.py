"""The contributor's loop against a server in async mode (`gym-server serve --mode async`).

It trains continuously, one contribution (contribute.py) after another, never waiting for a round to end.
The base changes only between local runs: each run trains on the version it fetched and its delta names that
version's round, which the server accepts while it is at most RoundInfo.max_staleness versions old. A delta
waits to be sent only while the server's buffer holds this contributor's previous one or is being flushed;
one that grew too stale meanwhile is dropped. A run never starts on the version the previous one trained on:
it waits for the next (one delta per contributor per version; a second one would repeat the same step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from zoo_gym.client.contribute import Contributor, SubmitResult, contribute, not_selected, refused, say_payouts
from zoo_gym.proto import gym_pb2

__all__ = ["AsyncStop", "Contributor", "Versions", "is_async", "train_continuously"]


class AsyncStop(RuntimeError):
    """The contributor cannot go on (the server halted, or never took a delta or published a version)."""


def is_async(info: gym_pb2.RoundInfo) -> bool:
    return info.mode == "async"


def _latest(c: Contributor) -> gym_pb2.RoundInfo:
    info = c.round_info()
    if info.state == gym_pb2.ROUND_STATE_HALTED:
        raise AsyncStop(f"the server halted: {info.message or 'no more versions'}")
    return info


def train_continuously(c: Contributor, opts) -> list[dict]:
    """Run `opts.rounds` local trainings, each submitted (or dropped when too stale); one summary per
    submitted delta, with the round it trained on, the buffer it went to, its staleness and its "payout" once its
    buffer's flush paid it (said as it is seen, between runs and at the end; None until then)."""
    summaries: list[dict] = []
    runs, trained_round, seq = 0, None, 0
    while len(summaries) < opts.rounds and runs < 4 * opts.rounds:  # bounded: a delta dropped is trained again
        runs += 1
        info = _next_version(c, opts, trained_round)
        seq = say_payouts(c, summaries, seq, settled_through=info.round_id - 1)  # flushed: the versions before
        trained_round = info.round_id
        result = contribute(info, contributor=c, opts=opts, cadence=Versions(opts))
        if result is not None:
            summaries.append(result.summary(round=result.round_id, trained_on_round=result.trained_on,
                                            staleness=result.staleness, payout=None))
    say_payouts(c, summaries, seq, settled_through=None)  # buffers flushed by now; the rest are not waited for
    return summaries


def _next_version(c: Contributor, opts, trained_round: int | None) -> gym_pb2.RoundInfo:
    """The latest version once it is not the one the previous run trained on. A second run on the same base
    trains the same examples from the same weights: its delta lands in the next buffer as a stale copy of the
    last one and applies that step twice (benchmarks/async.py: the main reason async was slow, issue 16)."""
    info = _latest(c)
    if info.round_id != trained_round and not not_selected(info):
        return info
    c.say(f"not selected for round {info.round_id}'s buffer (sample rate {info.sample_rate:g}); waiting for the next"
          if not_selected(info) else f"already trained on version {info.round_id - 1}; waiting for the next version")
    deadline = time.monotonic() + opts.max_wait
    while time.monotonic() < deadline:
        time.sleep(0.5)
        info = _latest(c)
        if info.round_id != trained_round and not not_selected(info):
            return info
    raise AsyncStop(f"no version after {trained_round - 1} was published within {opts.max_wait:.0f} s")


@dataclass
class Versions:
    """The async cadence: a delta is sent once the open buffer can take it, or dropped when it grew too stale."""

    opts: object  # join.JoinOptions

    def label(self, info: gym_pb2.RoundInfo) -> str:
        return f"version {info.round_id - 1}"

    def training(self, info: gym_pb2.RoundInfo) -> str:
        return f"version {info.round_id - 1} (round {info.round_id})"

    def send(self, c: Contributor, trained: gym_pb2.RoundInfo, payload: bytes, metadata: dict):
        """The SubmitResponse once a buffer took the delta trained on `trained`'s base; None when it grew too
        stale first (it is dropped)."""
        deadline = time.monotonic() + self.opts.max_wait
        announced = False
        while time.monotonic() < deadline:
            now = _latest(c)
            staleness = now.round_id - trained.round_id
            if staleness > now.max_staleness:
                c.say(f"the delta trained on version {trained.round_id - 1} is {staleness} versions old (the server "
                      f"takes at most {now.max_staleness}); dropping it and training on version {now.round_id - 1}")
                return None
            if now.state != gym_pb2.ROUND_STATE_OPEN or now.you_submitted:
                if not announced:
                    c.say(f"the buffer of round {now.round_id} "
                          f"{'holds our previous delta' if now.you_submitted else 'is being aggregated'}; waiting")
                    announced = True
                time.sleep(0.5)
                continue
            try:
                return c.upload(trained, payload, metadata, progress=self.opts.progress)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                    time.sleep(0.5)  # a flush (or our previous delta) got there first: look again
                    continue
                raise refused(exc) from exc
        raise AsyncStop(f"the server took no delta within {self.opts.max_wait:.0f} s")

    def submitted(self, c: Contributor, r: SubmitResult) -> None:
        nan = float("nan")
        c.say(f"submitted {r.payload_bytes} bytes to round {r.round_id}'s buffer (trained on version "
              f"{r.trained_on - 1}, staleness {r.staleness}); local held-out loss "
              f"{r.metadata.get('loss_before', nan):.4f} -> {r.metadata.get('loss_after', nan):.4f}")
