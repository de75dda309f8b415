"""Typed errors of the evaluation library; every message says what to change."""

from __future__ import annotations


class EvaluationError(Exception):
    """Base class of every error raised by `zoo_gym.evaluation`."""


class EvaluationInputError(EvaluationError, ValueError):
    """An evaluation's inputs do not fit: an empty or tokenless example set, a delta tensor the model lacks
    or of another shape, a model whose attention cannot take the packing mask. The message names which."""
