"""AGGREGATING -> PUBLISHED: merge a round's stored deltas with DeltaSoup and publish the next base.

Deltas are read tensor by tensor from memory-mapped payloads (server memory grows with one tensor times
the number of contributors), the aggregate is added to the base weights (their float32 master) as each
tensor is aggregated, and the new Hugging Face directory, with a lineage manifest, streams into the blob
store as the next checkpoint (checkpoint_writer.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
from contextlib import ExitStack
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone

import torch
from cryptography.hazmat.primitives import serialization
from sqlmodel import func, select

from zoo_gym import codec
from zoo_gym.aggregation import DeltaSoup, NotRobustConfigError, PrivacyAccountant, PrivacyBudgetExceeded
from zoo_gym.server.rounds import async_rounds
from zoo_gym.server.store import master_weights
from zoo_gym.server.store.checkpoint_writer import CheckpointWriter, SafetensorsReader, master_path, threads_beside_writers
from zoo_gym.server.config import ServerConfig
from zoo_gym.server.rounds.evaluation import evaluator_for, forget
from zoo_gym.server.rounds.faults import crash_point
from zoo_gym.gym_train.memory import release_memory
from zoo_gym.server.store.models import Checkpoint, Contributor, Round, RoundInputs, RoundState, Submission
from zoo_gym.server.rounds.settlement import (aggregation_weights, current_reputations, plan_rewards, record_settlement,
                                      scoring_tap)
from zoo_gym.server.rounds.signed_state import sign_lineage
from zoo_gym.server.store.state import ServerState

log = logging.getLogger("zoo_gym.server")


class StoredDeltas:
    """DeltaSource over a round's stored payloads (zoo_gym.aggregation.DeltaSource).

    DeltaSoup reads every tensor in more than one pass (validate, distances, aggregate). Decoded rows are
    kept in a cache bounded by `cache_bytes`, so small models are decoded once while a model larger
    than the budget still streams one tensor x n at a time. LoRA-coded tensors are validated from their
    factors (`sq_norms`), so a mean decodes each of them once.
    """

    def __init__(self, payloads: list, contributors: list[str], shapes: dict[str, tuple[int, ...]], *,
                 cache_bytes: int = 512 << 20) -> None:
        self.contributors = contributors
        self._cache: dict[str, torch.Tensor] = {}
        self._cache_left = cache_bytes
        self._vouched: dict[str, torch.Tensor] = {}  # sq_norms of tensors sent as safe float32 LoRA factors
        self._payloads = payloads
        self._shapes = shapes  # the base's tensors, in its file order
        self._manifests = [codec.read_manifest(p) for p in payloads]  # parsed once, passed to every decode
        self._entries = [{e.name: e for e in m.entries} for m in self._manifests]
        names = set().union(*(set(e) for e in self._entries)) if self._entries else set()
        self._names = [n for n in shapes if n in names]  # base order: deterministic

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shapes[name])

    def stacked(self, name: str) -> torch.Tensor:
        if name in self._cache:
            return self._cache[name]
        shape = tuple(self._shapes[name])
        out = torch.empty((len(self._payloads), math.prod(shape)))  # (n, numel), each row decoded in place
        for row, payload, entries, manifest in zip(out, self._payloads, self._entries, self._manifests):
            e = entries.get(name)
            if e is None:  # this contributor did not change the tensor (e.g. LoRA leaves norms alone)
                row.zero_()
            elif e.codec == "lora" and e.dtype == "float32" and tuple(e.shape) == shape:
                codec.decode_factors(payload, name, manifest=manifest).merged(out=row.view(shape))  # one matmul
            else:
                row.copy_(codec.decode_tensor(payload, name, manifest=manifest).reshape(-1))
        if out.nbytes <= self._cache_left:
            self._cache[name] = out
            self._cache_left -= out.nbytes
        return out

    def sq_norms(self, name: str) -> tuple[torch.Tensor, int] | None:
        """((n,) float64 squared L2 norms of the rows `stacked(name)` returns, numel) from LoRA factors
        alone (r x r Gram matrices, `LoraFactors.merged_sq_norm`): DeltaSoup's validation needs no decode.
        None unless every contributor that sent the tensor sent float32 LoRA factors the norm is safe
        from (then DeltaSoup decodes). A cached tensor is not decoded again either way; norms already
        taken are returned again without recomputing them."""
        if name in self._vouched:
            return self._vouched[name], math.prod(self._shapes[name])
        if name in self._cache:
            return None
        out = torch.zeros(len(self._payloads), dtype=torch.float64)  # (n,)
        for i, (payload, entries, manifest) in enumerate(zip(self._payloads, self._entries, self._manifests)):
            e = entries.get(name)
            if e is None:
                continue  # did not change the tensor: a zero row
            if e.codec != "lora" or e.dtype != "float32":
                return None
            sq = codec.decode_factors(payload, name, manifest=manifest).merged_sq_norm()
            if sq is None:
                return None
            out[i] = sq
        self._vouched[name] = out
        return out, math.prod(self._shapes[name])

    def factors(self, name: str) -> list | None:
        """Each contributor's LoraFactors of `name` (None: it did not send the tensor), for a tensor whose
        norms `sq_norms` vouched for (finite, no overflow, no cancellation); else None (rows are decoded)."""
        if name not in self._vouched:
            return None
        shape = tuple(self._shapes[name])
        out = []
        for payload, entries, manifest in zip(self._payloads, self._entries, self._manifests):
            e = entries.get(name)
            if e is not None and tuple(e.shape) != shape:
                return None
            out.append(None if e is None else codec.decode_factors(payload, name, manifest=manifest))
        return out

    def stacked_one(self, i: int, name: str) -> torch.Tensor:
        """Contributor i's delta for one tensor, in the base's shape (zeros when it did not send it)."""
        if name in self._entries[i]:
            return codec.decode_tensor(self._payloads[i], name, manifest=self._manifests[i]).reshape(
                self._shapes[name]).float()
        return torch.zeros(self._shapes[name])

    def packed(self, name: str):
        if not all(name in e and e[name].codec == "bitdelta" for e in self._entries):
            return None
        return [codec.read_bitdelta(p, name, manifest=m) for p, m in zip(self._payloads, self._manifests)]


def _jsonable(obj):
    if is_dataclass(obj):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, float) and obj != obj:
        return None  # NaN is not JSON
    return obj


def round_generator(state: ServerState, base_sha256: str) -> torch.Generator:
    """The round's randomness (DP noise, adaptive clipping's noised count), seeded with 64 bits of
    HMAC-SHA256(server's private key, base sha256): a redo after a crash draws the same noise, and nobody
    without the server's key can reproduce the noise and subtract it from the published weights (seeded
    from the public base sha256 alone, as before, it gave no privacy at all)."""
    secret = state.key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                     serialization.NoEncryption())
    digest = hmac.new(secret, b"zoo-gym/round-noise/v1\n" + base_sha256.encode(), hashlib.sha256).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big"))


def record_round_inputs(state: ServerState, config: ServerConfig, round_id: int, contributors: list[str],
                        session) -> RoundInputs:
    """Copy what the round's outcome depends on (reputations, clip norm) into its row, with the population
    (registered contributors, for the record: privacy is accounted with q = 1, not from it).

    Called in the transaction that closes the round; the caller commits."""
    population = int(session.exec(select(func.count()).select_from(Contributor)).one())
    reps = current_reputations(state, config, contributors, session=session)
    inputs = RoundInputs(round_id=round_id, reputations_json=json.dumps(reps, sort_keys=True),
                         dp_clip=_last_dp_clip(session, round_id), population=max(population, 1))
    if config.mode == "async":  # each delta's staleness and weight, as the buffer closed (async_rounds.py)
        inputs.staleness_json = async_rounds.record_staleness(session, round_id, config)
    session.add(inputs)
    return inputs


def _round_inputs(state: ServerState, config: ServerConfig, rnd: Round, contributors: list[str]) -> RoundInputs:
    with state.write_lock, state.session() as s:
        inputs = s.get(RoundInputs, rnd.id)
        if inputs is None:  # closed by a version that did not record them: record them now, once
            inputs = record_round_inputs(state, config, rnd.id, contributors, s)
            s.commit()
        return inputs


def _reopen(state: ServerState, round_id: int, needs: int, message: str) -> None:
    with state.write_lock, state.session() as s:
        r = s.get(Round, round_id)
        r.state, r.needs, r.message = RoundState.OPEN, needs, message
        s.add(r)
        inputs = s.get(RoundInputs, round_id)
        if inputs is not None:  # recorded again when the round next closes
            s.delete(inputs)
        s.commit()


def publish_round(state: ServerState, config: ServerConfig, rnd: Round, subs: list[Submission]) -> str:
    """Aggregate `subs` onto the round's base, publish, open the next round. Returns a one-line outcome.

    A pure function of what is stored: the submissions, the inputs recorded at close, the rounds
    published before and the base's float32 master. Nothing is written until the checkpoint blob
    (content-addressed, so a redo writes the same one; the master blob likewise) and then one
    transaction: ledger entries, reputations, checkpoint row, round report, next round. A crash
    anywhere before that commit is redone from the start with the same result.

    Memory: one tensor x contributors for the aggregation (the new weights stream to disk as they are
    aggregated, zoo_gym/server/store/checkpoint_writer.py), plus, with scoring, the evaluator's model and
    its gradient; the gradient is dropped once the slopes are taken and the model before the new
    checkpoint is loaded for its held-out loss.
    """
    soup_config = config.soup
    log.info("round %d phase=load", rnd.id)
    base_archive = state.blobs.path(rnd.base_sha256)  # read in place: no unpacked copy is needed
    with SafetensorsReader.in_archive(base_archive) as r:
        shapes = r.shapes()
        keep_master = master_weights.needs_master(r.infos)
    contributors = [s.contributor_id for s in subs]
    inputs = _round_inputs(state, config, rnd, contributors)
    reputations = json.loads(inputs.reputations_json)
    staleness = async_rounds.parse(inputs.staleness_json)  # None: a synchronous round
    soup_config = async_rounds.flush_soup(soup_config, staleness)  # async Multi-Krum: m as recorded
    with state.session() as s:
        # Every round is accounted with q = 1: contributors choose to submit and the server samples nobody,
        # so amplification by subsampling does not apply (aggregation/privacy.py). Rounds that an older
        # version recorded with q = m / registered contributors (which free registrations shrank) count at q = 1.
        history = [(r.dp_noise_multiplier, 1.0, 1) for r in s.exec(
            select(Round).where(Round.dp_noise_multiplier.is_not(None), Round.state == RoundState.PUBLISHED,
                                Round.id < rnd.id).order_by(Round.id))]
        parent = s.get(Checkpoint, rnd.base_sha256)
        parent_measured = parent is None or parent.heldout_loss is not None
        ancestors = _ancestors(s, parent)
    accountant = PrivacyAccountant(history)
    master_file = master_path(state, rnd.base_sha256)

    with ExitStack() as stack:
        payloads = []
        for sub in subs:
            payloads.append(stack.enter_context(state.blobs.mapped(sub.payload_sha256)))
        evaluator = evaluator_for(state, config, rnd.base_sha256)
        stack.callback(_forget_if_released, evaluator)
        log.info("round %d phase=scoring-gradient", rnd.id)
        stored = StoredDeltas(payloads, contributors, shapes)
        source = scoring_tap(config, stored, evaluator)
        weights = aggregation_weights(config, contributors, reputations)
        gen = round_generator(state, rnd.base_sha256)
        ckpt_blob = stack.enter_context(state.blobs.writer(streamed=True))
        master_blob = stack.enter_context(state.blobs.writer(streamed=True)) if keep_master else None
        master = (stack.enter_context(SafetensorsReader(master_file, streamed=True))
                  if master_file is not None else None)
        writer = CheckpointWriter(base_archive, master=master, changed=stored.names(), ckpt_blob=ckpt_blob,
                                  master_blob=master_blob)
        stack.callback(writer.close)
        log.info("round %d phase=aggregation", rnd.id)
        try:
            # async: w(s) as aggregation weights or on the rows, as recorded; server_lr x step_scale x out
            rows, row_weights = async_rounds.apply_staleness(source, contributors, staleness, weights)
            with threads_beside_writers():  # the writer's two threads stream while the soup computes
                report = DeltaSoup(soup_config, dp_clip=inputs.dp_clip).run(
                    rows, async_rounds.server_lr_sink(writer.sink, staleness), weights=row_weights, generator=gen,
                    accountant=accountant)  # q = 1, as above
        except NotRobustConfigError as exc:
            _reopen(state, rnd.id, len(subs) + 1, f"waiting for more submissions: {exc}")
            return f"REOPENED ({exc})"
        except PrivacyBudgetExceeded as exc:
            with state.write_lock, state.session() as s:
                r = s.get(Round, rnd.id)
                r.state = RoundState.HALTED
                r.message = f"halted: {exc}"
                s.add(r)
                s.commit()
            return f"HALTED ({exc})"
        crash_point("aggregated")
        log.info("round %d phase=scoring", rnd.id)
        if evaluator is not None:
            evaluator.release_gradient()  # the slopes are taken: keep its loss and norm, free the tensors
        plan, rewards_summary = plan_rewards(state, config, rnd, source, report, evaluator, reputations=reputations)
        if staleness is not None and plan is not None:  # a stale delta is paid less (async_rounds.py)
            plan = async_rounds.discount_payouts(plan, staleness, pool=plan.pool)
            rewards_summary["payouts"] = [asdict(p) for p in plan.payouts]
        crash_point("settled")

        report_json = json.dumps(_jsonable({"soup": report, "rewards": rewards_summary}), sort_keys=True)
        privacy = getattr(report, "privacy", None)
        parent_loss = None
        if evaluator is not None and not parent_measured:
            log.info("round %d phase=parent-evaluation", rnd.id)
            parent_loss = evaluator.loss(None)  # genesis: measured once, on the same set
        accepted = _accepted(report, len(contributors))
        lineage = {
            "round": rnd.id,
            "base_model": state.base_model,
            "parent_sha256": rnd.base_sha256,
            "contributors": contributors,
            "accepted": [c for c, ok in zip(contributors, accepted) if ok],
            "submissions": [{"contributor": sub.contributor_id, "method": _method(sub), "accepted": ok}
                            for sub, ok in zip(subs, accepted)],
            "aggregator": soup_config.aggregator,
            **({"async": staleness} if staleness is not None else {}),
            "privacy": _jsonable(privacy),
            # earlier rounds, genesis first, so a pulled checkpoint's model card shows the whole lineage
            "history": [*ancestors[:-1], {**ancestors[-1], "heldout_loss": parent_loss}] if parent_loss is not None
            else ancestors,
        }
        log.info("round %d phase=write", rnd.id)
        writer.finish_weights()
        if master_blob is not None:
            lineage["master_sha256"] = master_blob.commit()  # what the published weights lack of float32
            lineage["master_dtype"] = "float32"  # its precision (stored as low halves: master_weights.py)
        writer.finish(sign_lineage(lineage, key=state.key))  # the archive's manifest carries the server's signature
        log.info("round %d phase=pack", rnd.id)
        sha = ckpt_blob.commit()
        size = state.blobs.size(sha)
        heldout = None
        if evaluator is not None:
            log.info("round %d phase=evaluation", rnd.id)
            evaluator.release()  # one model in memory: this base's goes before the new one loads
            stored = source = None  # and the decoded rows they cached (up to 512 MB)
            release_memory()
            heldout = evaluator.loss_of_dir(state.checkpoint_dir(sha), checkpoint_sha256=sha)  # unpacked here
    crash_point("blob-written")
    log.info("round %d phase=commit", rnd.id)
    with state.write_lock, state.session() as s:
        record_settlement(state, config, plan, s)
        parent = s.get(Checkpoint, rnd.base_sha256)
        if parent is not None and parent.heldout_loss is None and parent_loss is not None:
            parent.heldout_loss = parent_loss
            s.add(parent)
        if s.get(Checkpoint, sha) is None:
            # The archive holds what defines the checkpoint, so the same inputs publish the same bytes;
            # the row adds when things happened and the loss measured on the written weights (the rows
            # themselves are the history).
            row_manifest = {k: v for k, v in lineage.items() if k != "history"}
            row_manifest.update(heldout_loss=heldout, opened_at=_iso(rnd.opened_at), closed_at=_iso(rnd.closed_at),
                                received_at={sub.contributor_id: _iso(sub.received_at) for sub in subs})
            s.add(Checkpoint(sha256=sha, round_id=rnd.id, parent_sha256=rnd.base_sha256, size=size,
                             heldout_loss=heldout, manifest_json=json.dumps(row_manifest, sort_keys=True)))
        r = s.get(Round, rnd.id)
        r.state = RoundState.PUBLISHED
        r.published_sha256 = sha
        r.aggregator = soup_config.aggregator
        r.report_json = report_json
        if privacy is not None:
            r.dp_epsilon_round = privacy.epsilon_round
            r.dp_epsilon_total = privacy.epsilon_total
            r.dp_noise_multiplier = privacy.noise_multiplier
            r.dp_sample_rate = privacy.q
        s.add(r)
        if s.get(Round, rnd.id + 1) is None:
            s.add(Round(id=rnd.id + 1, state=RoundState.OPEN, base_sha256=sha, aggregator=soup_config.aggregator))
        s.commit()
    crash_point("committed")
    log.info("round %d phase=done", rnd.id)
    loss = f", held-out loss {heldout:.4f}" if heldout is not None else ""
    return f"published {sha[:12]} from {len(contributors)} submissions{loss}"


def _forget_if_released(evaluator) -> None:
    if evaluator is not None and evaluator.released:
        forget(evaluator)  # a retry of this round rebuilds it


def _iso(when: datetime | None) -> str | None:
    """UTC ISO 8601; a naive time (as SQLite returns it) is UTC. The same text on a redo as first time."""
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).isoformat()


def _method(sub: Submission) -> str | None:
    """The training method the contributor reported (lora, sft, grpo), if any."""
    try:
        method = json.loads(sub.metadata_json or "{}").get("method")
    except (ValueError, AttributeError):
        return None
    return method if isinstance(method, str) and len(method) <= 32 else None


def _ancestors(session, parent: Checkpoint | None) -> list[dict]:
    """The manifests (with sha256 and held-out loss) of `parent` and its ancestors, genesis first."""
    chain = []
    node = parent
    while node is not None:
        manifest = json.loads(node.manifest_json or "{}")
        for when in ("opened_at", "closed_at", "received_at"):  # times stay in the rows, never in an archive
            manifest.pop(when, None)
        chain.append({**manifest, "sha256": node.sha256, "heldout_loss": node.heldout_loss})
        node = session.get(Checkpoint, node.parent_sha256) if node.parent_sha256 else None
    return chain[::-1]


def _accepted(report, n: int) -> list[bool]:
    return [bool(c.accepted) for c in report.contributors]


def _last_dp_clip(session, round_id: int) -> float | None:
    """The adaptive clip norm the last round published before `round_id` chose (None: the configured one)."""
    last = session.exec(select(Round).where(Round.state == RoundState.PUBLISHED, Round.id < round_id)
                        .order_by(Round.id.desc())).first()
    if last is None:
        return None
    return json.loads(last.report_json).get("soup", {}).get("next_dp_clip")
