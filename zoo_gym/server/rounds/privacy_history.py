"""What the accountant charges for the rounds already published under DP, each as its own participation mode said.

A round's participation mode (public: the ledger names its contributors; private: nothing public does) is recorded
in its report (`report_json` -> soup -> privacy -> participation). A round published before modes existed (issue 46)
recorded none: its ledger and lineage named its participants, so it is charged as public. An operator who switches
modes between rounds is charged for each round as it was published (privacy.accounted_step).
"""

from __future__ import annotations

import json

from sqlmodel import select

from zoo_gym.aggregation.privacy import accounted_step
from zoo_gym.server.store.models import Round, RoundState


def _participation(report_json: str | None) -> str:
    try:
        privacy = (json.loads(report_json or "{}").get("soup") or {}).get("privacy") or {}
    except (ValueError, AttributeError):
        return "public"
    return privacy.get("participation") if privacy.get("participation") in ("public", "private") else "public"


def published_history(session, *, before: int | None = None) -> list[tuple[float, float, int]]:
    """The accountant's (z, q, 1) rows of the DP rounds published before round `before` (all when None), in order."""
    query = select(Round.dp_noise_multiplier, Round.dp_sample_rate, Round.report_json).where(
        Round.dp_noise_multiplier.is_not(None), Round.state == RoundState.PUBLISHED)
    if before is not None:
        query = query.where(Round.id < before)
    rows = session.exec(query.order_by(Round.id)).all()
    return [(*accounted_step(z, q or 1.0, participation=_participation(report)), 1) for z, q, report in rows]
