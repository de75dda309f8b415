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
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, is_dataclass
from datetime import datetime, timezone

import torch
from cryptography.hazmat.primitives import serialization
from sqlmodel import func, select

from zoo_gym.aggregation import DeltaSoup, NotRobustConfigError, PrivacyAccountant, PrivacyBudgetExceeded, SoupConfig
from zoo_gym.server.rounds import async_rounds, sampling
from zoo_gym.server.store import master_weights
from zoo_gym.io.safetensors_reader import SafetensorsReader
from zoo_gym.server.store.checkpoint_writer import CheckpointWriter, master_path, threads_beside_writers
from zoo_gym.server.config import ServerConfig
from zoo_gym.evaluation.server_evaluator import ServerEvaluator
from zoo_gym.server.rounds.evaluation import Evaluators
from zoo_gym.server.rounds.policy import policy_for
from zoo_gym.server.rounds.privacy_history import published_history
from zoo_gym.server.rounds.faults import crash_point
from zoo_gym.server.rounds.identical import round_notes
from zoo_gym.evaluation.memory import release_memory
from zoo_gym.server.store.models import Checkpoint, Contributor, Round, RoundInputs, RoundState, Submission
from zoo_gym.server.store.retention import retire_checkpoints
from zoo_gym.server.rounds.settlement import (aggregation_weights, current_reputations, plan_rewards, record_settlement,
                                              reference_for, scoring_tap)
from zoo_gym.proto.model_card import public_base_name
from zoo_gym.server.rounds.signed_state import sign_lineage
from zoo_gym.server.store.state import ServerState
from zoo_gym.server.rounds.stored_deltas import StoredDeltas

log = logging.getLogger("zoo_gym.server")


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


def record_round_inputs(state: ServerState, config: ServerConfig, policy, round_id: int, contributors: list[str],
                        session) -> RoundInputs:
    """Copy what the round's outcome depends on (reputations, clip norm, the sample rate its draws gave each
    person) into its row, with the population (registered contributors, for the record: never a q).

    Called in the transaction that closes the round; the caller commits."""
    population = int(session.exec(select(func.count()).select_from(Contributor)).one())
    reps = current_reputations(state, config, contributors, session=session)
    inputs = RoundInputs(round_id=round_id, reputations_json=json.dumps(reps, sort_keys=True),
                         dp_clip=_last_dp_clip(session, round_id), population=max(population, 1),
                         sample_rate=_sample_rate(config, session.get(Round, round_id)) or 1.0,
                         server_lr=config.server_lr)
    inputs.staleness_json = policy.record(session, round_id)  # async: each delta's staleness and weight
    session.add(inputs)
    return inputs


def _round_inputs(state: ServerState, config: ServerConfig, policy, rnd: Round, contributors: list[str]) -> RoundInputs:
    with state.write_session() as s:
        inputs = s.get(RoundInputs, rnd.id)
        if inputs is None:  # closed by a version that did not record them: record them now, once
            inputs = record_round_inputs(state, config, policy, rnd.id, contributors, s)
            s.commit()
        return inputs


def _reopen(state: ServerState, round_id: int, needs: int, message: str) -> None:
    with state.write_session() as s:
        r = s.get(Round, round_id)
        r.state, r.needs, r.message = RoundState.OPEN, needs, message
        s.add(r)
        inputs = s.get(RoundInputs, round_id)
        if inputs is not None:  # recorded again when the round next closes
            s.delete(inputs)
        s.commit()


@dataclass
class RoundJob:
    """What `load` gathers for one round's publish: the inputs recorded at close and the history before it."""

    rnd: Round
    subs: list[Submission]
    contributors: list[str]
    inputs: RoundInputs
    reputations: dict[str, float]
    flush: async_rounds.SyncFlush | async_rounds.StalenessFlush
    soup: SoupConfig
    accountant: PrivacyAccountant
    shapes: dict[str, tuple[int, ...]]
    keep_master: bool
    parent_measured: bool
    ancestors: list[dict]
    notes: list[str] = field(default_factory=list)  # warnings about the round's contributions (identical.py)


@dataclass
class Streams:
    """The round's open inputs and outputs while it aggregates and writes (closed by the ExitStack)."""

    source: object
    evaluator: ServerEvaluator | None
    writer: CheckpointWriter
    ckpt_blob: object
    master_blob: object | None


@dataclass
class Written:
    """What `write` produced: the checkpoint blob and everything `commit` records with it."""

    sha: str
    size: int
    lineage: dict
    report_json: str
    privacy: object
    plan: object
    parent_loss: float | None
    heldout: float | None
    preference: dict | None = None  # with validation pairs: {"before": base's report, "after": the checkpoint's}


def publish_round(state: ServerState, config: ServerConfig, rnd: Round, subs: list[Submission], *,
                  policy=None, evaluators: Evaluators | None = None) -> str:
    """Aggregate `subs` onto the round's base, publish, open the next round. Returns a one-line outcome.

    A pure function of what is stored: the submissions, the inputs recorded at close, the rounds published
    before and the base's float32 master. Steps: load -> aggregate -> settle -> write -> commit. Nothing is
    written until the checkpoint blob (content-addressed, so a redo writes the same one) and then one
    transaction (ledger entries, reputations, checkpoint row, round report, next round): a crash anywhere
    before that commit is redone from the start with the same result. Memory: one tensor x contributors for
    the aggregation, plus, with scoring, the evaluator's model and its gradient (dropped once used).
    """
    policy = policy or policy_for(config)
    evaluators = evaluators or Evaluators(state, config)
    job = load(state, config, policy, rnd, subs)
    with ExitStack() as stack:
        streams = open_streams(state, config, job, evaluators, stack)
        report = aggregate(state, config, job, streams)
        if isinstance(report, str):
            return report  # reopened or halted
        crash_point("aggregated")
        plan, rewards_summary = settle(state, config, job, streams, report)
        crash_point("settled")
        written = write(state, job, streams, evaluators, report, plan, rewards_summary)
    crash_point("blob-written")
    commit(state, config, job, written)
    crash_point("committed")
    if config.keep_checkpoints is not None:  # housekeeping after the publish is visible: its own phase
        log.info("round %d phase=retire", rnd.id)
        log.info("round %d: %s", rnd.id, retire_checkpoints(state, keep=config.keep_checkpoints))
    log.info("round %d phase=done", rnd.id)
    loss = f", held-out loss {written.heldout:.4f}" if written.heldout is not None else ""
    if written.preference is not None:
        loss += ", preference margin {:.4f} -> {:.4f}".format(
            written.preference["before"]["preference_margin"], written.preference["after"]["preference_margin"])
    return f"published {written.sha[:12]} from {len(job.contributors)} submissions{loss}"


def load(state: ServerState, config: ServerConfig, policy, rnd: Round, subs: list[Submission]) -> RoundJob:
    """The base's shapes, the inputs recorded at close, the privacy history and the lineage before it."""
    log.info("round %d phase=load", rnd.id)
    with SafetensorsReader.in_archive(state.blobs.path(rnd.base_sha256)) as r:  # read in place
        shapes = r.shapes()
        keep_master = master_weights.needs_master(r.infos)
    contributors = [s.contributor_id for s in subs]
    inputs = _round_inputs(state, config, policy, rnd, contributors)
    flush = async_rounds.flush_for(inputs.staleness_json, server_lr=inputs.server_lr)  # as recorded at close
    with state.session() as s:
        # each published round charged as its own participation mode said (privacy_history.py)
        history = published_history(s, before=rnd.id)
        parent = s.get(Checkpoint, rnd.base_sha256)
        parent_measured = parent is None or parent.heldout_loss is not None
        ancestors = _ancestors(s, parent)
    return RoundJob(rnd=rnd, subs=subs, contributors=contributors, inputs=inputs,
                    reputations=json.loads(inputs.reputations_json), flush=flush, soup=flush.soup(config.soup),
                    accountant=PrivacyAccountant(history), shapes=shapes, keep_master=keep_master,
                    parent_measured=parent_measured, ancestors=ancestors)


def open_streams(state: ServerState, config: ServerConfig, job: RoundJob, evaluators: Evaluators,
                 stack: ExitStack) -> Streams:
    """Map the payloads, get the base's evaluator (scoring), open the checkpoint (and master) blob writers."""
    rnd = job.rnd
    payloads = [state.blobs.path(sub.payload_sha256) for sub in job.subs]  # read a tensor at a time, none held open
    log.info("round %d phase=scoring-gradient", rnd.id)  # the evaluator's build (a first round's) included
    evaluator = evaluators.for_base(rnd.base_sha256)
    stack.callback(evaluators.forget, evaluator)  # a retry of this round rebuilds a released one
    stored = StoredDeltas(payloads, job.contributors, job.shapes)
    source = scoring_tap(config, stored, evaluator)
    if evaluator is not None and not job.parent_measured and evaluator.has_gradient and not evaluator.has_heldout:
        # the loss `write` records (kept by the evaluator), measured while the gradient pass has just read the
        # base: its pages are still in the page cache, which aggregation then drops
        log.info("round %d phase=parent-evaluation", rnd.id)
        evaluator.loss(None)
    # read back at once by its held-out evaluation: through the page cache; without one, around it (blobs.py)
    ckpt_blob = stack.enter_context(state.blobs.writer(streamed=evaluator is None))
    master_blob = stack.enter_context(state.blobs.writer(streamed=True)) if job.keep_master else None
    master_file = master_path(state, rnd.base_sha256)
    master = stack.enter_context(SafetensorsReader(master_file, streamed=True)) if master_file is not None else None
    writer = CheckpointWriter(state.blobs.path(rnd.base_sha256), master=master, changed=stored.names(),
                              ckpt_blob=ckpt_blob, master_blob=master_blob,
                              read_ahead=config.aggregation_engine == "local")  # ray: tasks read the base
    stack.callback(writer.close)
    return Streams(source=source, evaluator=evaluator, writer=writer, ckpt_blob=ckpt_blob, master_blob=master_blob)


def _sample_rate(config: ServerConfig, rnd: Round) -> float | None:
    """The probability each person had of being selected for this round (its draws), None without sampling.
    Read when the round closes (`record_round_inputs`); publishing uses the recorded figure."""
    if config.sample_rate >= 1.0:
        return None
    return sampling.effective_rate(config.sample_rate, len(sampling.cutoffs(rnd)))


def _recorded_rate(config: ServerConfig, job: RoundJob) -> float | None:
    """The round's q as recorded at close (a later --sample-rate does not rewrite it); rows closed by a version
    that did not record it: today's setting with the round's draws (None: q = 1)."""
    if job.inputs.sample_rate is not None:
        return job.inputs.sample_rate
    return _sample_rate(config, job.rnd)


def aggregate(state: ServerState, config: ServerConfig, job: RoundJob, streams: Streams):
    """DeltaSoup over the stored deltas into the checkpoint writer; a string outcome when the round reopens
    (too few acceptable deltas for the rule) or halts (the privacy budget is spent)."""
    rnd = job.rnd
    weights = aggregation_weights(config, job.contributors, job.reputations)
    gen = round_generator(state, rnd.base_sha256)
    log.info("round %d phase=aggregation", rnd.id)
    try:
        # async: w(s) as aggregation weights or on the rows, as recorded; server_lr x step_scale x out
        rows, row_weights = job.flush.rows(streams.source, job.contributors, weights)
        sharded = _ray_publish(state, config, job, streams)
        with threads_beside_writers():  # the writer's two threads stream while the soup computes
            report = DeltaSoup(job.soup, dp_clip=job.inputs.dp_clip).run(
                rows, job.flush.sink(streams.writer.sink), weights=row_weights, generator=gen,
                accountant=job.accountant, sample_rate=_recorded_rate(config, job),
                lend_aggregates=True,  # CheckpointWriter.sink uses each aggregate before it returns
                reference=reference_for(config, streams.evaluator), publish=sharded,
                distances=sharded.pairwise_sq_distances if sharded is not None else None)
        if sharded is not None:
            log.info("round %d aggregated by %d Ray tasks", rnd.id, sharded.tasks)
        tap_s = getattr(streams.source, "seconds", None)  # a SlopeTap's share of the phase is scoring's
        if tap_s is not None:
            log.info("round %d scoring slopes taken during aggregation in %.3f s", rnd.id, tap_s)
        _note_contributions(job, streams, report)
        return report
    except NotRobustConfigError as exc:
        _reopen(state, rnd.id, len(job.subs) + 1, f"waiting for more submissions: {exc}")
        return f"REOPENED ({exc})"
    except PrivacyBudgetExceeded as exc:
        with state.write_session() as s:
            r = s.get(Round, rnd.id)
            r.state = RoundState.HALTED
            r.message = f"halted: {exc}"
            s.add(r)
            s.commit()
        return f"HALTED ({exc})"


def _ray_publish(state: ServerState, config: ServerConfig, job: RoundJob, streams: Streams):
    """DeltaSoup's last pass as Ray tasks (`--aggregation-engine ray`: ray_engine.py), else None (this process)."""
    if config.aggregation_engine != "ray":
        return None
    from zoo_gym.server.rounds.ray_engine import RayPublish

    return RayPublish(streams.writer, payloads=[state.blobs.path(sub.payload_sha256) for sub in job.subs],
                      contributors=job.contributors, flush=job.flush, tap=streams.source,
                      work=state.work_dir / "ray" / f"round-{job.rnd.id}", address=config.ray_address,
                      block_rows=config.ray_block_rows, task_memory_mb=config.ray_task_memory_mb)


def _note_contributions(job: RoundJob, streams: Streams, report) -> None:
    """Warn once (log and round report) when the accepted deltas are mostly copies of one; read-only."""
    if len(report.contributors) != len(job.subs):  # rows are the submissions in order (async flushes too)
        return
    accepted = [i for i, c in enumerate(report.contributors) if c.accepted]
    job.notes = round_notes(streams.source, [sub.payload_sha256 for sub in job.subs], accepted,
                            private=job.soup.dp_enabled)
    for line in job.notes:
        log.warning("round %d: %s", job.rnd.id, line, extra={"event": "round", "round": job.rnd.id,
                                                             "warning": "identical-contributions"})


def settle(state: ServerState, config: ServerConfig, job: RoundJob, streams: Streams, report):
    """Score the contributions and plan the pay (an async flush pays amount x w(s))."""
    log.info("round %d phase=scoring", job.rnd.id)
    if streams.evaluator is not None:
        streams.evaluator.release_gradient()  # the slopes are taken: keep its loss and norm, free the tensors
    plan, rewards_summary = plan_rewards(state, config, job.rnd, streams.source, report, streams.evaluator,
                                         reputations=job.reputations,
                                         payloads=[(sub.base_sha256, sub.payload_sha256) for sub in job.subs],
                                         dp_clip=job.inputs.dp_clip)
    if job.flush.adjusts_pay and plan is not None:
        plan = job.flush.payouts(plan, pool=plan.pool)
        rewards_summary["payouts"] = [asdict(p) for p in plan.payouts]
    return plan, rewards_summary


def write(state: ServerState, job: RoundJob, streams: Streams, evaluators: Evaluators, report, plan,
          rewards_summary) -> Written:
    """Finish the checkpoint with its signed lineage, pack it into the blob store, and measure its held-out loss."""
    rnd, evaluator = job.rnd, streams.evaluator
    notes = {"warnings": job.notes} if job.notes else {}
    report_json = json.dumps(_jsonable({"soup": report, "rewards": rewards_summary, **notes}), sort_keys=True)
    privacy = getattr(report, "privacy", None)
    parent_loss = None
    if evaluator is not None and not job.parent_measured:
        if not evaluator.has_heldout:
            log.info("round %d phase=parent-evaluation", rnd.id)
        parent_loss = evaluator.loss(None)  # genesis: measured once (kept when measured before), on the same set
    lineage = _lineage(state, job, report, privacy, parent_loss)
    log.info("round %d phase=write", rnd.id)
    streams.writer.finish_weights()
    if streams.master_blob is not None:
        lineage["master_sha256"] = streams.master_blob.commit()  # what the published weights lack of float32
        lineage["master_dtype"] = "float32"  # its precision (stored as low halves: master_weights.py)
    streams.writer.finish(sign_lineage(lineage, key=state.key))  # the manifest carries the server's signature
    log.info("round %d phase=pack", rnd.id)
    sha = streams.ckpt_blob.commit()
    heldout = preference = None
    if evaluator is not None:
        log.info("round %d phase=evaluation", rnd.id)
        before = evaluator.preference_report()  # None without validation pairs
        evaluator.release()  # one model in memory: this base's goes before the new one loads
        streams.source = None  # and the decoded rows it cached (up to 128 MB)
        release_memory()
        model_dir, weights = state.checkpoint_files(sha)  # the weights read in place from the new archive
        heldout = evaluators.measure_published(evaluator, model_dir, weights=weights, checkpoint_sha256=sha)
        if before is not None:
            preference = {"before": before, "after": evaluators.published_preference(sha)}
            report_json = json.dumps({**json.loads(report_json), "preference": preference}, sort_keys=True)
    return Written(sha=sha, size=state.blobs.size(sha), lineage=lineage, report_json=report_json, privacy=privacy,
                   plan=plan, parent_loss=parent_loss, heldout=heldout, preference=preference)


def _lineage(state: ServerState, job: RoundJob, report, privacy, parent_loss: float | None) -> dict:
    rnd, contributors = job.rnd, job.contributors
    accepted = [bool(c.accepted) for c in report.contributors]
    ancestors = job.ancestors
    # Under DP who took part is public (the threat model) but whether validation accepted a delta depends on its
    # content (finite, within max_delta_norm): a per-person bit outside the ε, so the public lineage omits it.
    # With participation private (`dp_participation`) it names nobody: who took part is what that mode hides.
    private = job.soup.dp_enabled
    hidden = private and job.soup.dp_participation == "private"
    people = {} if hidden else {
        "contributors": contributors,
        **({} if private else {"accepted": [c for c, ok in zip(contributors, accepted) if ok]}),
        "submissions": [{"contributor": sub.contributor_id, "method": _method(sub),
                         **({} if private else {"accepted": ok})} for sub, ok in zip(job.subs, accepted)],
        **job.flush.lineage()}
    return {
        "round": rnd.id,
        "base_model": public_base_name(state.base_model),
        "parent_sha256": rnd.base_sha256,
        **people,
        "aggregator": job.soup.aggregator,
        "privacy": _jsonable(privacy),
        # earlier rounds, genesis first, so a pulled checkpoint's model card shows the whole lineage
        "history": [*ancestors[:-1], {**ancestors[-1], "heldout_loss": parent_loss}] if parent_loss is not None
        else ancestors,
    }


def commit(state: ServerState, config: ServerConfig, job: RoundJob, w: Written) -> None:
    """One transaction: ledger entries and reputations, the checkpoint row, the round's report, the next round."""
    rnd = job.rnd
    log.info("round %d phase=commit", rnd.id)
    with state.write_session() as s:
        record_settlement(state, config, w.plan, s)
        parent = s.get(Checkpoint, rnd.base_sha256)
        if parent is not None and parent.heldout_loss is None and w.parent_loss is not None:
            parent.heldout_loss = w.parent_loss
            s.add(parent)
        if s.get(Checkpoint, w.sha) is None:
            # The archive holds what defines the checkpoint, so the same inputs publish the same bytes; the
            # row adds when things happened and the loss measured on the written weights.
            row_manifest = {k: v for k, v in w.lineage.items() if k != "history"}
            row_manifest.update(heldout_loss=w.heldout, opened_at=_iso(rnd.opened_at), closed_at=_iso(rnd.closed_at),
                                received_at={sub.contributor_id: _iso(sub.received_at) for sub in job.subs})
            if w.preference is not None:  # measured on the written weights, like the loss
                row_manifest["preference"] = w.preference
            s.add(Checkpoint(sha256=w.sha, round_id=rnd.id, parent_sha256=rnd.base_sha256, size=w.size,
                             heldout_loss=w.heldout, manifest_json=json.dumps(row_manifest, sort_keys=True)))
        r = s.get(Round, rnd.id)
        r.state = RoundState.PUBLISHED
        r.published_sha256 = w.sha
        r.aggregator = job.soup.aggregator
        r.report_json = w.report_json
        if w.privacy is not None:
            r.dp_epsilon_round = w.privacy.epsilon_round
            r.dp_epsilon_total = w.privacy.epsilon_total
            r.dp_epsilon_total_rdp = w.privacy.epsilon_total_rdp
            r.dp_noise_multiplier = w.privacy.noise_multiplier
            r.dp_sample_rate = w.privacy.q
        s.add(r)
        if s.get(Round, rnd.id + 1) is None:
            s.add(Round(id=rnd.id + 1, state=RoundState.OPEN, base_sha256=w.sha, aggregator=job.soup.aggregator))
        s.commit()


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


def _last_dp_clip(session, round_id: int) -> float | None:
    """The adaptive clip norm the last round published before `round_id` chose (None: the configured one)."""
    last = session.exec(select(Round).where(Round.state == RoundState.PUBLISHED, Round.id < round_id)
                        .order_by(Round.id.desc())).first()
    if last is None:
        return None
    return json.loads(last.report_json).get("soup", {}).get("next_dp_clip")
