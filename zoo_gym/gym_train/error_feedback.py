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

from .evaluate import dense_delta


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
        """Store ``e = sent - decoded`` for every name of ``sent_delta``."""
        from safetensors.torch import save_file

        res = {}
        for k, v in sent_delta.items():
            if k not in decoded_delta:
                raise KeyError(f"decoded delta lacks {k!r}, which was sent")
            s = dense_delta(v).float()
            d = dense_delta(decoded_delta[k]).float()
            if tuple(s.shape) != tuple(d.shape):
                raise ValueError(f"{k!r}: sent shape {tuple(s.shape)} != decoded shape {tuple(d.shape)}")
            res[k] = (s - d).contiguous()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        save_file(res, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def reset(self) -> None:
        """Forget the residual (e.g. when the base changes shape or the client starts over)."""
        self.path.unlink(missing_ok=True)
