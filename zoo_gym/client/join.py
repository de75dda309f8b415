"""The contributor's loop: register, then each round fetch the base, train, encode, sign, upload, wait.

Training and encoding run in a child process (train_process.py): this one, which uploads and waits for the
publish, never holds the model.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from zoo_gym import codec
from zoo_gym.client.connection import ServerUnreachable, open_stub, with_retries
from zoo_gym.client.download import DownloadError, fetch_checkpoint
from zoo_gym.client.train_process import run_in_child
from zoo_gym.client.upload import build_header, get_round_request, register_request, request_stream
from zoo_gym.proto import gym_pb2, signing

if TYPE_CHECKING:
    from zoo_gym.gym_train import TrainConfig

DEFAULT_SHARDS = 64  # built-in data is split into this many disjoint shards; a key picks one


class JoinError(RuntimeError):
    """The contributor cannot go on; the message says why and what to do."""


@dataclass
class JoinOptions:
    server: str
    workdir: Path
    key_path: Path
    rounds: int = 1
    data: str = "builtin"
    method: str = "lora"
    codec: str = "auto"
    group_size: int | None = 128
    max_steps: int | None = None
    shard: int | None = None
    n_shards: int = DEFAULT_SHARDS
    n_examples: int = 256
    display_name: str = ""
    error_feedback: bool = True
    wait_for_publish: bool = True
    progress: bool = True
    max_wait: float = 900.0
    connect_timeout: float = 60.0  # seconds to reach the server at first contact before giving up in one line
    train_overrides: dict = field(default_factory=dict)  # TrainConfig keywords (gym-client join's training flags)
    root_certificates: str | None = None  # PEM the server's certificate must chain to (None: system trust store)
    insecure: bool = False  # plaintext: only when asked for explicitly
    invite: str = ""  # `gym-server invite` token, for a server that admits new keys by invitation
    keep_variant: bool = False  # also keep each round's own delta as a personal variant (workdir/variants/*.zgd)


def _held_count(n: int) -> int:
    return max(2, min(64, n // 10))


def prepare(opts: JoinOptions) -> tuple[TrainConfig, list[dict] | None]:
    """(the round's TrainConfig, the user's examples or None for built-in data), checked before anything
    touches the network: a bad data file, setting or combination fails here (ValueError, or JoinError)."""
    from zoo_gym import gym_train
    from zoo_gym.client.train_settings import check_round

    settings = {"method": opts.method, **({"max_steps": opts.max_steps} if opts.max_steps else {}),
                **opts.train_overrides}
    config = gym_train.TrainConfig(**settings)
    examples = None
    if opts.data == "builtin":
        n = opts.n_examples
    else:
        examples = gym_train.load_examples(opts.data, allow_text=True)
        n = len(examples)
        if any("text" in ex for ex in examples) and (config.method == "grpo" or config.dp_enabled):
            raise JoinError(f"{opts.data}: plain `text` records train only with --method lora or sft without "
                            "DP-SGD (GRPO needs prompts with answers to reward)")
        if n < 4:
            raise JoinError(f"{opts.data} ({n} examples): at least 4 examples are needed "
                            "(some are held out to measure the round)")
    return check_round(config, n_train=n - _held_count(n)), examples


def _examples(opts: JoinOptions, contributor_id: str, user_examples: list[dict] | None = None
              ) -> tuple[list[dict], list[dict], str]:
    """(train, local held-out, description) for this contributor."""
    from zoo_gym import gym_train

    if user_examples is not None:
        examples = user_examples
        desc = f"{opts.data} ({len(examples)} examples)"
    elif opts.data == "builtin":
        shard = opts.shard if opts.shard is not None else int(contributor_id[:8], 16) % opts.n_shards
        task = "grpo" if opts.method == "grpo" else "default"
        examples = gym_train.builtin_examples(task, shard=shard, n_shards=opts.n_shards, n=opts.n_examples)
        desc = f"built-in {task} shard {shard}/{opts.n_shards}"
    else:
        examples = gym_train.load_examples(Path(opts.data), allow_text=True)
        desc = f"{opts.data} ({len(examples)} examples)"
    if len(examples) < 4:
        raise JoinError(f"{desc}: at least 4 examples are needed (some are held out to measure the round)")
    n_held = _held_count(len(examples))
    return examples[n_held:], examples[:n_held], desc


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


def _payload(result, opts: JoinOptions, feedback) -> bytes:
    delta = result.delta
    if feedback is not None:
        delta = feedback.add_to(delta)
    payload = codec.encode(EncodeProgress(delta, progress=opts.progress), codec=opts.codec,
                           group_size=opts.group_size, metadata={"base_sha256": result.base_sha256, **result.metadata})
    if feedback is not None:  # decoded a tensor at a time: never a dense copy of the whole delta
        from zoo_gym.gym_train.error_feedback import DecodedPayload

        feedback.update(delta, DecodedPayload(payload))
    return payload


def _train_and_encode(model_dir: Path, opts: JoinOptions, config, feedback, train_ex: list[dict],
                      held_ex: list[dict], *, base_sha256: str, payload_path: Path, delta_path: Path | None) -> dict:
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
                  calib_examples: list[dict]) -> dict:
    """In a training process: the delta that `_train_and_encode` saved, distilled into a variant at `out`."""
    import torch

    from zoo_gym.client.personalize import keep_round_variant
    from zoo_gym.codec import LoraFactors

    with torch.serialization.safe_globals([LoraFactors]):
        delta = torch.load(delta_path, weights_only=True)
    return keep_round_variant(delta, model_dir, out=out, checkpoint_sha256=checkpoint_sha256,
                              calib_examples=calib_examples, say=lambda _m: None)


@dataclass
class RoundTrainer:
    """Trains a round in a child process; the model never enters this one. Shared by the sync and async loops."""

    opts: JoinOptions
    config: object  # TrainConfig
    feedback: object  # gym_train.ErrorFeedback or None
    train_ex: list[dict]
    held_ex: list[dict]
    say: Callable[[str], None]

    def train(self, model_dir: Path, base_sha256: str) -> tuple[bytes, dict, Path | None]:
        """(payload, metadata to sign, the delta's file for `keep_variant` or None)."""
        fd, name = tempfile.mkstemp(dir=self.opts.workdir, prefix="payload-", suffix=".zgd")
        os.close(fd)
        payload_path = Path(name)
        delta_path = payload_path.with_suffix(".delta.pt") if self.opts.keep_variant else None
        try:
            metadata = run_in_child(_train_and_encode, model_dir, self.opts, self.config, self.feedback,
                                    self.train_ex, self.held_ex, base_sha256=base_sha256, payload_path=payload_path,
                                    delta_path=delta_path)
            return payload_path.read_bytes(), metadata, delta_path
        finally:
            payload_path.unlink(missing_ok=True)

    def keep_variant(self, delta_path: Path, model_dir: Path, *, out: Path, checkpoint_sha256: str) -> str:
        """`--keep-variant`: the round's delta (from `train`) as a personal variant at `out`; its path."""
        try:
            summary = run_in_child(_keep_variant, delta_path, model_dir, out=out, checkpoint_sha256=checkpoint_sha256,
                                   calib_examples=self.train_ex)
        finally:
            delta_path.unlink(missing_ok=True)
        self.say(f"kept this round's delta as variant {out} ({summary['bytes']} bytes)")
        return summary["path"]


def join(opts: JoinOptions, *, say: Callable[[str], None] = print) -> list[dict]:
    """Run `opts.rounds` rounds; return one summary dict per submitted round."""
    from zoo_gym import gym_train

    config, user_examples = prepare(opts)
    key, created = signing.load_or_create_key(opts.key_path)
    if created:
        say(f"created a new contributor key at {opts.key_path}")
    channel, stub = open_stub(opts.server, root_certificates=opts.root_certificates, insecure=opts.insecure)
    retry = lambda fn, what: with_retries(fn, what=what, say=say, max_wait=opts.max_wait)  # noqa: E731
    try:
        reg = with_retries(lambda: stub.Register(register_request(key, opts.display_name or "contributor",
                                                                  invite=opts.invite), timeout=30),
                           what=f"register at {opts.server}", say=say, max_wait=opts.connect_timeout)
    except grpc.RpcError as exc:
        raise JoinError(f"registration refused: {exc.details()}") from exc
    cid = reg.contributor_id
    from zoo_gym.client import known_servers
    from zoo_gym.client.rewards import legacy_pin_path

    try:  # pinned per server address (trust on first use); every RoundInfo is checked against it
        server_key = known_servers.for_key(opts.key_path).trust(opts.server, bytes(reg.server_public_key), say=say,
                                                                legacy=legacy_pin_path(opts.key_path))
    except known_servers.UntrustedServer as exc:
        raise JoinError(str(exc)) from None
    say(f"contributor {cid} {'registered' if reg.created else 'already registered'} at {opts.server}")
    opts.workdir.mkdir(parents=True, exist_ok=True)
    train_ex, held_ex, desc = _examples(opts, cid, user_examples)
    say(f"training data: {desc}")
    feedback = None
    if opts.error_feedback and opts.codec not in ("fp16", "bf16", "fp32", "lora"):
        feedback = gym_train.ErrorFeedback(opts.workdir / f"error_feedback-{cid}.safetensors")
    trainer = RoundTrainer(opts, config, feedback, train_ex, held_ex, say)
    from zoo_gym.client import join_async

    first = _verified(retry(lambda: stub.GetRound(gym_pb2.GetRoundRequest(), timeout=30), "get round"),
                      server_key, opts)
    if join_async.is_async(first):  # buffered rounds: train continuously, no round boundaries (join_async.py)
        contributor = join_async.Contributor(stub, cid, key, retry, lambda info: _verified(info, server_key, opts),
                                             trainer, say, server_key)
        try:
            return join_async.train_continuously(contributor, opts)
        except join_async.AsyncStop as exc:
            raise JoinError(str(exc)) from None
        finally:
            channel.close()
    summaries: list[dict] = []
    while len(summaries) < opts.rounds:
        info = _wait_for_open_round(stub, cid, retry, say, opts, server_key=server_key, key=key)
        try:  # the sha256 comes from the signed RoundInfo; the lineage's own signature is checked after unpacking
            model_dir = fetch_checkpoint(stub, info.base_sha256, info.base_size, opts.workdir, progress=opts.progress,
                                         retry=lambda fn: retry(fn, "download"), server_key=server_key)
        except DownloadError as exc:
            raise JoinError(f"round {info.round_id}: refusing the base checkpoint: {exc}") from None
        say(f"round {info.round_id}: training ({opts.method}) on base {info.base_sha256[:12]}")
        payload, metadata, kept = trainer.train(model_dir, info.base_sha256)  # kept: made a variant after the upload
        header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                              payload=payload, metadata=metadata)
        chunk = min(info.limits.max_chunk_bytes or (1 << 20), 1 << 20)
        try:
            resp = retry(lambda: stub.SubmitDelta(request_stream(header, payload, chunk_bytes=chunk,
                                                                 progress=opts.progress), timeout=600), "upload")
        except grpc.RpcError as exc:
            if kept is not None:
                kept.unlink(missing_ok=True)
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                say(f"round {info.round_id} closed before the upload finished ({exc.details()}); "
                    "training again on the next base")
                continue
            raise JoinError(f"submission refused ({exc.code().name}): {exc.details()}") from exc
        summary = {"round": info.round_id, "contributor": cid, "payload_bytes": len(payload),
                   "payload_sha256": resp.payload_sha256, "submissions_in_round": resp.submissions,
                   "loss_before": metadata.get("loss_before"), "loss_after": metadata.get("loss_after"),
                   "codecs": sorted({e.codec for e in codec.read_manifest(payload).entries})}
        summaries.append(summary)
        say(f"round {info.round_id}: submitted {len(payload)} bytes; local held-out loss "
            f"{summary['loss_before']:.4f} -> {summary['loss_after']:.4f}")
        if kept is not None:
            summary["variant"] = trainer.keep_variant(kept, model_dir, out=opts.workdir / "variants" / (
                f"{cid[:8]}-round{info.round_id}.zgd"), checkpoint_sha256=info.base_sha256)
        if len(summaries) < opts.rounds or opts.wait_for_publish:
            _wait_for_round_after(stub, info.round_id, retry, say, opts, server_key=server_key)
    channel.close()
    return summaries


def _verified(info, server_key: bytes, opts: JoinOptions):
    """`info` once the pinned server key's signature over it verifies; JoinError (one line) otherwise."""
    from zoo_gym.client.known_servers import UntrustedServer
    from zoo_gym.client.server_signatures import verify_round_info

    try:
        verify_round_info(info, server_key=server_key, address=opts.server)
    except UntrustedServer as exc:
        raise JoinError(str(exc)) from None
    return info


def _wait_for_open_round(stub, cid: str, retry, say, opts: JoinOptions, *, server_key: bytes, key):
    deadline = time.monotonic() + opts.max_wait
    announced = None
    while True:
        info = retry(lambda: stub.GetRound(get_round_request(key, cid), timeout=30), "get round")  # signed: you_submitted
        _verified(info, server_key, opts)
        if info.state == gym_pb2.ROUND_STATE_HALTED:
            raise JoinError(f"the server halted: {info.message or 'no more rounds'}")
        if info.state == gym_pb2.ROUND_STATE_OPEN and not info.you_submitted:
            return info
        if announced != info.round_id:
            say(f"round {info.round_id} is not open for us yet "
                f"({'already submitted' if info.you_submitted else 'aggregating'}); waiting")
            announced = info.round_id
        if time.monotonic() > deadline:
            raise ServerUnreachable(f"no open round within {opts.max_wait:.0f} s")
        time.sleep(1.0)


def _wait_for_round_after(stub, round_id: int, retry, say, opts: JoinOptions, *, server_key: bytes) -> None:
    deadline = time.monotonic() + opts.max_wait
    while True:
        info = retry(lambda: stub.GetRound(gym_pb2.GetRoundRequest(), timeout=30), "get round")
        _verified(info, server_key, opts)
        if info.round_id > round_id or info.state == gym_pb2.ROUND_STATE_HALTED:
            if info.round_id > round_id:
                say(f"round {round_id} published; round {info.round_id} is open")
            return
        if time.monotonic() > deadline:
            raise JoinError(f"round {round_id} was not published within {opts.max_wait:.0f} s")
        time.sleep(1.0)
