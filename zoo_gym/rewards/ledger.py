"""The rewards ledger: append-only, hash-chained, every entry signed by the server (Ed25519).

Entry ``k`` (``seq`` dense from 1) carries ``prev_hash`` = entry ``k-1``'s ``entry_hash``
(``GENESIS_HASH`` for ``seq`` 1), ``entry_hash = sha256(canonical_entry_bytes(entry)).hexdigest()`` and
``signature = Ed25519_sign(server_key, signing_message(entry_hash)).hex()`` (bytes in ``entry_hash.py``).
Appends take one transaction and a primary key on ``seq``, so two writers can never fork the chain (the
loser gets ``LedgerConflictError``). ``verify_chain`` with ``expected_head`` also catches the deletion
of the newest entries. What each binding catches: docs/design/rewards-settlement.md.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy import BigInteger, func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Field, Session, SQLModel, select

from .entry_hash import GENESIS_HASH, compute_entry_hash, signing_message
from .errors import LedgerConflictError, LedgerError

if TYPE_CHECKING:
    from .verify import VerifyReport

LEDGER_KINDS = ("reward", "refusal", "adjustment")


class LedgerEntryBase(SQLModel):
    round_id: int = Field(index=True)
    contributor: str = Field(index=True, max_length=128)  # hex public-key id
    kind: str = Field(max_length=32)                      # reward | refusal | adjustment
    amount: int = Field(sa_type=BigInteger)               # integer reward units
    score: float
    reputation_after: float
    reason: str = ""
    prev_hash: str = Field(max_length=64)
    entry_hash: str = Field(max_length=64, unique=True)
    signature: str = Field(max_length=128)                # hex Ed25519 over signing_message


class LedgerEntry(LedgerEntryBase, table=True):
    __tablename__ = "ledger_entry"
    seq: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})


class LedgerEntryPublic(LedgerEntryBase):
    seq: int


@dataclass(frozen=True)
class NewEntry:
    """What a caller asks the ledger to append; the ledger adds seq, hashes and signature."""

    round_id: int
    contributor: str
    kind: str
    amount: int
    score: float
    reputation_after: float
    reason: str = ""

    def __post_init__(self) -> None:
        if self.kind not in LEDGER_KINDS:
            raise LedgerError(f"`kind` must be one of {LEDGER_KINDS}, got {self.kind!r}")
        if isinstance(self.amount, bool) or not isinstance(self.amount, int):
            raise LedgerError(f"`amount` must be an int (reward units), got {self.amount!r}")
        if self.kind == "reward" and self.amount < 0:
            raise LedgerError(f"a reward's `amount` must be >= 0, got {self.amount}; "
                              "use kind='adjustment' to take units back")
        if self.kind == "refusal" and self.amount != 0:
            raise LedgerError(f"a refusal's `amount` must be 0, got {self.amount}")
        for name in ("score", "reputation_after"):
            if not math.isfinite(getattr(self, name)):
                raise LedgerError(f"`{name}` must be finite, got {getattr(self, name)!r}")
        if not self.contributor:
            raise LedgerError("`contributor` must be a non-empty id")


def create_ledger_tables(engine: Any) -> None:
    """Create the rewards tables (ledger + reputation) if missing; the server may instead call
    ``SQLModel.metadata.create_all`` after importing this package."""
    from .reputation import Reputation

    SQLModel.metadata.create_all(engine, tables=[LedgerEntry.__table__,  # type: ignore[attr-defined]
                                                 Reputation.__table__])  # type: ignore[attr-defined]


class Ledger:
    """Append-only signed ledger in the ``ledger_entry`` table of the caller's database."""

    def __init__(self, session_factory: Callable[[], Session],
                 signing_key: Ed25519PrivateKey) -> None:
        self._session_factory = session_factory
        self._key = signing_key
        self._lock = threading.Lock()  # one appender per process; the primary key guards others

    @property
    def session_factory(self) -> Callable[[], Session]:
        return self._session_factory

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def append(self, entries: Sequence[NewEntry], *,
               session: Session | None = None) -> list[LedgerEntryPublic]:
        """Append ``entries`` in one transaction, in order; returns them as stored.

        With ``session`` the caller owns the transaction (the rows are flushed, not committed),
        so a round's ledger entries and reputation updates commit together.
        """
        own = session is None
        s = self._session_factory() if own else session
        with self._lock:
            try:
                last = s.exec(select(LedgerEntry).order_by(LedgerEntry.seq.desc()).limit(1)  # type: ignore[attr-defined]
                              ).first()
                seq = last.seq if last else 0
                prev = last.entry_hash if last else GENESIS_HASH
                out = []
                for e in entries:
                    seq += 1
                    fields = dict(seq=seq, round_id=int(e.round_id), contributor=e.contributor,
                                  kind=e.kind, amount=int(e.amount), score=float(e.score),
                                  reputation_after=float(e.reputation_after), reason=e.reason,
                                  prev_hash=prev)
                    h = compute_entry_hash(fields)
                    sig = self._key.sign(signing_message(h)).hex()
                    s.add(LedgerEntry(**fields, entry_hash=h, signature=sig))
                    out.append(LedgerEntryPublic(**fields, entry_hash=h, signature=sig))
                    prev = h
                s.flush()
                if own:
                    s.commit()
            except IntegrityError as exc:
                s.rollback()
                raise LedgerConflictError(
                    "another writer appended to the ledger at the same sequence number; "
                    "nothing was written, retry the append") from exc
            finally:
                if own:
                    s.close()
        return out

    def entries(self, *, contributor: str | None = None, since_seq: int = 0,
                limit: int | None = None, newest_first: bool = False) -> list[LedgerEntryPublic]:
        """Entries with ``seq > since_seq`` (optionally one contributor's), ordered by seq."""
        stmt = select(LedgerEntry).where(LedgerEntry.seq > since_seq)
        if contributor is not None:
            stmt = stmt.where(LedgerEntry.contributor == contributor)
        order = LedgerEntry.seq.desc() if newest_first else LedgerEntry.seq.asc()  # type: ignore[attr-defined]
        stmt = stmt.order_by(order)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._session_factory() as s:
            return [LedgerEntryPublic.model_validate(r, from_attributes=True) for r in s.exec(stmt)]

    def iter_entries(self, *, batch_size: int = 1000, since_seq: int = 0) -> Iterator[LedgerEntryPublic]:
        """Every entry after ``since_seq`` in seq order, read ``batch_size`` rows at a time (for `verify`)."""
        since = since_seq
        while True:
            batch = self.entries(since_seq=since, limit=batch_size)
            yield from batch
            if len(batch) < batch_size:
                return
            since = batch[-1].seq

    def verify(self, public_key: Ed25519PublicKey | None = None, *,
               expected_head: tuple[int, str] | None = None) -> VerifyReport:
        """`verify_chain` over the whole stored ledger (own public key unless one is given)."""
        from .verify import verify_chain

        return verify_chain(self.iter_entries(), public_key or self.public_key,
                            expected_head=expected_head)

    def balance(self, contributor: str) -> int:
        """Sum of the contributor's amounts (0 for someone never credited)."""
        with self._session_factory() as s:
            total = s.exec(select(func.coalesce(func.sum(LedgerEntry.amount), 0))
                           .where(LedgerEntry.contributor == contributor)).one()
        return int(total)

    def head(self) -> tuple[int, str] | None:
        """(seq, entry_hash) of the newest entry; None for an empty ledger."""
        with self._session_factory() as s:
            last = s.exec(select(LedgerEntry).order_by(LedgerEntry.seq.desc()).limit(1)  # type: ignore[attr-defined]
                          ).first()
            return (last.seq, last.entry_hash) if last else None

    def has_round(self, round_id: int, *, session: Session | None = None) -> bool:
        """Whether any entry of ``round_id`` exists (a settled round)."""
        stmt = select(LedgerEntry.seq).where(LedgerEntry.round_id == round_id).limit(1)
        if session is not None:
            return session.exec(stmt).first() is not None
        with self._session_factory() as s:
            return s.exec(stmt).first() is not None
