"""One contribution, the path both join loops take: download the base a verified RoundInfo names (its lineage
checked against the pinned server key), train and encode in a child process (this process never holds the
model), sign the header, upload with retries, and keep the delta aside for a variant when asked (distilled after
the last round by `RoundTrainer.distil_variants`: minutes of distillation never delay a round).

`contribute(info, contributor=..., opts=..., cadence=...)` returns a SubmitResult, or None when the server
would not take the delta (the round closed, or the delta grew too stale); it raises JoinError (one line) when
the contributor cannot go on. The cadence (join.py's rounds, join_async.py's versions) names the base in what
is said and decides when the upload is sent. `say_payouts` says what each settled round paid and why.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import grpc

from zoo_gym import codec
from zoo_gym.client.download import DownloadError, fetch
from zoo_gym.client.train_process import run_in_child
from zoo_gym.client.upload import build_header, get_round_request, request_stream
from zoo_gym.proto import gym_pb2


def not_selected(info) -> bool:
    """The server samples contributors (0 < sample_rate < 1) and this signed answer says we are not selected:
    the contributor waits for the next round instead of training."""
    return 0.0 < float(info.sample_rate) < 1.0 and not info.selected


def server_dp_note(info) -> str:
    """What a signed RoundInfo says of the server's DP, for the training line ("" without server DP): the ε spent
    and the participation mode, which decides what that ε protects (docs/design/privacy.md)."""
    mode = str(info.dp_participation)
    if not mode and not float(info.dp_epsilon_spent):
        return ""
    what = {"public": "the ledger names who took part; the ε covers what each delta contains",
            "private": "no public surface names who took part"}.get(mode, "not stated by this server")
    return (f"; server DP: ε {float(info.dp_epsilon_spent):.3f} spent at δ {float(info.dp_delta):g} "
            f"(participation {mode or 'unknown'}: {what})")


class JoinError(RuntimeError):
    """The contributor cannot go on; the message says why and what to do."""


@dataclass
class Contributor:
    """The connection, identity and helpers join() sets up once; every contribution goes through them."""

    stub: object
    cid: str
    key: object
    retry: Callable  # retry(fn, what)
    verified: Callable  # verified(info) -> info, raising when the server's signature does not verify
    trainer: object  # RoundTrainer: trains and encodes in a child process
    say: Callable[[str], None]
    server_key: bytes  # pinned on first contact; checkpoints' lineage signatures are checked against it

    def round_info(self, *, signed: bool = True) -> gym_pb2.RoundInfo:
        """The server's current RoundInfo, its signature verified; signed asks (you_submitted is ours)."""
        def ask():  # a signed request is fresh on every try: the server takes one only within minutes
            request = get_round_request(self.key, self.cid) if signed else gym_pb2.GetRoundRequest()
            return self.stub.GetRound(request, timeout=30)

        return self.verified(self.retry(ask, "get round"))

    def upload(self, info: gym_pb2.RoundInfo, payload: bytes, metadata: dict, *, progress: bool):
        """Sign a fresh header for a delta trained on `info`'s base and stream it, retried; grpc.RpcError when
        the server refuses it."""
        header = build_header(key=self.key, contributor_id=self.cid, round_id=info.round_id,
                              base_sha256=info.base_sha256, payload=payload, metadata=metadata)
        chunk = min(info.limits.max_chunk_bytes or (1 << 20), 1 << 20)
        return self.retry(lambda: self.stub.SubmitDelta(request_stream(header, payload, chunk_bytes=chunk,
                                                                       progress=progress), timeout=600), "upload")


@dataclass
class SubmitResult:
    """A delta the server took: `trained_on` is the round whose base it trained on, `round_id` the round (in
    async mode the buffer) it was stored under."""

    trained_on: int
    round_id: int
    contributor: str
    payload_bytes: int
    payload_sha256: str
    submissions_in_round: int
    metadata: dict
    codecs: list[str]
    variant: str | None = None
    checkpoint_source: str | None = None  # where the base came from: a mirror's URL, "server" or "cache"
    learning_rate: float | None = None  # what the round trained at (the server's schedule applied)

    @property
    def staleness(self) -> int:
        return self.round_id - self.trained_on

    def summary(self, **first) -> dict:
        """The join summary: `first`'s keys, then what every contribution reports."""
        out = {**first, "contributor": self.contributor, "payload_bytes": self.payload_bytes,
               "payload_sha256": self.payload_sha256, "submissions_in_round": self.submissions_in_round,
               "loss_before": self.metadata.get("loss_before"), "loss_after": self.metadata.get("loss_after"),
               "steps": self.metadata.get("steps"), "train_seconds": self.metadata.get("train_seconds"),
               "codecs": self.codecs, "learning_rate": self.learning_rate}
        if self.variant is not None:
            out["variant"] = self.variant
        if self.checkpoint_source is not None:
            out["checkpoint_source"] = self.checkpoint_source
        return out


class Cadence(Protocol):
    """What differs between synchronous rounds and async versions inside one contribution."""

    def label(self, info: gym_pb2.RoundInfo) -> str:
        """The base's name in errors and variant file names: "round 3", "version 2"."""

    def training(self, info: gym_pb2.RoundInfo) -> str:
        """What the training line calls the base."""

    def send(self, c: Contributor, info: gym_pb2.RoundInfo, payload: bytes, metadata: dict):
        """Upload when the server can take it (c.upload): the SubmitResponse, or None when it cannot."""

    def submitted(self, c: Contributor, result: SubmitResult) -> None:
        """Say that `result` was taken."""


def say_payouts(c: Contributor, summaries: list[dict], since_seq: int, *, settled_through: int | None) -> int:
    """Fill the "payout" of each summary still without one from this contributor's signed ledger entries after
    `since_seq`, saying one line per round: what it was paid and why. A round up to `settled_through` (published)
    without an entry is said unpaid; a later one waits for its entries. Returns the last seq seen. A query that
    fails is said in one line and the join goes on: the deltas were taken."""
    from zoo_gym.client.rewards import RewardsError, own_entries, payout

    waiting = [s for s in summaries if s.get("payout") is None]
    if not waiting:
        return since_seq
    try:
        rows = c.retry(lambda: own_entries(c.stub, key=c.key, contributor_id=c.cid, server_key=c.server_key,
                                           since_seq=since_seq), "ledger")
    except (RewardsError, grpc.RpcError) as exc:
        why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
        c.say(f"round {waiting[0]['round']}: pay not shown ({why})")
        return since_seq
    for s in waiting:
        mine = [r for r in rows if r["round_id"] == s["round"]]
        if mine or (settled_through is not None and s["round"] <= settled_through):
            s["payout"], line = payout(s["round"], mine)
            c.say(line)
    return max([since_seq, *(r["seq"] for r in rows)])


def lr_scale_of(info) -> float:
    """The factor the round asks every contributor's learning rate to be trained at (--client-lr-decay on the
    server, signed into RoundInfo); 1 when the server sets none (0: a server from before the field)."""
    scale = float(getattr(info, "client_lr_scale", 0.0) or 0.0)
    return scale if 0.0 < scale < float("inf") else 1.0


def lr_scale_note(info, config) -> str:
    scale = lr_scale_of(info)
    return "" if scale == 1.0 else (f"; learning rate {config.learning_rate:g} x {scale:.3g} = "
                                    f"{config.learning_rate * scale:.3g} (the server's schedule)")


def refused(exc: grpc.RpcError) -> JoinError:
    return JoinError(f"submission refused ({exc.code().name}): {exc.details()}")


def contribute(info: gym_pb2.RoundInfo, *, contributor: Contributor, opts, cadence: Cadence) -> SubmitResult | None:
    """Train on `info`'s base (a verified RoundInfo) and submit the delta; None when the server did not take it."""
    c = contributor
    try:  # the sha256 comes from the signed RoundInfo; the lineage's own signature is checked after unpacking
        # (a lineage from before signing only through `info`, which names the sha256: server_signatures.py)
        fetched = fetch(c.stub, info.base_sha256, info.base_size, opts.workdir, progress=opts.progress,
                        retry=lambda fn: c.retry(fn, "download"), server_key=c.server_key, round_info=info, say=c.say)
        model_dir = fetched.model_dir
    except DownloadError as exc:
        raise JoinError(f"{cadence.label(info)}: refusing the base checkpoint: {exc}") from None
    c.say(f"{cadence.training(info)}: training ({c.trainer.config.label}) on base {info.base_sha256[:12]}"
          f"{server_dp_note(info)}{lr_scale_note(info, c.trainer.config)}")
    payload, metadata, kept = c.trainer.train(model_dir, info.base_sha256,  # kept: made a variant once taken
                                              lr_scale=lr_scale_of(info))
    resp = None
    try:
        resp = cadence.send(c, info, payload, metadata)
    finally:
        if kept is not None and resp is None:  # not taken: no variant
            kept.unlink(missing_ok=True)
    if resp is None:
        return None
    result = SubmitResult(trained_on=int(info.round_id), round_id=int(resp.round_id), contributor=c.cid,
                          payload_bytes=len(payload), payload_sha256=resp.payload_sha256,
                          submissions_in_round=resp.submissions, metadata=metadata,
                          codecs=sorted({e.codec for e in codec.read_manifest(payload).entries}),
                          checkpoint_source=fetched.source,
                          learning_rate=c.trainer.config.learning_rate * lr_scale_of(info))
    cadence.submitted(c, result)
    if kept is not None:
        name = f"{c.cid[:8]}-{cadence.label(info).replace(' ', '')}.zgd"
        result.variant = c.trainer.keep_variant(kept, model_dir, out=opts.workdir / "variants" / name,
                                                checkpoint_sha256=info.base_sha256)
    return result


class EncodeProgress(Mapping):
    """A delta that `codec.encode` reads tensor by tensor through a progress bar: the encode phase gets its
    own bar beside download, train and upload (a 0.6B-sized full delta takes tens of seconds to encode)."""

    def __init__(self, delta: Mapping, *, progress: bool) -> None:
        self._delta, self._progress = delta, progress

    def __getitem__(self, name):
        return self._delta[name]

    def __len__(self) -> int:
        return len(self._delta)

    def __iter__(self):
        from tqdm import tqdm

        return iter(tqdm(self._delta, desc="encode", unit="tensor", disable=not self._progress, leave=False))


def _payload(result, opts, feedback) -> bytes:
    delta = result.delta
    if feedback is not None:
        delta = feedback.add_to(delta)
    payload = codec.encode(EncodeProgress(delta, progress=opts.progress), codec=opts.codec,
                           group_size=opts.group_size, metadata={"base_sha256": result.base_sha256, **result.metadata})
    if feedback is not None:  # decoded a tensor at a time: never a dense copy of the whole delta
        from zoo_gym.gym_train.error_feedback import DecodedPayload

        feedback.update(delta, DecodedPayload(payload))
    return payload


def _train_and_encode(model_dir: Path, opts, config, feedback, train_ex: list[dict], held_ex: list[dict], *,
                      base_sha256: str, payload_path: Path, delta_path: Path | None) -> dict:
    """In the training process: train, write the payload to `payload_path` (and, for --keep-variant, the
    delta itself to `delta_path`); return the training metadata to sign."""
    import torch

    from zoo_gym import gym_train

    result = gym_train.train(model_dir, train_ex, config, base_sha256=base_sha256, eval_examples=held_ex,
                             progress=opts.progress)
    payload_path.write_bytes(_payload(result, opts, feedback))
    if delta_path is not None:
        torch.save(result.delta, delta_path)
    return result.metadata


def _keep_variant(delta_path: Path, model_dir: Path, *, out: Path, checkpoint_sha256: str,
                  calib_examples: list[dict], distill_steps: int, device: str) -> dict:
    """In a training process: the delta that `_train_and_encode` saved, distilled into a variant at `out`."""
    import torch

    from zoo_gym.client.personalize import keep_round_variant
    from zoo_gym.codec import LoraFactors

    with torch.serialization.safe_globals([LoraFactors]):
        delta = torch.load(delta_path, weights_only=True)
    return keep_round_variant(delta, model_dir, out=out, checkpoint_sha256=checkpoint_sha256,
                              calib_examples=calib_examples, say=lambda _m: None, distill_steps=distill_steps,
                              device=device)


@dataclass
class RoundTrainer:
    """Trains a round in a child process; the model never enters this one."""

    opts: object  # join.JoinOptions
    config: object  # TrainConfig
    feedback: object  # gym_train.ErrorFeedback or None
    train_ex: list[dict]
    held_ex: list[dict]
    say: Callable[[str], None]
    pending: list[tuple[Path, Path, Path, str]] = field(default_factory=list)  # kept deltas, not yet distilled

    def train(self, model_dir: Path, base_sha256: str, *, lr_scale: float = 1.0) -> tuple[bytes, dict, Path | None]:
        """(payload, metadata to sign, the delta's file for `keep_variant` or None); the round trains at the
        configured learning rate x `lr_scale` (the server's schedule)."""
        config = self.config if lr_scale == 1.0 else replace(self.config,
                                                             learning_rate=self.config.learning_rate * lr_scale)
        fd, name = tempfile.mkstemp(dir=self.opts.workdir, prefix="payload-", suffix=".zgd")
        os.close(fd)
        payload_path = Path(name)
        delta_path = payload_path.with_suffix(".delta.pt") if self.opts.keep_variant else None
        try:
            metadata = run_in_child(_train_and_encode, model_dir, self.opts, config, self.feedback,
                                    self.train_ex, self.held_ex, base_sha256=base_sha256, payload_path=payload_path,
                                    delta_path=delta_path)
            return payload_path.read_bytes(), metadata, delta_path
        finally:
            payload_path.unlink(missing_ok=True)

    def keep_variant(self, delta_path: Path, model_dir: Path, *, out: Path, checkpoint_sha256: str) -> str:
        """`--keep-variant`: set the round's delta (from `train`) aside; `distil_variants` writes the variant at
        `out` after the last round, so the next round trains at once. The path the variant will have."""
        self.pending.append((delta_path, model_dir, out, checkpoint_sha256))
        self.say(f"variant {out.name} deferred: its scales are distilled after the last round, so no round "
                 "waits for it")
        return str(out)

    def distil_variants(self) -> None:
        """Distil every deferred variant, one child process each, with a line before and after each."""
        n = len(self.pending)
        for i in range(1, n + 1):
            delta_path, model_dir, out, sha = self.pending.pop(0)
            self.say(f"distilling variant {i}/{n}: {out.name} (the rounds are done)")
            try:
                summary = run_in_child(_keep_variant, delta_path, model_dir, out=out, checkpoint_sha256=sha,
                                       calib_examples=self.train_ex, distill_steps=self.opts.distill_steps,
                                       device=self.config.device)
            finally:
                delta_path.unlink(missing_ok=True)
            self.say(f"kept variant {out} ({summary['bytes']} bytes)")

    def discard_variants(self) -> None:
        """The join failed: drop the deltas kept for variants (their rounds were submitted; no variant is made)."""
        if self.pending:
            self.say(f"not making {len(self.pending)} deferred variant(s): the join stopped early")
        for delta_path, *_ in self.pending:
            delta_path.unlink(missing_ok=True)
        self.pending.clear()
