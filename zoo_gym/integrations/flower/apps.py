"""Flower apps: BitDelta + DeltaSoup + central DP for Flower deployments and its simulation engine.

`client_app()`: a `ClientApp` whose train handler writes the received global arrays as a model
directory, trains with `gym_train.train` (LoRA, merged dense delta) on its shard of the built-in task,
BitDelta-encodes the delta (`zoo_gym.codec`) and replies `{"delta": ArrayRecord({"payload": uint8})}`.
`SampledSoupStrategy`: samples each node with probability q per round (Poisson), decodes the payloads and
merges them with `DeltaSoupStrategy` (default trimmed mean; DP, the fixed-m mean only, when the config's z > 0;
accounted as `dp_participation` says).
`server_app(config, ...)`: a `ServerApp` running it from the tiny base. Settings travel in the train
`ConfigRecord` (`TRAIN_DEFAULTS`). Needs flwr (extra `flower`; simulation: extra `simulation`).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import hmac
import io
import os
import pathlib
import random
import shutil
import tempfile
import time
from collections.abc import Iterable

import numpy as np
import torch
try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ModuleNotFoundError as exc:
    if exc.name != "flwr":  # flwr is there but broken: keep its own error
        raise
    raise ImportError(f"{__name__} needs Flower: pip install 'zoo-gym[flower]'", name="flwr") from None

from zoo_gym.aggregation.config import SoupConfig
from zoo_gym.aggregation.privacy import accounted_step, secure_generator
from zoo_gym.codec import decode, encode

from .strategy import DeltaSoupStrategy

# train-config keys the client reads (the server may override any of them per run)
TRAIN_DEFAULTS = {"task": "default", "steps": 1, "batch-size": 4, "learning-rate": 1e-2, "seed": 0,
                  "byzantine-fraction": 0.0, "byzantine-boost": 4.0, "cache-dir": "", "data-shards": 100}


def tiny_arrays() -> ArrayRecord:
    """The built-in tiny base model's tensors (name -> float32 array) as the initial global model."""
    from safetensors.numpy import load_file

    from zoo_gym.gym_train import tiny_model_dir

    return ArrayRecord({k: Array(v) for k, v in load_file(str(tiny_model_dir() / "model.safetensors")).items()})


def _model_dir(arrays: ArrayRecord) -> tuple[pathlib.Path, str]:
    """A model directory (tiny model's config and tokenizer, these weights) and its weights' sha256,
    one per process and base: rewritten only when the base changes."""
    from safetensors.numpy import save_file

    from zoo_gym.gym_train import tiny_model_dir

    out = pathlib.Path(tempfile.gettempdir()) / f"zoo-gym-flower-{os.getpid()}"
    if not out.exists():
        shutil.copytree(tiny_model_dir(), out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: np.ascontiguousarray(v.numpy()) for k, v in arrays.items()}, str(out / "model.safetensors"))
    return out, hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def _settings(config: ConfigRecord) -> dict:
    return {k: config.get(k, v) for k, v in TRAIN_DEFAULTS.items()}


def local_payload(arrays: ArrayRecord, *, partition: int, partitions: int, server_round: int,
                  settings: dict) -> bytes:
    """The BitDelta payload one contributor sends: `gym_train.train` on its shard from `arrays`.

    Partition p owns data shard p mod `data-shards` (contributors sharing a shard draw their own
    examples from it: the draw is seeded by round and partition). Contributors with partition < byzantine-fraction x partitions send -boost x their delta (a boosted
    sign flip; BitDelta of -b x is the flipped signs with b x the scales, so it is formed from the honest
    payload). With `cache-dir`, the honest payload of identical inputs (base sha256, partition, round,
    training settings) is reused: training is deterministic, so it is the same bytes."""
    base_dir, sha = _model_dir(arrays)
    train_keys = ("task", "steps", "batch-size", "learning-rate", "seed", "data-shards")
    key = hashlib.sha256(repr((sha, partition, partitions, server_round,
                               [settings[k] for k in train_keys])).encode()).hexdigest()
    cached = pathlib.Path(settings["cache-dir"]) / f"{key}.bitdelta" if settings["cache-dir"] else None
    if cached is not None and cached.exists():
        payload = cached.read_bytes()
    else:
        payload = _honest_payload(base_dir, sha, partition=partition, partitions=partitions,
                                  server_round=server_round, settings=settings)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(payload)
            tmp.replace(cached)
    if partition < float(settings["byzantine-fraction"]) * partitions:
        boost = float(settings["byzantine-boost"])
        payload = encode({k: -boost * v for k, v in decode(payload).items()}, codec="bitdelta")
    return payload


def _honest_payload(base_dir: pathlib.Path, sha: str, *, partition: int, partitions: int, server_round: int,
                    settings: dict) -> bytes:
    from zoo_gym.gym_train import TrainConfig, builtin_examples, train
    from zoo_gym.evaluation.evaluate import dense_delta

    steps, batch = int(settings["steps"]), int(settings["batch-size"])
    shards = min(partitions, int(settings["data-shards"]))  # the tasks hold enough prompts for ~100 shards
    examples = builtin_examples(str(settings["task"]), shard=partition % shards, n_shards=shards, n=steps * batch,
                                seed=server_round if shards == partitions else server_round * partitions + partition)
    tc = TrainConfig(method="lora", max_steps=steps, batch_size=batch, learning_rate=float(settings["learning-rate"]),
                     warmup_steps=0, merged_delta=True, seed=int(settings["seed"]))
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer prints its log dicts
        result = train(base_dir, examples, tc, base_sha256=sha, eval_examples=[])
    return encode({k: dense_delta(v).float() for k, v in result.delta.items()}, codec="bitdelta")


def _train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    payload = local_payload(msg.content["arrays"], partition=int(context.node_config["partition-id"]),
                            partitions=int(context.node_config["num-partitions"]),
                            server_round=int(config.get("server-round", 0)), settings=_settings(config))
    content = RecordDict({"delta": ArrayRecord({"payload": Array(np.frombuffer(payload, dtype=np.uint8))}),
                          "metrics": MetricRecord({"num-examples": int(_settings(config)["batch-size"])})})
    _freeze_long_lived_objects()
    return Message(content=content, reply_to=msg)


def _freeze_long_lived_objects() -> None:
    """Once per process, after the first training: move the objects alive then (torch, transformers,
    ray, flwr: ~600k tracked) out of the cyclic collector's reach. Why: the HF Trainer ends every
    training with accelerate's `free_memory`, a full `gc.collect()` that walks them all, ~0.3 s of a
    0.8 s contributor round on the tiny model; a simulation process runs hundreds of rounds. Garbage
    created later is still collected; what is frozen was alive anyway."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


def client_app() -> ClientApp:
    """The contributor side (see the module docstring); one torch thread per process."""
    torch.set_num_threads(1)
    app = ClientApp()
    app.train()(_train)
    return app


class SampledSoupStrategy(DeltaSoupStrategy):
    """`DeltaSoupStrategy` over BitDelta replies, each node sampled with probability `sample_rate`.

    The sampling draws come from the OS's entropy (`random.SystemRandom`) unless the operator passes a secret
    `seed`: then the same cohorts come again for whoever holds it, and for nobody else (`seed_from_secret`).
    A public seed (a constant in a script) lets anyone recompute who was sampled and void the amplification
    the accountant assumes. `population`
    (default: the nodes connected) is N of q = m / N; the first round waits up to `wait_s` seconds
    for N nodes. Under DP every round the sampler ran is accounted as one sampled-Gaussian step (z, q),
    also one that sampled nobody or whose cohort the rule refused (it publishes nothing).
    """

    def __init__(self, config: SoupConfig, *, sample_rate: float, seed: bytes | None = None, wait_s: float = 120.0,
                 **kwargs) -> None:
        kwargs.setdefault("fraction_evaluate", 0.0)
        super().__init__(config, **kwargs)
        if not 0 < sample_rate <= 1:
            raise ValueError(f"`sample_rate` must be in (0, 1], got {sample_rate}")
        rng = random.SystemRandom() if seed is None else random.Random(seed_from_secret(seed, "sampling"))
        self.sample_rate, self._rng, self.wait_s = sample_rate, rng, wait_s
        self.cohorts: list[int] = []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.stopped is not None:
            return []
        self._current = {k: np.array(v.numpy(), copy=True) for k, v in arrays.items()}
        nodes = sorted(grid.get_node_ids())
        deadline = time.monotonic() + self.wait_s
        while len(nodes) < (self.population or 0) and time.monotonic() < deadline:
            time.sleep(0.2)
            nodes = sorted(grid.get_node_ids())
        self._seen_nodes = len(nodes)
        chosen = [n for n in nodes if self._rng.random() < self.sample_rate]
        self.cohorts.append(len(chosen))
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, chosen, MessageType.TRAIN)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        published = len(self.reports)
        out = super().aggregate_train(server_round, replies)
        config = self.soup.config
        if len(self.reports) == published and self.stopped is None and config.dp_enabled:
            z, q = accounted_step(config.dp_noise_multiplier, self.sample_rate, participation=config.dp_participation)
            target = config.dp_target_epsilon
            if target is not None and self.accountant.epsilon_if_step(
                    noise_multiplier=z, sample_rate=q, delta=config.dp_delta) > target:
                self.stopped = f"round {server_round}: accounting it would exceed dp_target_epsilon {target}"
            else:
                self.accountant.step(noise_multiplier=z, sample_rate=q)
        return out

    def reply_delta(self, msg: Message, base: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        payload = msg.content["delta"]["payload"].numpy().tobytes()
        return {k: v.float().reshape(-1) for k, v in decode(payload).items()}


def seed_from_secret(secret: bytes, purpose: str) -> int:
    """64 bits of HMAC-SHA256(secret, purpose): the sampling and the noise never share a stream."""
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("a seed for the Flower apps is an operator-held secret of at least 16 bytes "
                         "(os.urandom(32)); omit it to draw from the OS's entropy")
    return int.from_bytes(hmac.new(secret, b"zoo-gym/flower/" + purpose.encode(), hashlib.sha256).digest()[:8], "big")


def heldout_evaluate_fn(examples: list[dict], losses: list[float] | None = None):
    """An `evaluate_fn` for `Strategy.start`: mean completion loss of the global arrays on `examples`
    (the tiny base plus the arrays' difference to it); each loss is appended to `losses` when given."""
    from safetensors.torch import load_file

    from zoo_gym.gym_train import Evaluator, tiny_model_dir

    base = load_file(str(tiny_model_dir() / "model.safetensors"))
    evaluator = Evaluator(tiny_model_dir(), examples)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        delta = {k: torch.from_numpy(np.asarray(v.numpy(), dtype=np.float32)) - base[k] for k, v in arrays.items()}
        loss = evaluator.loss(delta)
        if losses is not None:
            losses.append(loss)
        return MetricRecord({"heldout-loss": loss})

    return evaluate


def descent_reference_fn(examples: list[dict]):
    """A `reference_fn` for trust-mean: minus the gradient of the completion loss on the operator's own `examples`
    (FLTrust's root set) at the current global arrays of the tiny base."""
    from safetensors.torch import load_file

    from zoo_gym.gym_train import Evaluator, tiny_model_dir
    from zoo_gym.evaluation.gradient import base_gradient

    base = load_file(str(tiny_model_dir() / "model.safetensors"))
    root = Evaluator(tiny_model_dir(), examples)

    def reference(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        delta = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)).reshape(base[k].shape) - base[k]
                 for k, v in arrays.items() if k in base}
        with root.applied(root.model, delta):
            grad = base_gradient(root.model, root._batches).grad  # noqa: SLF001
            return {k: -grad[k].detach().float().reshape(-1).clone() for k in delta if k in grad}

    return reference


def server_app(config: SoupConfig, *, sample_rate: float, num_rounds: int, train_config: dict | None = None,
               population: int | None = None, seed: bytes | None = None, evaluate_fn=None,
               results: list | None = None) -> ServerApp:
    """A `ServerApp` running `SampledSoupStrategy` for `num_rounds` from the tiny base; appends
    (strategy, final ArrayRecord) to `results` when given (simulation). Sampling and noise draw from the OS's
    entropy, or from the operator's secret `seed` (reproducible only for whoever holds it)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = SampledSoupStrategy(config, sample_rate=sample_rate, seed=seed, population=population,
                                       generator=secure_generator() if seed is None else
                                       torch.Generator().manual_seed(seed_from_secret(seed, "noise")))
        result = strategy.start(grid=grid, initial_arrays=tiny_arrays(), num_rounds=num_rounds,
                                train_config=ConfigRecord({**TRAIN_DEFAULTS, **(train_config or {})}),
                                evaluate_fn=evaluate_fn)
        if results is not None:
            results.append((strategy, result.arrays))

    return app
