"""`gym-serve`'s settings, declared once: each field is a flag ``--max-batch``, a ``--config`` file key
``max_batch``/``max-batch`` and an environment variable ``ZOO_GYM_MAX_BATCH`` (zoo_gym.settings).

Precedence: flag > environment > file > default. ``base`` has no default: it must be given one of the three ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
LOG_FORMATS = ("text", "json")


def _s(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help, "section": "Serving"})


@dataclass(frozen=True)
class ServeSettings:
    base: str | None = _s(None, "The base model: 'tiny' or 'smollm2-135m' (built in), a Hugging Face "
                                "directory, a .gguf file, or a hub id already in your cache (required).")
    variants: str | None = _s(None, "Directory of NAME.zgd variants (watched: files added or removed are picked up).")
    host: str = _s("127.0.0.1", "Address to listen on.")
    port: int = _s(8000, "Port (0: a free one, printed at start).")
    max_variant_bytes: int | None = _s(None, "Memory budget for loaded variants (packed signs + scales); least "
                                             "recently used ones are unloaded (unset: no limit).")
    max_batch: int = _s(16, "Most requests decoded in one batch.")
    batch_window_ms: float = _s(5.0, "How long a batch waits for more requests.")
    max_tokens: int = _s(512, "Most tokens one request may generate.")
    device: str = _s("cpu", "cpu or cuda.")
    dtype: str = _s("float32", "float32, bfloat16 or float16 for the base's weights.")
    base_name: str | None = _s(None, "The `model` id of the base alone (unset: its directory name).")
    api_key: str | None = _s(None, "Clients must send `Authorization: Bearer KEY` on every /v1 route, inference "
                                   "and variant management (unset: no key, and variants are managed from "
                                   "localhost only).")
    max_body_bytes: int = _s(1_000_000, "Largest request body accepted (413 beyond it, before parsing).")
    log_format: str = _s("text", "text or json (one JSON object per line on stderr, uvicorn's logs included).")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be from 0 to 65535, got {self.port}")
        for name, low in (("max_variant_bytes", 1), ("max_batch", 1), ("batch_window_ms", 0.0), ("max_tokens", 1),
                          ("max_body_bytes", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
        if self.dtype not in DTYPES:
            raise ValueError("--dtype must be float32, bfloat16 or float16")
        if self.device not in DEVICES:
            raise ValueError("--device must be cpu or cuda")
        if self.log_format not in LOG_FORMATS:
            raise ValueError("--log-format must be text or json")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
