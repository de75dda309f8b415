"""Client-side error feedback for compressed deltas.

Seide et al., "1-Bit Stochastic Gradient Descent ..." (Interspeech 2014) and Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes" (ICML 2019): the client keeps
what the codec lost, ``e = sent - decode(encode(sent))``, and adds it to its next round's delta, so
compression error does not accumulate over rounds. The residual is persisted as safetensors in the
client's work directory (written to a temporary file, fsynced, then atomically renamed).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

import torch

from zoo_gym.evaluation.evaluate import dense_delta


class ErrorFeedback:
    """The residual ``e`` of the last round, stored at ``path`` (a ``.safetensors`` file)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def residual(self) -> dict[str, torch.Tensor]:
        """The stored residual (empty before the first update or after reset)."""
        if not self.path.exists():
            return {}
        from safetensors.torch import load_file

        return load_file(str(self.path))

    def add_to(self, delta: Mapping) -> dict:
        """``delta + e``: dense where a residual exists (LoRA factors are merged there), else unchanged.

        Names only in the residual are added as they are. The input is not modified.
        """
        res = self.residual()
        out = {}
        for k, v in delta.items():
            if k in res:
                d = dense_delta(v).float()
                if tuple(d.shape) != tuple(res[k].shape):
                    raise ValueError(
                        f"error-feedback residual {k!r} has shape {tuple(res[k].shape)} but the delta's is "
                        f"{tuple(d.shape)}: the base changed shape; call reset()"
                    )
                out[k] = d + res[k]
            else:
                out[k] = v
        for k, r in res.items():
            if k not in out:
                out[k] = r.clone()
        return out

    def update(self, sent_delta: Mapping, decoded_delta: Mapping[str, torch.Tensor]) -> None:
        """Store ``e = sent - decoded`` for every name of ``sent_delta`` whose ``e`` is not zero.

        ``decoded_delta`` may be a ``DecodedPayload``: then one tensor is decoded at a time, and LoRA factors
        sent as factors are compared as factors (no dense copy of the delta at any point)."""
        from safetensors.torch import save_file

        res = {}
        for k, v in sent_delta.items():
            if k not in decoded_delta:
                raise KeyError(f"decoded delta lacks {k!r}, which was sent")
            if hasattr(v, "A") and hasattr(decoded_delta[k], "A"):
                # LoRA factors kept as factors: their rounding (fp16/bf16, ~1e-3 relative) is not carried. It
                # could only be carried densely, which would make every later round's delta dense and send it
                # 1-bit coded, a thousand times lossier than the rounding it carried (and hold a dense copy).
                continue
            if _identical(v, decoded_delta[k]):
                continue  # sent losslessly: nothing to carry
            s = dense_delta(v).float()
            d = dense_delta(decoded_delta[k]).float()
            if tuple(s.shape) != tuple(d.shape):
                raise ValueError(f"{k!r}: sent shape {tuple(s.shape)} != decoded shape {tuple(d.shape)}")
            r = s - d
            del s, d
            if bool(r.any()):  # an all-zero residual would only make the next round's delta dense
                res[k] = r.contiguous()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        save_file(res, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def reset(self) -> None:
        """Forget the residual (e.g. when the base changes shape or the client starts over)."""
        self.path.unlink(missing_ok=True)


def _identical(sent, decoded) -> bool:
    """Whether the codec returned exactly what was sent (same LoRA factors, or the same tensor)."""
    if hasattr(sent, "A") and hasattr(decoded, "A"):
        return (sent.A.shape == decoded.A.shape and sent.B.shape == decoded.B.shape
                and torch.equal(sent.A, decoded.A.to(sent.A.dtype)) and torch.equal(sent.B, decoded.B.to(sent.B.dtype)))
    if isinstance(sent, torch.Tensor) and isinstance(decoded, torch.Tensor):
        return sent.shape == decoded.shape and torch.equal(sent, decoded.to(sent.dtype))
    return False


class DecodedPayload(Mapping):
    """A payload's tensors decoded one at a time when read; ``lora`` entries as their factors."""

    def __init__(self, payload) -> None:
        from zoo_gym import codec

        self._codec, self._payload = codec, payload
        self._manifest = codec.read_manifest(payload)
        self._entries = {e.name: e for e in self._manifest.entries}

    def __getitem__(self, name: str):
        e = self._entries[name]
        if e.codec == "lora":
            return self._codec.decode_factors(self._payload, name, manifest=self._manifest)
        return self._codec.decode_tensor(self._payload, name, manifest=self._manifest)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
