"""Server-side Poisson sampling (`--sample-rate q`): who may submit to a round.

Each eligible contributor (registered no later than the draw's cutoff; draw 0's is the round's opening) is
selected for round N independently with probability q by a coin only the server can compute: HMAC-SHA256
keyed by HKDF(server's Ed25519 private key) over "round N" (" draw d" for d > 0) "\\n" contributor_id,
read as a uniform in [0, 1). Same key, round and draws: the same people, whoever asks, after any restart.
A round that cannot fill adds one more independent draw (`widen`); a person is in the union of d draws with
probability q_d = 1 - (1 - q) ** d, which the accountant charges. q = 1 selects everyone (no draws).
Design and premise (one person, one identity): docs/design/privacy.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import datetime, timezone

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlmodel import func, select

from zoo_gym.server.errors import FailedPrecondition
from zoo_gym.server.store.models import Contributor, Round, Submission


def selection_key(private_key) -> bytes:
    """32 bytes derived from the server's Ed25519 private key, used for nothing but selection coins."""
    raw = private_key.private_bytes_raw()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"zoo-gym/selection/v1").derive(raw)


def coin(key: bytes, round_id: int, draw: int, contributor_id: str) -> float:
    """A uniform in [0, 1) from HMAC-SHA256(key, "round N[ draw d]\\n" + contributor_id) (53 bits)."""
    label = f"round {int(round_id)}" + (f" draw {int(draw)}" if draw else "")
    digest = hmac.new(key, f"{label}\n{contributor_id}".encode(), hashlib.sha256).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / float(1 << 53)


def effective_rate(q: float, draws: int) -> float:
    """Probability that one person is in the union of `draws` independent draws at rate q."""
    return 1.0 if q >= 1.0 else 1.0 - (1.0 - q) ** max(1, draws)


def _utc(when: datetime) -> datetime:
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)


def cutoffs(rnd: Round) -> list[datetime]:
    """Each draw's eligibility cutoff: the round's opening, then the time each later draw was added."""
    extra = json.loads(rnd.draws_json) if rnd.draws_json else []
    return [_utc(rnd.opened_at)] + [datetime.fromtimestamp(float(t), timezone.utc) for t in extra]


def is_selected(key: bytes, rnd: Round, contributor_id: str, registered_at: datetime, q: float) -> bool:
    """Whether the contributor is in any of the round's draws it was eligible for."""
    if q >= 1.0:
        return True
    reg = _utc(registered_at)
    return any(reg <= cut and coin(key, rnd.id, d, contributor_id) < q for d, cut in enumerate(cutoffs(rnd)))


def selected_ids(s, key: bytes, rnd: Round, q: float) -> list[str]:
    """Every contributor selected for the round, in id order (q = 1: every registered contributor)."""
    rows = s.exec(select(Contributor.id, Contributor.registered_at).order_by(Contributor.id)).all()
    return [cid for cid, reg in rows if is_selected(key, rnd, cid, reg, q)]


def widen(s, rnd: Round, now: float) -> int:
    """Add one draw (cutoff `now`) to the open round in session `s`; the caller commits. Returns the draws."""
    extra = json.loads(rnd.draws_json) if rnd.draws_json else []
    rnd.draws_json = json.dumps([*extra, float(now)])
    s.add(rnd)
    return len(extra) + 2


def check_may_submit(s, key: bytes, rnd: Round, contributor_id: str, *, q: float, holds: int | None) -> None:
    """FAILED_PRECONDITION (nothing stored) for a contributor not selected for `rnd`, or, when sampling and the
    round is a buffer that holds `holds` deltas, for a buffer already full (its deltas never move on)."""
    if q >= 1.0:
        return
    contributor = s.get(Contributor, contributor_id)
    if contributor is None or not is_selected(key, rnd, contributor_id, contributor.registered_at, q):
        raise FailedPrecondition(f"contributor {contributor_id} was not selected for round {rnd.id} (sample rate "
                                 f"{q:g}): nothing was stored; ask again when round {rnd.id + 1} opens")
    if holds is not None:
        n = s.exec(select(func.count()).select_from(Submission).where(Submission.round_id == rnd.id)).one()
        if n >= holds:
            raise FailedPrecondition(f"round {rnd.id}'s buffer is full ({n} of {holds}): nothing was stored; "
                                     f"ask again when round {rnd.id + 1} opens")
