"""Server settings: one dataclass, filled from defaults, then a TOML/YAML file, then command-line flags.

Keys in a file may use dashes or underscores (``min-contributors`` == ``min_contributors``). Aggregation
and privacy keys (``aggregator``, ``byzantine-f``, ``dp-noise-multiplier`` ...) go to DeltaSoup's
SoupConfig; rewards keys (``reward-pool`` ...) to the rewards settings. Unknown keys are an error that
names the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo_gym.settings_file import SettingsFileError, read_settings_file

MiB = 1 << 20


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range; the message names it."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    min_contributors: int = field(default=3, metadata={"help": "a round never closes with fewer submissions"})
    quorum: int | None = field(default=None, metadata={"help": "close as soon as this many are in (default: min)"})
    round_timeout: float = field(default=600.0, metadata={"help": "seconds; then close once min_contributors are in"})
    max_payload_bytes: int = 2048 * MiB
    max_chunk_bytes: int = 4 * MiB
    download_chunk_bytes: int = 1 * MiB
    # Capacity (zoo_gym/server/upload_slots.py): the worker pool is max_uploads + max_pending_headers +
    # query_workers, so uploads never take the threads that health checks and queries answer on.
    max_uploads: int = field(default=32, metadata={"help": "uploads in progress at once (then RESOURCE_EXHAUSTED)"})
    max_pending_headers: int = field(default=8, metadata={
        "help": "upload streams at once that have not yet sent a verified header"})
    max_pending_headers_per_peer: int = field(default=4, metadata={
        "help": "the same, from one peer address"})
    header_timeout: float = field(default=10.0, metadata={
        "help": "seconds an upload stream may take to send its signed header before it is dropped"})
    query_workers: int = field(default=16, metadata={
        "help": "threads kept for everything but uploads (health, GetRound, Register, balance, ledger, download)"})
    ssl_certfile: str | None = field(default=None, metadata={"help": "PEM certificate (chain) the server presents"})
    ssl_keyfile: str | None = field(default=None, metadata={"help": "PEM private key of ssl_certfile"})
    ssl_ca_certfile: str | None = field(default=None, metadata={"help": "PEM CA certificate sent with the chain"})
    insecure: bool = field(default=False, metadata={"help": "plaintext gRPC (only on a network you trust)"})
    upload_idle_timeout: float = field(default=60.0, metadata={
        "help": "seconds an upload may send no bytes before it is refused and its temporary file removed"})
    upload_min_bytes_per_s: int = field(default=64 * 1024, metadata={
        "help": "slowest accepted upload: the whole stream must finish within "
                "upload_idle_timeout + payload_size / this rate"})
    admission: str = field(default="open", metadata={
        "help": "open: any new key may register (rate-limited); invite: a new key must spend a `gym-server invite`"})
    register_rate_per_peer: float = field(default=10.0, metadata={
        "help": "new contributors per minute one address (IPv6: one /64) may register, after its burst"})
    register_burst_per_peer: int = field(default=20, metadata={"help": "new contributors one address may register at once"})
    register_rate_global: float = field(default=120.0, metadata={"help": "new contributors per minute, all addresses"})
    register_burst_global: int = field(default=200, metadata={"help": "new contributors at once, all addresses"})
    validation_file: str | None = field(default=None, metadata={"help": "held-out examples (alpaca/sharegpt)"})
    validation_examples: int = 128
    # DeltaSoup (zoo_gym.aggregation.SoupConfig) keys, validated there.
    soup: dict[str, Any] = field(default_factory=dict)
    # zoo_gym.rewards settings, validated there.
    rewards: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("`port` must be in [0, 65535] (0 picks a free port)")
        if self.min_contributors < 1:
            raise ConfigError("`min_contributors` must be >= 1")
        if self.quorum is not None and self.quorum < self.min_contributors:
            raise ConfigError("`quorum` must be >= `min_contributors`")
        if self.round_timeout <= 0:
            raise ConfigError("`round_timeout` must be > 0 seconds")
        if not 1 <= self.max_chunk_bytes <= 64 * MiB:
            raise ConfigError("`max_chunk_bytes` must be in [1, 64 MiB]")
        if not 1 <= self.download_chunk_bytes <= 64 * MiB:
            raise ConfigError("`download_chunk_bytes` must be in [1, 64 MiB]")
        if self.max_payload_bytes < 1:
            raise ConfigError("`max_payload_bytes` must be >= 1")
        if self.insecure and (self.ssl_certfile or self.ssl_keyfile or self.ssl_ca_certfile):
            raise ConfigError("`insecure` (plaintext) and TLS certificates contradict each other: give one or the other")
        if not self.upload_idle_timeout > 0:
            raise ConfigError("`upload_idle_timeout` must be > 0 seconds")
        if self.upload_min_bytes_per_s < 1:
            raise ConfigError("`upload_min_bytes_per_s` must be >= 1 byte per second")
        for name in ("max_uploads", "max_pending_headers", "max_pending_headers_per_peer", "query_workers"):
            if not 1 <= getattr(self, name) <= 4096:
                raise ConfigError(f"`{name}` must be in [1, 4096]")
        if not self.header_timeout > 0:
            raise ConfigError("`header_timeout` must be > 0 seconds")
        if self.admission not in ("open", "invite"):
            raise ConfigError(f"`admission` must be open or invite, got {self.admission!r}")
        for name in ("register_rate_per_peer", "register_rate_global"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"`{name}` must be > 0 new contributors per minute")
        for name in ("register_burst_per_peer", "register_burst_global"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be >= 1")

    @property
    def effective_quorum(self) -> int:
        return self.quorum if self.quorum is not None else self.min_contributors

    def check_transport(self) -> None:
        """TLS unless plaintext was asked for: a server given neither certificates nor `insecure` refuses."""
        if not self.insecure and not (self.ssl_certfile and self.ssl_keyfile):
            raise ConfigError("gym-server serves TLS by default: give --ssl-certfile and --ssl-keyfile (`gym-server "
                              "tls-cert --out DIR --host NAME` makes a private CA and a certificate), or --insecure "
                              "for plaintext on a network you trust")

    def upload_deadline_s(self, payload_size: int) -> float:
        """Seconds a whole upload of `payload_size` bytes may take before it is refused."""
        return self.upload_idle_timeout + payload_size / self.upload_min_bytes_per_s

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def _norm(key: str) -> str:
    return key.strip().replace("-", "_")


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML (.toml) or YAML (.yaml/.yml) file into a flat dict with normalised keys."""
    try:
        raw = read_settings_file(path)
    except SettingsFileError as exc:
        raise ConfigError(str(exc)) from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and _norm(key) in ("server", "aggregation", "soup", "rewards", "privacy"):
            for k, v in value.items():  # sections are only for readability
                flat[_norm(k)] = v
        else:
            flat[_norm(key)] = value
    return flat


def build_config(file_values: dict[str, Any] | None = None, **flags: Any) -> ServerConfig:
    """Defaults < file values < flags (flags that are None are 'not given')."""
    merged: dict[str, Any] = dict(file_values or {})
    merged.update({_norm(k): v for k, v in flags.items() if v is not None})
    from zoo_gym.aggregation import SoupConfig

    own = {f.name for f in dataclasses.fields(ServerConfig)} - {"soup", "rewards"}
    soup = {f.name for f in dataclasses.fields(SoupConfig)}
    kwargs: dict[str, Any] = {"soup": {}, "rewards": {}}
    for key, value in merged.items():
        if key in own:
            kwargs[key] = value
        elif key in soup:
            kwargs["soup"][key] = value
        else:  # validated by zoo_gym.server.settlement.validate_rewards_settings (unknown keys are errors)
            kwargs["rewards"][key] = value
    try:
        return ServerConfig(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def check_round_size(soup, min_contributors: int) -> None:
    """Refuse a --min-contributors too small for the robust rule to work with (named in the message)."""
    from zoo_gym.aggregation.bulyan import check_bulyan_config
    from zoo_gym.aggregation.krum import check_krum_config
    from zoo_gym.aggregation.trimmed_mean import trim_count

    try:
        if soup.aggregator in ("krum", "multi-krum"):
            check_krum_config(n=min_contributors, f=soup.byzantine_f, rule=soup.aggregator)
        elif soup.aggregator == "bulyan":
            check_bulyan_config(n=min_contributors, f=soup.byzantine_f)
        elif soup.aggregator == "trimmed-mean":
            trim_count(n=min_contributors, beta=soup.trim_beta)
    except ValueError as exc:
        raise ConfigError(f"--min-contributors {min_contributors} is too few for --aggregator "
                          f"{soup.aggregator}: {exc}") from exc
