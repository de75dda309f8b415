"""The server's database tables (SQLModel). Rewards tables live in zoo_gym.rewards and share the engine.

Table models only carry what must survive a restart; everything derivable (a round's submission count,
a contributor's balance) is computed by query.
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import Enum

from sqlalchemy import UniqueConstraint
from sqlmodel import Field, SQLModel

from zoo_gym.aggregation.config import DEFAULT_AGGREGATOR


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class RoundState(str, Enum):
    OPEN = "open"
    AGGREGATING = "aggregating"
    PUBLISHED = "published"
    HALTED = "halted"


class Contributor(SQLModel, table=True):
    id: str = Field(primary_key=True, max_length=32)  # hex sha256(public_key)[:32]
    public_key: str = Field(max_length=64)  # hex of the raw 32-byte Ed25519 key
    display_name: str = Field(default="", max_length=64)
    registered_at: datetime = Field(default_factory=utcnow)


class UsedNonce(SQLModel, table=True):
    """Every nonce a contributor has used in an accepted signed request (replay protection)."""

    contributor_id: str = Field(primary_key=True, max_length=32)
    nonce: str = Field(primary_key=True, max_length=32)  # hex
    method: str
    used_at: datetime = Field(default_factory=utcnow)


class SpentInvite(SQLModel, table=True):
    """An invitation (`gym-server invite`) that admitted a key; each one admits one (zoo_gym/server/transport/admission.py)."""

    id: str = Field(primary_key=True, max_length=32)  # hex of the invitation's 16 random bytes
    contributor_id: str = Field(max_length=32)
    spent_at: datetime = Field(default_factory=utcnow)


class Checkpoint(SQLModel, table=True):
    """A published base checkpoint: a deterministic tar of a Hugging Face directory in the blob store."""

    sha256: str = Field(primary_key=True, max_length=64)
    round_id: int = Field(index=True)  # the round that published it; 0 = genesis
    parent_sha256: str | None = Field(default=None, max_length=64)
    size: int
    heldout_loss: float | None = None
    manifest_json: str = "{}"  # lineage: parent, round, contributors, aggregator, privacy spent
    created_at: datetime = Field(default_factory=utcnow)


class Round(SQLModel, table=True):
    id: int = Field(primary_key=True)  # 1, 2, ... (round r trains on the checkpoint published by round r-1)
    state: RoundState = RoundState.OPEN
    base_sha256: str = Field(max_length=64)
    opened_at: datetime = Field(default_factory=utcnow)
    deadline_unix: float = 0.0
    closed_at: datetime | None = None
    published_sha256: str | None = Field(default=None, max_length=64)
    aggregator: str = DEFAULT_AGGREGATOR  # the rule the round runs under until it publishes (then the one it ran)
    report_json: str = "{}"  # DeltaSoup report: per-contributor accepted/refused and why, norms, selection
    dp_epsilon_round: float | None = None
    dp_epsilon_total: float | None = None
    dp_epsilon_total_rdp: float | None = None  # RDP's cross-check of dp_epsilon_total, computed at publish (0007)
    dp_noise_multiplier: float | None = None
    dp_sample_rate: float | None = None
    message: str = ""
    # Set when aggregation could not run with the submissions in hand (e.g. too few for the robust rule
    # after refusals): the round reopens and waits for at least this many before trying again.
    needs: int = 0
    # Server-side sampling (zoo_gym/server/rounds/sampling.py): the unix times later draws were added, as a JSON
    # list (None: the one draw at opened_at). Set only while the round is open, so a redo reads the same draws.
    draws_json: str | None = None


class RoundInputs(SQLModel, table=True):
    """What a round's outcome depends on besides its submissions, copied when the round closes.

    Reputations move when a round settles and the clip norm when one publishes; a redo after a crash
    reads them from here, so it merges, scores and pays exactly what the first run would have.
    """

    round_id: int = Field(primary_key=True)
    reputations_json: str = "{}"  # contributor id -> reputation before this round
    dp_clip: float | None = None  # clip norm the previous published round chose (None: the configured one)
    population: int = 1  # registered contributors at close; for the record only (never taken as a q)
    # Asynchronous mode (zoo_gym/server/rounds/async_rounds.py), None in a synchronous round: the flush's server
    # learning rate and staleness exponent, and per contributor the staleness of its delta (versions published
    # since its base) and its weight (1 + s) ** -a, as they were when the buffer closed.
    staleness_json: str | None = None
    # Server-side sampling: each person's probability of being in this round's draws (sampling.effective_rate of
    # --sample-rate and the round's draws) as it was at close, 1.0 without sampling; the accountant charges it.
    # None: closed by a version that did not record it.
    sample_rate: float | None = None
    # The server learning rate (--server-lr) at close: a synchronous round publishes base + server_lr x aggregate.
    # None: closed by a version that did not record it (a sync round then steps by 1; async reads staleness_json).
    server_lr: float | None = None


class Submission(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("round_id", "contributor_id", name="one_submission_per_round"),)

    id: int | None = Field(default=None, primary_key=True)
    round_id: int = Field(index=True)
    contributor_id: str = Field(index=True, max_length=32)
    base_sha256: str = Field(max_length=64)
    payload_sha256: str = Field(max_length=64)
    payload_size: int
    codecs: str = ""  # comma-separated codecs used in the payload
    metadata_json: str = "{}"
    received_at: datetime = Field(default_factory=utcnow)
