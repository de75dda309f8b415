"""A round whose accepted contributions are mostly one delta: one WARNING line, and a note in its report.

Contributors who train the same examples with the same settings and seed upload the same delta. Averaging
copies changes nothing in the aggregate (the robust rules count copies once anyway), so nothing is refused
and the aggregation is untouched; but the round then moves the model by one contributor's step, and an operator
who expected several independent contributions (and a learning rate chosen for their average) should hear it.

Copies are what the aggregation itself calls copies (``krum.duplicate_groups``: rows within 1% of the rows'
typical nearest-neighbour distance, exact copies always), computed from the decoded rows when they are small
(``DENSE_CHECK_BYTES``, the rows the aggregation has just decoded and cached); for larger rounds only
byte-identical payloads are matched (free: their sha256 is stored), so near-copies of a large model go unseen.
Skipped under DP: whether two people's deltas match is content about them outside the round's ε.
"""

from __future__ import annotations

import math

import torch

from zoo_gym.aggregation.distances import pairwise_sq_distances
from zoo_gym.aggregation.krum import duplicate_groups

# dense rows (accepted x parameters x 4 bytes) up to which copies are found from distances, not payload hashes
DENSE_CHECK_BYTES = 64 << 20


def _groups_from_rows(source, accepted: list[int]) -> list[int]:
    """Each accepted row's group of copies (named by its first row) from whole-model distances."""
    dist = torch.zeros((len(accepted), len(accepted)), dtype=torch.float64)
    for name in source.names():
        dist += pairwise_sq_distances(source.stacked(name)[accepted].to(torch.float32))
    return [int(g) for g in duplicate_groups(dist)]


def _groups_from_payloads(payload_sha256: list[str]) -> list[int]:
    """Each row's group: the first row with byte-identical payload."""
    first: dict[str, int] = {}
    return [first.setdefault(sha, i) for i, sha in enumerate(payload_sha256)]


def copy_groups(source, payload_sha256: list[str], accepted: list[int]) -> list[int]:
    """The accepted rows' groups of copies: from the rows when small enough, else from the payload hashes."""
    numel = sum(math.prod(source.shape(name)) for name in source.names())
    if len(accepted) * numel * 4 <= DENSE_CHECK_BYTES:
        return _groups_from_rows(source, accepted)
    return _groups_from_payloads([payload_sha256[i] for i in accepted])


def identical_warning(groups: list[int]) -> str | None:
    """One line when the largest group of copies holds more than half of the accepted deltas, else None."""
    k = len(groups)
    if k < 2:
        return None
    largest = max(groups.count(g) for g in set(groups))
    if largest * 2 <= k:
        return None
    which = "all" if largest == k else f"{largest} of"
    return (f"{which} {k} accepted contributions are copies of one delta ({len(set(groups))} distinct): the round "
            "moves the model by one contributor's step, not an average of independent ones (same data, settings "
            "and seed?); the aggregate is unchanged")


def round_notes(source, payload_sha256: list[str], accepted: list[int], *, private: bool) -> list[str]:
    """The round's warnings about its contributions as a whole (empty under DP: see the module docstring)."""
    if private or len(accepted) < 2:
        return []
    line = identical_warning(copy_groups(source, payload_sha256, accepted))
    return [line] if line else []
