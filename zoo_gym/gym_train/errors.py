"""The errors local training raises about its inputs and its machine, below every module that raises them."""

from __future__ import annotations


class DataError(ValueError):
    """A training record cannot be used; the message names file, line (or record index) and field."""

    def __init__(self, file: str, where: str, field: str, problem: str):
        self.file, self.where, self.field, self.problem = file, where, field, problem
        super().__init__(f"{file}: {where}: field {field!r}: {problem}")


class HardwareError(RuntimeError):
    """The requested feature (flash attention, 4-bit QLoRA) cannot run on this machine."""
