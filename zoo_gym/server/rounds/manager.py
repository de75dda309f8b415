"""The round state machine: OPEN -> AGGREGATING -> PUBLISHED (next round OPEN), or HALTED.

A round closes at `quorum` submissions, or at its deadline with at least `min_contributors`; with fewer,
it closes with whoever submitted when the robust rule can aggregate that many (`rule.minimum_n()`),
else reopens for another `round_timeout` with a message. In async mode (async_rounds.py) it closes at
`buffer_size` deltas. Closing commits AGGREGATING with the round's inputs (RoundInputs); publishing
commits the ledger entries, reputations, checkpoint row, report and next OPEN round in one transaction,
so a crash in between is recovered by aggregating again on restart from the same stored inputs, with
the same result (blobs are content-addressed, so nothing is duplicated).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone

from sqlmodel import select

from zoo_gym.server.config import ServerConfig
from zoo_gym.server.metrics import ServerMetrics
from zoo_gym.server.store.models import Checkpoint, Round, RoundState, Submission
from zoo_gym.server.rounds import sampling
from zoo_gym.server.rounds.evaluation import Evaluators
from zoo_gym.server.rounds.policy import policy_for
from zoo_gym.server.rounds.publish import publish_round, record_round_inputs
from zoo_gym.server.rounds.ray_engine import RayEngineError
from zoo_gym.server.store.state import ServerState, count_submissions

log = logging.getLogger("zoo_gym.server")


class RoundManager:
    """Owns the background thread that closes, aggregates and publishes rounds."""

    def __init__(self, state: ServerState, config: ServerConfig) -> None:
        self.state = state
        self.config = config
        self.policy = policy_for(config)  # sync or async, chosen once
        self.evaluators = Evaluators(state, config)  # the bases' evaluators, kept from round to round
        self._prepare_done: set[str] = set()  # bases prepared while open, or whose preparation failed (not retried)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="round-manager", daemon=True)
        self.metrics = ServerMetrics(state)  # this server's registry: RPCs (interceptor), phases, state gauges
        self._phase_timer = self.metrics.phase_timer(self._thread)

    def start(self) -> None:
        self._record_rule()
        self._ensure_deadline()
        logging.getLogger("zoo_gym.server").addHandler(self._phase_timer)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        logging.getLogger("zoo_gym.server").removeHandler(self._phase_timer)

    def notify(self) -> None:
        """Called after every accepted submission."""
        self._wake.set()

    # ------------------------------------------------------------------------------------------ internals

    def _close_or_extend(self, rnd: Round, n: int) -> bool:
        """The deadline passed with fewer than min_contributors: close with the `n` in hand when the robust
        rule can aggregate them, else reopen the round for another round_timeout with a message saying why."""
        soup = self.config.soup
        needed = max(soup.rule.minimum_n(), rnd.needs, 1)
        if n >= needed:
            log.info("round %d timed out with %d of %d submissions; closing with them (%s needs %d)", rnd.id, n,
                     self.config.min_contributors, soup.aggregator, needed,
                     extra={"event": "round", "round": rnd.id, "state": "timed-out", "submissions": n})
            return True
        with self.state.write_session() as s:
            r = s.get(Round, rnd.id)
            if r.state != RoundState.OPEN:
                return False
            r.deadline_unix = time.time() + self.config.round_timeout
            r.message = (f"timed out with {n} submission{'s' if n != 1 else ''}; {soup.aggregator} needs at least "
                         f"{needed}: reopened until "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(r.deadline_unix))}")
            s.add(r)
            s.commit()
        log.info("round %d %s", rnd.id, r.message, extra={"event": "round", "round": rnd.id, "state": "reopened",
                                                          "submissions": n})
        return False

    def _widen_if_short(self, rnd: Round) -> None:
        """Sampling: while fewer are selected than the round needs to close (min_contributors; async: the buffer),
        say so, and add one more independent draw every round_timeout since the last (sampling.widen)."""
        need = self.policy.holds(rnd) or self.config.min_contributors
        q, key = self.config.sample_rate, sampling.selection_key(self.state.key)
        with self.state.write_session() as s:
            r = s.get(Round, rnd.id)
            if r is None or r.state != RoundState.OPEN:
                return
            chosen = len(sampling.selected_ids(s, key, r, q))
            if chosen >= need:
                return
            draws = len(sampling.cutoffs(r))
            due = sampling.cutoffs(r)[-1].timestamp() + self.config.round_timeout
            now = time.time()
            if now >= due:
                draws = sampling.widen(s, r, now)
                chosen = len(sampling.selected_ids(s, key, r, q))
                due = now + self.config.round_timeout
            message = (f"{chosen} contributor{'s' if chosen != 1 else ''} selected (sample rate {q:g}, {draws} "
                       f"draw{'s' if draws != 1 else ''}, each person now {sampling.effective_rate(q, draws):.3g}); "
                       f"the round needs {need}: another draw at "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(due))} if still short")
            if r.message == message:
                return
            r.message = message
            s.add(r)
            s.commit()
        log.info("round %d: %s", rnd.id, message, extra={"event": "round", "round": rnd.id, "state": "sampling",
                                                         "selected": chosen, "draws": draws})

    def _close(self, round_id: int) -> int:
        """Close the round with the submissions stored now, under the write lock; returns how many it holds.

        An async buffer holds exactly buffer_size deltas: those that arrived after the K-th (between the count
        and the lock) move to the next buffer, in the same transaction, in arrival order."""
        with self.state.write_session() as s:
            rnd = s.get(Round, round_id)
            rnd.state = RoundState.AGGREGATING
            rnd.closed_at = datetime.now(timezone.utc)
            rnd.message = ""  # a note on why it waited (timed out, sampling) is over once it closes
            s.add(rnd)
            subs = list(s.exec(select(Submission).where(Submission.round_id == round_id).order_by(Submission.id)))
            holds = self.policy.holds(rnd)
            if holds is not None:
                for later in subs[holds:]:
                    later.round_id = round_id + 1
                    s.add(later)
                subs = subs[:holds]
            contributors = [sub.contributor_id for sub in subs]
            record_round_inputs(self.state, self.config, self.policy, round_id, contributors, s)  # same transaction
            s.commit()
        return len(contributors)

    def _prepare_base(self, rnd: Round) -> None:
        """While the round waits for submissions: its base's evaluator, scoring gradient and (when not recorded)
        held-out loss, which its publish would otherwise compute first. After a publish they are ready (it
        measured the new base); after a start this takes the base's passes off the publish's path. The same
        numbers either way; a failure is logged and left for the publish, which computes the same, to report."""
        if self.config.rewards.scoring_method != "first-order" or rnd.base_sha256 in self._prepare_done:
            return
        self._prepare_done.add(rnd.base_sha256)  # tried once per base
        with self.state.session() as s:
            base = s.get(Checkpoint, rnd.base_sha256)
            heldout = base is not None and base.heldout_loss is None
        started = time.perf_counter()
        try:
            prepared = self.evaluators.prepare(rnd.base_sha256, heldout=heldout)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("round %d: preparing base %s's evaluation while open failed (%s); its publish will "
                        "try again", rnd.id, rnd.base_sha256[:12], exc)
            return
        if prepared:  # only what was computed now: the evaluator may come from the publish that measured the base
            log.info("round %d base %s prepared while open (%s) in %.2f s", rnd.id, rnd.base_sha256[:12],
                     ", ".join(prepared), time.perf_counter() - started)

    def _record_rule(self) -> None:
        """The open round runs under the rule served now: record its name on the round's row (init wrote the
        default rule's; a restart may serve another `--aggregator`) so that status and the dashboard say it."""
        with self.state.write_session() as s:
            rnd = self.state.current_round(s)
            if rnd is not None and rnd.state == RoundState.OPEN and rnd.aggregator != self.config.soup.aggregator:
                rnd.aggregator = self.config.soup.aggregator
                s.add(rnd)
                s.commit()

    def _ensure_deadline(self) -> None:
        if not self.policy.has_deadline:
            return
        with self.state.write_session() as s:
            rnd = self.state.current_round(s)
            if rnd is not None and rnd.state == RoundState.OPEN and rnd.deadline_unix == 0:
                rnd.deadline_unix = time.time() + self.config.round_timeout
                s.add(rnd)
                s.commit()
                log.info("round %d open on base %s until %s", rnd.id, rnd.base_sha256[:12],
                         time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rnd.deadline_unix)),
                         extra={"event": "round", "round": rnd.id, "state": "open"})

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except RayEngineError as exc:  # the cluster or its storage, which the operator fixes: one line
                log.error("round step failed: %s; retrying in 5 s", exc)
                self._stop.wait(5.0)
            except Exception:  # noqa: BLE001 - the service keeps serving; the error is logged with its trace
                log.exception("round step failed; retrying in 5 s")
                self._stop.wait(5.0)
            self.metrics.log_summary.flush()  # the per-contributor lines held back, counted every 10 s
            self._wake.wait(timeout=1.0)
            self._wake.clear()

    def step(self) -> None:
        """Advance the current round if it can be; one call does at most one transition chain."""
        with self.state.session() as s:
            rnd = self.state.current_round(s)
        if rnd is None or rnd.state in (RoundState.HALTED, RoundState.PUBLISHED):
            return
        if rnd.state == RoundState.OPEN:
            n = count_submissions(self.state, rnd.id)
            ready = self.policy.ready(rnd, n)
            if not ready and self.config.sample_rate < 1.0:
                self._widen_if_short(rnd)
            if not ready and self.policy.timed_out(rnd):
                ready = self._close_or_extend(rnd, n)
            if not ready:
                self._prepare_base(rnd)
                return
            n = self._close(rnd.id)
            self.metrics.log_summary.flush(force=True)  # what was held back is said before the round closes
            with self.state.session() as s:
                rnd = s.get(Round, rnd.id)  # as closed: closed_at goes into the checkpoint's row
            log.info("round %d closed with %d submissions; aggregating", rnd.id, n,
                     extra={"event": "round", "round": rnd.id, "state": "aggregating", "submissions": n})
        with self.state.session() as s:
            subs = list(s.exec(select(Submission).where(Submission.round_id == rnd.id).order_by(Submission.id)))
        started = time.perf_counter()
        outcome = publish_round(self.state, self.config, rnd, subs, policy=self.policy, evaluators=self.evaluators)
        seconds = time.perf_counter() - started
        if outcome.startswith("published"):
            self.metrics.publish.observe(seconds)
        log.info("round %d: %s in %.2f s", rnd.id, outcome, seconds,
                 extra={"event": "round", "round": rnd.id, "state": outcome.split(" ")[0].lower(), "seconds": seconds})
        self._ensure_deadline()