"""`gym-client join`: register, pin the server's key, then contribute (contribute.py) round after round.

In synchronous mode each round is: wait until a round is open for us, contribute once, wait for its publish.
A server in async mode is handed to join_async.py. Settings and data are checked (prepare) before the
network is touched; a contributor that cannot go on gets JoinError, one line.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from zoo_gym.client.connection import Servers, ServerUnreachable, addresses, spread, with_retries
from zoo_gym.client.contribute import (Contributor, JoinError, RoundTrainer, SubmitResult, contribute, not_selected,
                                      refused, say_payouts)
from zoo_gym.client.upload import register_request
from zoo_gym.gym_train.distill import DEFAULT_DISTILL_STEPS
from zoo_gym.proto import gym_pb2, signing

if TYPE_CHECKING:
    from zoo_gym.gym_train import TrainConfig

DEFAULT_SHARDS = 64  # built-in data is split into this many disjoint shards; a key picks one


@dataclass
class JoinOptions:
    server: str  # HOST:PORT, or several addresses of one federation separated by commas (connection.Servers)
    workdir: Path
    key_path: Path
    rounds: int = 1
    data: str = "builtin"
    task: str | None = None  # built-in task family for data "builtin" (None: the stage's, tasks.builtin_task)
    method: str | None = None  # deprecated: stage and finetuning_type in train_overrides
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
    distill_steps: int = DEFAULT_DISTILL_STEPS  # each kept variant's scale distillation steps; 0 = off


def _held_count(n: int) -> int:
    return max(2, min(64, n // 10))


def prepare(opts: JoinOptions) -> tuple[TrainConfig, list[dict] | None]:
    """(the round's TrainConfig, the user's examples or None for built-in data), checked before anything
    touches the network: a bad data file, setting or combination fails here (ValueError, or JoinError)."""
    from zoo_gym import gym_train
    from zoo_gym.client.train_settings import check_round
    from zoo_gym.gym_train.hardware import check_cuda_options

    settings = {**({"method": opts.method} if opts.method else {}),
                **({"max_steps": opts.max_steps} if opts.max_steps else {}), **opts.train_overrides}
    config = gym_train.TrainConfig(**settings)
    try:  # CUDA-only options (Liger, Unsloth, LoftQ) fail here, before any download
        check_cuda_options(config)
    except gym_train.HardwareError as exc:
        raise JoinError(str(exc)) from exc
    examples = None
    if opts.data == "builtin":
        n = min(opts.n_examples, config.max_samples or opts.n_examples)
        _check_task(opts, config.stage, n)
    else:
        if opts.task is not None:
            raise JoinError("--task picks built-in data; it does not apply with --data FILE")
        examples = gym_train.load_examples(opts.data, allow_text=True)[:config.max_samples]  # None: all
        n = len(examples)
        if any("text" in ex for ex in examples) and (config.stage != "sft" or config.dp_enabled):
            raise JoinError(f"{opts.data}: plain `text` records train only with --stage sft without DP-SGD "
                            "(preference and RL stages need prompts with answers)")
        try:
            gym_train.check_stage_data(config.stage, examples, source=str(opts.data))
        except ValueError as exc:  # e.g. --stage dpo on answers without pairs
            raise JoinError(str(exc)) from None
        if n < 4:
            raise JoinError(f"{opts.data} ({n} examples): at least 4 examples are needed "
                            "(some are held out to measure the round)")
    from zoo_gym.gym_train.reward_model import RewardModelError, check_reward_model
    from zoo_gym.gym_train.rewards_loader import RewardFuncError, check_reward_funcs

    try:  # a contributor's own rewards load (and functions answer a sample) before any server is contacted
        check_reward_funcs(config, examples)
        if config.reward_model is not None:
            check_reward_model(config.reward_model)
    except (RewardFuncError, RewardModelError) as exc:
        raise JoinError(str(exc)) from None
    return check_round(config, n_train=n - _held_count(n)), examples


def _check_task(opts: JoinOptions, stage: str, n: int) -> None:
    """A --task fits the stage and has ``n`` distinct prompts in a shard (shard 0 stands for all: they are
    near equal), so a misfit fails before the network rather than after the first download."""
    if opts.task is None:
        return
    from zoo_gym.gym_train.tasks import builtin_examples, check_task_stage

    try:
        check_task_stage(opts.task, stage)
        builtin_examples(opts.task, shard=0, n_shards=opts.n_shards, n=n)
    except ValueError as exc:
        raise JoinError(f"--task: {exc}") from None


def _data_format(path: str) -> str:
    """The record format of a data file's first record, as load_examples reads it."""
    from zoo_gym.gym_train.sources import iter_records

    record = next(iter(iter_records(path)), (None, {}))[1]
    keys = {k for k, v in record.items() if v is not None} if isinstance(record, dict) else set()
    for names, label in (({"chosen", "rejected"}, "preference pairs"), ({"conversations"}, "sharegpt"),
                         ({"messages"}, "messages"), ({"prompt", "completion"}, "prompt/completion"),
                         ({"instruction", "output"}, "alpaca"), ({"text"}, "text")):
        if keys & names:
            return label
    return "unknown"


def dry_run(opts: JoinOptions) -> dict:
    """What `join` would train, without the network: the round's settings after every check (``prepare``),
    and the data's path, format and example counts (built-in data: the shard is picked from the key later)."""
    config, examples = prepare(opts)
    n = len(examples) if examples is not None else min(opts.n_examples, config.max_samples or opts.n_examples)
    data = {"path": opts.data, "format": "builtin" if examples is None else _data_format(opts.data),
            "examples": n, "train_examples": n - _held_count(n), "held_out_examples": _held_count(n)}
    return {"training": dataclasses.asdict(config), "data": data}


def _examples(opts: JoinOptions, config: TrainConfig, contributor_id: str, user_examples: list[dict] | None = None
              ) -> tuple[list[dict], list[dict], str]:
    """(train, local held-out, description) for this contributor."""
    from zoo_gym import gym_train

    if user_examples is not None:
        examples = user_examples
        desc = f"{opts.data} ({len(examples)} examples)"
    elif opts.data == "builtin":
        shard = opts.shard if opts.shard is not None else int(contributor_id[:8], 16) % opts.n_shards
        task = opts.task or gym_train.builtin_task(config.stage)
        examples = gym_train.builtin_examples(task, shard=shard, n_shards=opts.n_shards,
                                              n=min(opts.n_examples, config.max_samples or opts.n_examples))
        desc = f"built-in {task} shard {shard}/{opts.n_shards}"
    else:
        examples = gym_train.load_examples(Path(opts.data), allow_text=True)[:config.max_samples]
        desc = f"{opts.data} ({len(examples)} examples)"
    if len(examples) < 4:
        raise JoinError(f"{desc}: at least 4 examples are needed (some are held out to measure the round)")
    n_held = _held_count(len(examples))
    return examples[n_held:], examples[:n_held], desc


def join(opts: JoinOptions, *, say: Callable[[str], None] = print) -> list[dict]:
    """Run `opts.rounds` rounds; return one summary dict per submitted round."""
    config, user_examples = prepare(opts)
    channel, c = _connect(opts, config, user_examples, say)
    from zoo_gym.client import join_async

    try:
        if join_async.is_async(c.round_info(signed=False)):  # buffered rounds, no round boundaries (join_async.py)
            try:
                summaries = join_async.train_continuously(c, opts)
            except join_async.AsyncStop as exc:
                raise JoinError(str(exc)) from None
        else:
            summaries = _rounds(c, opts)
    except BaseException:
        c.trainer.discard_variants()
        raise
    finally:
        channel.close()
    c.trainer.distil_variants()  # --keep-variant: after the last round, never between rounds
    return summaries


def _connect(opts: JoinOptions, config, user_examples: list[dict] | None,
             say: Callable[[str], None]) -> tuple[Servers, Contributor]:
    """Register (creating the key on first use), pin the server's key, pick the data: what every round uses.
    Several addresses: the key picks the first one (connection.spread), the others take over when it fails."""
    from zoo_gym import gym_train

    key, created = signing.load_or_create_key(opts.key_path)
    if created:
        say(f"created a new contributor key at {opts.key_path}")
    listed = addresses(opts.server)
    stub = Servers(listed, start=spread(signing.public_bytes(key), len(listed)),
                   root_certificates=opts.root_certificates, insecure=opts.insecure, say=say)
    try:
        reg = with_retries(lambda: stub.Register(register_request(key, opts.display_name or "contributor",
                                                                  invite=opts.invite), timeout=30),
                           what=f"register at {stub.address}", say=say, max_wait=opts.connect_timeout)
    except grpc.RpcError as exc:
        stub.close()
        raise JoinError(f"registration refused: {exc.details()}") from exc
    except BaseException:
        stub.close()
        raise
    cid = reg.contributor_id
    server_key = _pin(opts, listed, bytes(reg.server_public_key), say)
    say(f"contributor {cid} {'registered' if reg.created else 'already registered'} at {stub.address}")
    opts.workdir.mkdir(parents=True, exist_ok=True)
    train_ex, held_ex, desc = _examples(opts, config, cid, user_examples)
    say(f"training data: {desc}")
    feedback = None
    if opts.error_feedback and opts.codec not in ("fp16", "bf16", "fp32", "lora"):
        feedback = gym_train.ErrorFeedback(opts.workdir / f"error_feedback-{cid}.safetensors")
    trainer = RoundTrainer(opts, config, feedback, train_ex, held_ex, say)
    retry = lambda fn, what: with_retries(fn, what=what, say=say, max_wait=opts.max_wait,  # noqa: E731
                                          first_contact=False)  # it registered: a closed socket is an outage
    return stub, Contributor(stub, cid, key, retry, lambda info: _verified(info, server_key, opts), trainer, say,
                             server_key)


def _pin(opts: JoinOptions, listed: list[str], presented: bytes, say: Callable[[str], None]) -> bytes:
    """The server key, pinned for every listed address (trust on first use): one federation has one key, so an
    address pinned to another key is refused in one line, and what any address answers is checked against it."""
    from zoo_gym.client import known_servers
    from zoo_gym.client.rewards import legacy_pin_path

    known = known_servers.for_key(opts.key_path)
    try:
        for address in listed:
            known.trust(address, presented, say=say, legacy=legacy_pin_path(opts.key_path))
    except known_servers.UntrustedServer as exc:
        raise JoinError(str(exc)) from None
    return presented


@dataclass
class Rounds:
    """The synchronous cadence: one upload per round; a round that closed first is trained again on the next."""

    opts: JoinOptions

    def label(self, info: gym_pb2.RoundInfo) -> str:
        return f"round {info.round_id}"

    training = label

    def send(self, c: Contributor, info: gym_pb2.RoundInfo, payload: bytes, metadata: dict):
        try:
            return c.upload(info, payload, metadata, progress=self.opts.progress)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                c.say(f"round {info.round_id} closed before the upload finished ({exc.details()}); "
                      "training again on the next base")
                return None
            raise refused(exc) from exc

    def submitted(self, c: Contributor, r: SubmitResult) -> None:
        c.say(f"round {r.trained_on}: submitted {r.payload_bytes} bytes; local held-out loss "
              f"{r.metadata.get('loss_before'):.4f} -> {r.metadata.get('loss_after'):.4f}")


def _rounds(c: Contributor, opts: JoinOptions) -> list[dict]:
    """Synchronous rounds: wait for one open to us, contribute, wait for its publish and say what it paid (the
    summary's "payout"; None after the last round with --no-wait)."""
    summaries: list[dict] = []
    seq = 0  # the ledger is asked only for entries after the last one seen
    while len(summaries) < opts.rounds:
        info = _wait_for_open_round(c, opts)
        result = contribute(info, contributor=c, opts=opts, cadence=Rounds(opts))
        if result is None:
            continue
        summaries.append(result.summary(round=info.round_id, payout=None))
        if len(summaries) < opts.rounds or opts.wait_for_publish:
            if _wait_for_round_after(c, info.round_id, opts):
                seq = say_payouts(c, summaries, seq, settled_through=info.round_id)
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


def _wait_for_open_round(c: Contributor, opts: JoinOptions) -> gym_pb2.RoundInfo:
    deadline = time.monotonic() + opts.max_wait
    announced = None
    while True:
        info = c.round_info()  # signed: you_submitted is ours
        if info.state == gym_pb2.ROUND_STATE_HALTED:
            raise JoinError(f"the server halted: {info.message or 'no more rounds'}")
        if info.state == gym_pb2.ROUND_STATE_OPEN and not info.you_submitted and not not_selected(info):
            return info
        if announced != info.round_id:
            why = ("not selected (sample rate %g): waiting for the next round" % info.sample_rate
                   if info.state == gym_pb2.ROUND_STATE_OPEN and not_selected(info) else
                   "already submitted" if info.you_submitted else "aggregating")
            c.say(f"round {info.round_id} is not open for us yet ({why}); waiting")
            announced = info.round_id
        if time.monotonic() > deadline:
            raise ServerUnreachable(f"no open round within {opts.max_wait:.0f} s")
        time.sleep(1.0)


def _wait_for_round_after(c: Contributor, round_id: int, opts: JoinOptions) -> bool:
    """True once round `round_id` is published; False when the server halted first."""
    deadline = time.monotonic() + opts.max_wait
    while True:
        info = c.round_info(signed=False)
        if info.round_id > round_id or info.state == gym_pb2.ROUND_STATE_HALTED:
            if info.round_id > round_id:
                c.say(f"round {round_id} published; round {info.round_id} is open")
            return info.round_id > round_id
        if time.monotonic() > deadline:
            raise JoinError(f"round {round_id} was not published within {opts.max_wait:.0f} s")
        time.sleep(1.0)
