"""The contributor's loop against a server in async mode (`gym-server serve --mode async`).

It trains continuously: fetch the latest version, train, submit, repeat, never waiting for a round to
end. The base changes only between local runs: each run trains on the version it fetched, and its delta
names that version's round (SubmitHeader.round_id), which the server accepts while it is at most
RoundInfo.max_staleness versions old. A delta can wait before it is sent only while the server's
buffer already holds this contributor's previous one (one per buffer) or is being flushed; one that
grew too stale meanwhile is dropped, and the next run trains on the latest version. A run never starts on
the version the previous one trained on: it waits for the next (one delta per contributor per version, as in
a synchronous round; a second one on the same base would repeat the same step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from zoo_gym import codec
from zoo_gym.client.download import DownloadError, fetch_checkpoint
from zoo_gym.client.upload import build_header, get_round_request, request_stream
from zoo_gym.proto import gym_pb2


class AsyncStop(RuntimeError):
    """The contributor cannot go on (the server halted, refused the delta for good, or never answered)."""


@dataclass
class Contributor:
    """What the loop needs from join(): the connection, identity, data and helpers it already set up."""

    stub: object
    cid: str
    key: object
    retry: Callable  # retry(fn, what)
    verified: Callable  # verified(info) -> info, raising when the server's signature does not verify
    trainer: object  # join.RoundTrainer: trains and encodes in a child process (the model never enters this one)
    say: Callable[[str], None]
    server_key: bytes  # pinned on first contact; checkpoints' lineage signatures are checked against it


def is_async(info: gym_pb2.RoundInfo) -> bool:
    return info.mode == "async"


def _latest(c: Contributor) -> gym_pb2.RoundInfo:
    info = c.verified(c.retry(lambda: c.stub.GetRound(get_round_request(c.key, c.cid), timeout=30), "get round"))
    if info.state == gym_pb2.ROUND_STATE_HALTED:
        raise AsyncStop(f"the server halted: {info.message or 'no more versions'}")
    return info


def train_continuously(c: Contributor, opts) -> list[dict]:
    """Run `opts.rounds` local trainings, each submitted (or dropped when too stale); one summary per
    submitted delta, with the round it trained on, the buffer it went to and its staleness."""
    summaries: list[dict] = []
    runs, trained_round = 0, None
    while len(summaries) < opts.rounds and runs < 4 * opts.rounds:  # bounded: a delta dropped is trained again
        runs += 1
        info = _next_version(c, opts, trained_round)
        trained_round = info.round_id
        try:  # the sha256 is from the signed RoundInfo; the lineage's own signature is checked after unpacking
            model_dir = fetch_checkpoint(c.stub, info.base_sha256, info.base_size, opts.workdir,
                                         progress=opts.progress, retry=lambda fn: c.retry(fn, "download"),
                                         server_key=c.server_key)
        except DownloadError as exc:
            raise AsyncStop(f"version {info.round_id - 1}: refusing the base checkpoint: {exc}") from None
        c.say(f"version {info.round_id - 1} (round {info.round_id}): training ({opts.method}) on base "
              f"{info.base_sha256[:12]}")
        payload, metadata, kept = c.trainer.train(model_dir, info.base_sha256)  # kept: a variant once taken
        summary = None
        try:
            summary = _submit(c, opts, info, payload, metadata)
        finally:
            if kept is not None and summary is None:  # dropped or refused: no variant
                kept.unlink(missing_ok=True)
        if summary is not None:
            summaries.append(summary)
            if kept is not None:
                summary["variant"] = c.trainer.keep_variant(
                    kept, model_dir, out=opts.workdir / "variants" / f"{c.cid[:8]}-version{info.round_id - 1}.zgd",
                    checkpoint_sha256=info.base_sha256)
    return summaries


def _next_version(c: Contributor, opts, trained_round: int | None) -> gym_pb2.RoundInfo:
    """The latest version once it is not the one the previous run trained on. A second run on the same base
    trains the same examples from the same weights: its delta lands in the next buffer as a stale copy of the
    last one and applies that step twice (benchmarks/async.py: the main reason async was slow, issue 16)."""
    info = _latest(c)
    if info.round_id != trained_round:
        return info
    c.say(f"already trained on version {info.round_id - 1}; waiting for the next version")
    deadline = time.monotonic() + opts.max_wait
    while time.monotonic() < deadline:
        time.sleep(0.5)
        info = _latest(c)
        if info.round_id != trained_round:
            return info
    raise AsyncStop(f"no version after {trained_round - 1} was published within {opts.max_wait:.0f} s")


def _submit(c: Contributor, opts, trained: gym_pb2.RoundInfo, payload: bytes, metadata: dict) -> dict | None:
    """Submit a delta trained on `trained`'s base once the open buffer can take it; None when it grew too
    stale first (it is dropped)."""
    deadline = time.monotonic() + opts.max_wait
    announced = False
    chunk = min(trained.limits.max_chunk_bytes or (1 << 20), 1 << 20)
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
        header = build_header(key=c.key, contributor_id=c.cid, round_id=trained.round_id,
                              base_sha256=trained.base_sha256, payload=payload, metadata=metadata)
        try:
            resp = c.retry(lambda: c.stub.SubmitDelta(request_stream(header, payload, chunk_bytes=chunk,
                                                                     progress=opts.progress), timeout=600), "upload")
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                time.sleep(0.5)  # a flush (or our previous delta) got there first: look again
                continue
            raise AsyncStop(f"submission refused ({exc.code().name}): {exc.details()}") from exc
        staleness = int(resp.round_id) - int(trained.round_id)
        c.say(f"submitted {len(payload)} bytes to round {resp.round_id}'s buffer (trained on version "
              f"{trained.round_id - 1}, staleness {staleness}); local held-out loss "
              f"{metadata.get('loss_before', float('nan')):.4f} -> {metadata.get('loss_after', float('nan')):.4f}")
        return {"round": int(resp.round_id), "trained_on_round": int(trained.round_id), "staleness": staleness,
                "contributor": c.cid, "payload_bytes": len(payload), "payload_sha256": resp.payload_sha256,
                "submissions_in_round": resp.submissions, "loss_before": metadata.get("loss_before"),
                "loss_after": metadata.get("loss_after"),
                "codecs": sorted({e.codec for e in codec.read_manifest(payload).entries})}
    raise AsyncStop(f"the server took no delta within {opts.max_wait:.0f} s")
