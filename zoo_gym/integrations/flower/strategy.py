"""`DeltaSoupStrategy`: the DeltaSoup pipeline as a Flower (>= 1.20 message API) strategy.

Flower clients send back full model arrays; the strategy turns each reply into a delta against
the arrays it sent out, runs `DeltaSoup` (validate -> clip -> robust aggregate -> DP noise) and
publishes `global + aggregate`. Weights are never taken from the clients' `num-examples`
(kept only for metric averaging). It and `apps` beside it are the only modules of zoo_gym that
import flwr (the `flower` extra). Use it in a ServerApp: `DeltaSoupStrategy(SoupConfig(...)).start(grid=..., ...)`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import FedAvg
except ModuleNotFoundError as exc:
    if exc.name != "flwr":  # flwr is there but broken: keep its own error
        raise
    raise ImportError(f"{__name__} needs Flower: pip install 'zoo-gym[flower]'",
                      name="flwr") from None

from zoo_gym.aggregation.config import SoupConfig
from zoo_gym.aggregation.errors import AggregationError, PrivacyBudgetExceeded
from zoo_gym.aggregation.privacy import PrivacyAccountant
from zoo_gym.aggregation.soup import DeltaSoup, SoupReport
from zoo_gym.aggregation.sources import DictDeltaSource


class DeltaSoupStrategy(FedAvg):
    """FedAvg's sampling and messaging with DeltaSoup's aggregation.

    `reports` keeps one `SoupReport` per round; `accountant` accumulates DP rounds; `population`
    is the number of registered nodes for q (default: nodes connected at round start); `sample_rate`
    (set by subclasses that sample nodes at random) is accounted as q instead of m / population.
    """

    sample_rate: float | None = None

    def __init__(self, config: SoupConfig, *, generator: torch.Generator | None = None,
                 accountant: PrivacyAccountant | None = None, population: int | None = None,
                 reference_fn=None, server_lr: float = 1.0, **fedavg_kwargs) -> None:
        super().__init__(**fedavg_kwargs)
        self.soup = DeltaSoup(config)
        # (current arrays: name -> ndarray) -> the operator's reference direction, for trust-mean
        self.reference_fn = reference_fn
        if not 0 < server_lr < float("inf"):
            raise ValueError(f"`server_lr` must be a finite number > 0, got {server_lr}")
        self.server_lr = server_lr  # global += server_lr x aggregate: post-processing of the release, free in ε
        self.generator = generator
        self.accountant = accountant if accountant is not None else PrivacyAccountant()
        self.population = population
        self.reports: list[SoupReport] = []
        self.stopped: str | None = None  # reason publishing stopped (privacy budget)
        self.refused_rounds: dict[int, str] = {}  # round -> why nothing was published
        self._current: dict[str, np.ndarray] | None = None
        self._seen_nodes = 0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.stopped is not None:
            return []
        self._current = {k: np.array(v.numpy(), copy=True) for k, v in arrays.items()}
        self._seen_nodes = len(list(grid.get_node_ids()))
        return super().configure_train(server_round, arrays, config, grid)

    def reply_delta(self, msg: Message, base: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """One reply's delta (name -> flat float32 tensor): its full arrays minus `base` (override
        for replies that carry the delta itself, e.g. `apps`' BitDelta payloads)."""
        record = next(iter(msg.content.array_records.values()))
        return {k: torch.from_numpy(np.asarray(v.numpy(), dtype=np.float32)
                                    - base[k].astype(np.float32)).reshape(-1) for k, v in record.items()}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid or self._current is None:
            return None, None
        base = self._current
        ids = [str(msg.metadata.src_node_id) for msg in valid]
        source = DictDeltaSource(ids, [self.reply_delta(msg, base) for msg in valid])
        out: dict[str, torch.Tensor] = {}
        try:
            reference = self.reference_fn(base) if self.reference_fn is not None else None
            report = self.soup.run(source, lambda name, t: out.__setitem__(name, t),
                                   generator=self.generator, accountant=self.accountant,
                                   population=self.population or self._seen_nodes, sample_rate=self.sample_rate,
                                   reference=reference)
        except PrivacyBudgetExceeded as exc:
            self.stopped = str(exc)
            return None, None
        except AggregationError as exc:  # e.g. too few valid contributions: keep the model
            self.refused_rounds[server_round] = str(exc)
            return None, MetricRecord({"soup-refused-round": 1})
        self.reports.append(report)
        step = {k: self.server_lr * out[k].numpy().reshape(base[k].shape) for k in out}
        new = ArrayRecord({k: Array((base[k].astype(np.float32) + step[k]).astype(base[k].dtype)) if k in step
                           else Array(base[k]) for k in base})  # tensors no delta names (e.g. LoRA's untouched ones) stay
        metrics = MetricRecord({"soup-accepted": report.n_accepted,
                                "soup-refused": len(report.contributors) - report.n_accepted,
                                "soup-noise-std": float(report.noise_std)})
        return new, metrics
