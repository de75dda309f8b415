"""The one error type of the codec.

Everything that is wrong with a payload (truncated, corrupt, inconsistent, oversized) or with the
input given to :func:`zoo_gym.codec.encode` raises :class:`CodecError` with a message that names the
field or tensor at fault and says what was expected.
"""

from __future__ import annotations

__all__ = ["CodecError"]


class CodecError(ValueError):
    """A delta payload cannot be encoded or decoded; the message says what is wrong."""
