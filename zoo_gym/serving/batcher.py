"""The batching loop: requests for different variants are collected for a few ms and decoded together.

One worker thread owns the model. It waits for a first request, keeps collecting for ``window_s``
(or until ``max_batch`` rows), decodes the whole batch in one forward per step with each row's own
variant, and hands every step's token to the request's asyncio queue. Requests arriving meanwhile
form the next batch. Each request samples with its own generator (its seed's), so its text does not
depend on the batch. A request the worker cannot prepare fails alone; when a batch's decode fails, the
requests that got no token yet are retried one by one, so one bad request fails only itself. The
thread survives any error; ``alive`` says whether it runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zoo_gym.serving.model import MultiVariantModel
from zoo_gym.serving.registry import VariantRegistry

log = logging.getLogger("zoo_gym.serving")


@dataclass
class Job:
    prompt: list[int]
    variant: str | None  # None: the base alone
    max_tokens: int
    temperature: float
    loop: asyncio.AbstractEventLoop
    seed: int | None = None
    top_p: float = 1.0
    logprobs: int | None = None  # k: each token comes with its log-prob and the k most likely (model.generate)
    # ("token", (id, log-probs or None)) ... then ("done", reason) | ("error", (http status, message))
    out: asyncio.Queue = field(default_factory=asyncio.Queue)

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))


class Batcher:
    def __init__(self, model: MultiVariantModel, registry: VariantRegistry, *, eos_ids: set[int], pad_id: int,
                 window_s: float = 0.005, max_batch: int = 16,
                 on_batch: Callable[[int], None] = lambda rows: None) -> None:
        self.model, self.registry = model, registry
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.window_s, self.max_batch = window_s, max_batch
        self._q: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0  # batches decoded so far (the HTTP test reads it)
        self.largest_batch = 0
        self.on_batch = on_batch  # called with the rows of each decoded batch (metrics)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self._q.put(job)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gym-serve-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _collect(self) -> list[Job]:
        try:
            batch = [self._q.get(timeout=0.1)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self._q.get(timeout=left))
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._collect()
            try:
                if batch:
                    self._decode(batch)
            except Exception as exc:  # noqa: BLE001 - the worker outlives any one batch
                log.exception("the batch of %d failed", len(batch))
                for j in batch:
                    j.emit("error", (500, f"generation failed: {type(exc).__name__}"))

    def _prepare(self, batch: list[Job]) -> tuple[list[Job], list, list]:
        """The jobs that can run, their variants and generators; the others are answered with an error."""
        jobs, variants, gens = [], [], []
        for job in batch:
            try:
                variant = None if job.variant is None else self.registry.get(job.variant)
                gen = torch.Generator().manual_seed(job.seed) if job.seed is not None else None
            except LookupError:  # removed since the request was accepted
                job.emit("error", (404, f"The model '{job.variant}' does not exist"))
                continue
            except Exception as exc:  # noqa: BLE001 - unloadable since accepted, or a seed torch refuses
                job.emit("error", (400, str(exc) or type(exc).__name__))
                continue
            jobs.append(job)
            variants.append(variant)
            gens.append(gen)
        return jobs, variants, gens

    def _decode(self, batch: list[Job]) -> None:
        jobs, variants, gens = self._prepare(batch)
        if not jobs:
            return
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(jobs))
        self.on_batch(len(jobs))
        produced = [0] * len(jobs)
        try:
            self._steps(jobs, variants, gens, produced)
        except Exception as exc:  # noqa: BLE001 - one bad request must not fail the others
            log.exception("decoding a batch of %d failed", len(jobs))
            retry = [i for i, n in enumerate(produced) if n == 0] if len(jobs) > 1 else []
            for i, j in enumerate(jobs):
                if i not in retry:
                    j.emit("error", (500, f"generation failed: {type(exc).__name__}: {exc}"))
            for i in retry:
                self._decode([jobs[i]])

    def _steps(self, jobs: list[Job], variants: list, gens: list, produced: list[int]) -> None:
        for step in self.model.generate(variants, [j.prompt for j in jobs],
                                        max_new_tokens=[j.max_tokens for j in jobs],
                                        temperature=[j.temperature for j in jobs],
                                        top_p=[j.top_p for j in jobs], eos_ids=self.eos_ids,
                                        pad_id=self.pad_id, generators=gens,
                                        logprobs=[j.logprobs for j in jobs]):
            tokens, logprobs = step
            for i, tok in enumerate(tokens):
                if tok is None:
                    continue
                produced[i] += 1
                if tok in self.eos_ids:
                    jobs[i].emit("done", "stop")
                    continue
                jobs[i].emit("token", (tok, logprobs[i]))
                if produced[i] >= jobs[i].max_tokens:
                    jobs[i].emit("done", "length")
