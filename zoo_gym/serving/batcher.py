"""The batching loop: requests for different variants are collected for a few ms and decoded together.

One worker thread owns the model. It waits for a first request, keeps collecting for ``window_s``
(or until ``max_batch`` rows), decodes the whole batch in one forward per step with each row's own
variant, and hands every step's token to the request's asyncio queue. Requests arriving meanwhile
form the next batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
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
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("token", id) ... then ("done", reason) | ("error", msg)

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))


class Batcher:
    def __init__(self, model: MultiVariantModel, registry: VariantRegistry, *, eos_ids: set[int], pad_id: int,
                 window_s: float = 0.005, max_batch: int = 16) -> None:
        self.model, self.registry = model, registry
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.window_s, self.max_batch = window_s, max_batch
        self._q: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0  # batches decoded so far (the HTTP test reads it)
        self.largest_batch = 0

    def submit(self, job: Job) -> None:
        self._q.put(job)

    def start(self) -> None:
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
            if batch:
                self._decode(batch)

    def _decode(self, batch: list[Job]) -> None:
        jobs, variants = [], []
        for job in batch:
            try:
                variants.append(None if job.variant is None else self.registry.get(job.variant))
                jobs.append(job)
            except Exception as exc:  # noqa: BLE001 - removed or unloadable since the request was accepted
                job.emit("error", str(exc) or type(exc).__name__)
        if not jobs:
            return
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(jobs))
        seed = next((j.seed for j in jobs if j.seed is not None), None)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        produced = [0] * len(jobs)
        try:
            for step in self.model.generate(variants, [j.prompt for j in jobs],
                                            max_new_tokens=[j.max_tokens for j in jobs],
                                            temperature=[j.temperature for j in jobs],
                                            top_p=[j.top_p for j in jobs], eos_ids=self.eos_ids,
                                            pad_id=self.pad_id, generator=gen):
                for i, tok in enumerate(step):
                    if tok is None:
                        continue
                    produced[i] += 1
                    if tok in self.eos_ids:
                        jobs[i].emit("done", "stop")
                        continue
                    jobs[i].emit("token", tok)
                    if produced[i] >= jobs[i].max_tokens:
                        jobs[i].emit("done", "length")
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the server
            log.exception("decoding a batch of %d failed", len(jobs))
            for j in jobs:
                j.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
