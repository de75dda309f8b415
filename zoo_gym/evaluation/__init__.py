"""Evaluation: held-out loss, preference accuracy and the loss's gradient of a checkpoint, whole or streamed.

``evaluate`` (the model and tokenizer, examples rendered by ``chat``'s templates, ``Evaluator``), ``server_evaluator``
(the server's evaluator of one base: scoring set, held-out loss, scoring gradient), ``streamed_model`` and
``vocab_blocks`` (a checkpoint read one decoder layer at a time), ``gradient`` (the base gradient, spilled to disk
by ``spill``), ``packed_batch``/``packing`` (a scoring set packed with its shared prefix), ``preference_eval`` and
``preference_scoring`` (preference pairs). Training (gym_train) and the server's rounds import it; it imports
only ``zoo_gym.io`` of zoo_gym. Why and how: docs/design/streamed-evaluation.md.
"""

from __future__ import annotations

from zoo_gym.lazy_exports import lazy_exports

# submodule -> the names it defines, imported on first use (zoo_gym/lazy_exports.py): importing the
# package, or a torch-free submodule of it (errors), does not import torch
_LAZY = {
    "chat": "ChatTemplateError PLAIN_TEMPLATE check_template prompt_messages",
    "errors": "EvaluationError EvaluationInputError",
    "scoring_metrics": "SCORING_METRICS",
    "evaluate": "Evaluator completion_loss_sum heldout_loss load_model load_tokenizer tokenize_examples",
    "gradient": "BaseGradient base_gradient",
    "memory": "release_memory",
    "packed_batch": "PackedBatch pack_shared_prefix packed_loss_sum supports_packing",
    "packing": "PackedScoringSet",
    "preference_eval": "PreferenceEvaluator preference_report",
    "preference_scoring": "PreferenceScoringSet",
    "server_evaluator": "ServerEvaluator loss_and_pairs",
    "spill": "SpilledTensors",
    "streamed_model": "compute_dtype computing load_streamed",
}

__all__ = sorted(name for names in _LAZY.values() for name in names.split())

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
