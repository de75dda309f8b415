"""Rewards: contribution scores, reputation, the integer pool split and the signed ledger.

No gRPC and no I/O of its own: the database comes in as an SQLModel ``Session`` factory, the
losses as floats and callables from the server. Formulas: see each module's docstring and
``zoo_gym/rewards/README.md``.
"""

from .acceptance import accept_by_quality, quality_threshold
from .errors import (ConfigError, LedgerConflictError, LedgerError, RewardsError,
                     RoundAlreadySettledError, ScoringInputError, SplitError)
from .first_order import SlopeTap, directional_slopes, linear_losses, linear_shapley, streamed_slopes
from .first_order_scoring import FirstOrderConfig, score_round_first_order
from .gradient import BaseGradient, base_gradient
from .entry_hash import GENESIS_HASH, canonical_entry_bytes, compute_entry_hash, signing_message
from .ledger import (LEDGER_KINDS, Ledger, LedgerEntry, LedgerEntryBase, LedgerEntryPublic, NewEntry,
                     create_ledger_tables)
from .marginal import MarginalEstimate
from .packed_batch import PackedBatch, pack_shared_prefix, packed_loss_sum, supports_packing
from .packing import PackedScoringSet
from .reputation import (Reputation, ReputationBase, ReputationBook, ReputationConfig,
                         ReputationPublic, aggregation_weights, next_reputation)
from .scoring import (ContributionDiagnostics, ContributionScore, RoundScoring, ScoringConfig,
                      combine_scores, score_round, score_round_detailed)
from .settle import (Payout, Settlement, SettlementConfig, SettlementPlan, plan_settlement,
                     settle_round)
from .split import split_pool
from .verify import VerifyReport, load_public_key, verify_chain, verify_entries

__all__ = [
    "BaseGradient", "FirstOrderConfig", "SlopeTap", "base_gradient", "combine_scores",
    "linear_shapley", "score_round_first_order", "streamed_slopes",
    "PackedBatch", "PackedScoringSet", "pack_shared_prefix", "packed_loss_sum", "supports_packing",
    "GENESIS_HASH", "LEDGER_KINDS", "ConfigError", "ContributionDiagnostics", "ContributionScore",
    "Ledger", "LedgerConflictError", "LedgerEntry", "LedgerEntryBase", "LedgerEntryPublic",
    "LedgerError", "MarginalEstimate", "NewEntry", "Payout", "Reputation", "ReputationBase",
    "ReputationBook", "ReputationConfig", "ReputationPublic", "RewardsError",
    "RoundAlreadySettledError", "RoundScoring", "ScoringConfig", "ScoringInputError",
    "Settlement", "SettlementConfig", "SettlementPlan", "SplitError", "VerifyReport",
    "accept_by_quality", "aggregation_weights", "canonical_entry_bytes", "compute_entry_hash",
    "create_ledger_tables", "directional_slopes", "linear_losses", "load_public_key", "next_reputation", "plan_settlement",
    "quality_threshold", "score_round", "score_round_detailed", "settle_round",
    "signing_message", "split_pool", "verify_chain", "verify_entries",
]
