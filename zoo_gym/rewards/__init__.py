"""Rewards: contribution scores, reputation, the integer pool split and the signed ledger.

No gRPC and no file I/O: the ledger's database comes in as an SQLModel ``Session`` factory, the losses as
floats and callables, the base gradient from ``zoo_gym.evaluation`` (which reads the checkpoints and spills
the gradient). ``BaseGradient``, ``PackedScoringSet`` and the packing helpers moved there; they stay
importable from here. Formulas: see each module's docstring and ``zoo_gym/rewards/README.md``.
"""

from __future__ import annotations

from zoo_gym.lazy_exports import lazy_exports

# submodule -> the names it defines, imported on first use (zoo_gym/lazy_exports.py): importing the
# package, or a torch-free submodule of it (configs, errors), does not import torch
_LAZY = {
    "acceptance": "accept_by_quality quality_threshold",
    "errors": "ConfigError LedgerConflictError LedgerError RewardsError RoundAlreadySettledError "
              "ScoringInputError SplitError",
    "first_order": "SlopeTap directional_slopes linear_losses linear_shapley streamed_slopes",
    "first_order_scoring": "FirstOrderConfig score_round_first_order",
    "zoo_gym.evaluation.gradient": "BaseGradient base_gradient",
    "entry_hash": "GENESIS_HASH canonical_entry_bytes compute_entry_hash signing_message",
    "ledger": "LEDGER_KINDS Ledger LedgerEntry LedgerEntryBase LedgerEntryPublic NewEntry "
              "create_ledger_tables",
    "marginal": "MarginalEstimate",
    "zoo_gym.evaluation.packed_batch": "PackedBatch pack_shared_prefix packed_loss_sum supports_packing",
    "zoo_gym.evaluation.packing": "PackedScoringSet",
    "reputation": "Reputation ReputationBase ReputationBook ReputationConfig ReputationPublic "
                  "aggregation_weights next_reputation",
    "scoring": "ContributionDiagnostics ContributionScore RoundScoring ScoringConfig combine_scores "
               "score_round score_round_detailed",
    "settle": "Payout Settlement SettlementConfig SettlementPlan plan_settlement settle_round",
    "split": "split_pool",
    "verify": "VerifyReport load_public_key verify_chain verify_entries",
}

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

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
