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
    min_contributors: int = field(default=3, metadata={
        "help": "submissions a round waits for until its timeout; then it closes with fewer if the rule can run"})
    quorum: int | None = field(default=None, metadata={"help": "close as soon as this many are in (default: min)"})
    round_timeout: float = field(default=600.0, metadata={"help": "seconds; then close once min_contributors are in"})
    max_payload_bytes: int = 2048 * MiB
    max_chunk_bytes: int = 4 * MiB
    download_chunk_bytes: int = 1 * MiB
    # Capacity (zoo_gym/server/transport/upload_slots.py): the worker pool is max_uploads + max_pending_headers +
    # query_workers, so uploads never take the threads that health checks and queries answer on.
    max_uploads: int = field(default=32, metadata={"help": "uploads in progress at once (then RESOURCE_EXHAUSTED)"})
    max_pending_headers: int = field(default=64, metadata={
        "help": "calls at once whose first message (an upload's verified header, a unary call's request) "
                "has not arrived"})
    max_pending_headers_per_peer: int = field(default=8, metadata={
        "help": "the same, from one peer address"})
    header_timeout: float = field(default=10.0, metadata={
        "help": "seconds a call may take to send its first message (an upload's signed header) before it is "
                "dropped"})
    query_workers: int = field(default=16, metadata={
        "help": "threads kept for everything but uploads and downloads (health, GetRound, Register, balance)"})
    # Server-streamed calls (zoo_gym/server/transport/download_slots.py) have their own slots and threads on top.
    max_downloads: int = field(default=32, metadata={
        "help": "checkpoint downloads and ledger streams in progress at once (then RESOURCE_EXHAUSTED)"})
    download_idle_timeout: float = field(default=60.0, metadata={
        "help": "seconds a download's reader may take nothing before the download is cancelled"})
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
    # Asynchronous buffered rounds (zoo_gym/server/rounds/async_rounds.py): FedBuff (Nguyen et al., 2022) with
    # FedAsync's polynomial staleness weight (Xie et al., 2019), under the configured robust rule.
    mode: str = field(default="sync", metadata={
        "help": "sync: rounds close at quorum or timeout; async: a version is published every buffer_size deltas"})
    buffer_size: int = field(default=3, metadata={
        "help": "async: deltas aggregated per published version (the robust rule's f counts per buffer)"})
    max_staleness: int = field(default=4, metadata={
        "help": "async: a delta may be against any of the last max_staleness published bases (versions)"})
    server_lr: float = field(default=1.0, metadata={
        "help": "async: the server learning rate eta; a flush adds eta x the aggregate to the current base"})
    staleness_exponent: float = field(default=3.0, metadata={
        "help": "async: a delta s versions old is weighted (1 + s) ** -staleness_exponent (0: no discount)"})
    staleness_normalize: bool = field(default=True, metadata={
        "help": "async: scale each flush by K / the sum of its buffer's staleness weights, so that the weights set "
                "each delta's share (a staleness-weighted average) instead of shrinking the step; false: "
                "FedBuff's sum / K. Ignored under DP"})
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
        for name in ("max_uploads", "max_pending_headers", "max_pending_headers_per_peer", "query_workers",
                     "max_downloads"):
            if not 1 <= getattr(self, name) <= 4096:
                raise ConfigError(f"`{name}` must be in [1, 4096]")
        if not self.header_timeout > 0:
            raise ConfigError("`header_timeout` must be > 0 seconds")
        if not self.download_idle_timeout > 0:
            raise ConfigError("`download_idle_timeout` must be > 0 seconds")
        if self.admission not in ("open", "invite"):
            raise ConfigError(f"`admission` must be open or invite, got {self.admission!r}")
        for name in ("register_rate_per_peer", "register_rate_global"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"`{name}` must be > 0 new contributors per minute")
        for name in ("register_burst_per_peer", "register_burst_global"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be >= 1")
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"`mode` must be sync or async, got {self.mode!r}")
        if not 1 <= self.buffer_size <= 4096:
            raise ConfigError("`buffer_size` must be in [1, 4096] deltas")
        if not 0 <= self.max_staleness <= 1_000_000:
            raise ConfigError("`max_staleness` must be in [0, 1000000] versions")
        if not 0 < self.server_lr < float("inf"):
            raise ConfigError("`server_lr` must be a finite number > 0")
        if not 0 <= self.staleness_exponent < float("inf"):
            raise ConfigError("`staleness_exponent` must be a finite number >= 0")

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


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _check_type(key: str, value: Any, hint: Any) -> None:
    """ConfigError naming `key` and the type it needs, for the plain types (int, float, str, bool, optional)."""
    import types
    import typing

    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    optional = type(None) in args
    wanted = [a for a in args if a is not type(None)]
    if len(wanted) != 1 or wanted[0] not in _TYPE_NAMES or (value is None and optional):
        return
    want = wanted[0]
    ok = (isinstance(value, bool) if want is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else
          isinstance(value, want) and not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"`{key}` must be {_TYPE_NAMES[want]}{' or empty' if optional else ''}, got {value!r} "
                          f"({type(value).__name__})")


def _rewards_key(key: str, value: Any) -> bool:
    """Whether zoo_gym.server.rounds.settlement accepts `key` as a rewards setting (it validates the values)."""
    from zoo_gym.server.rounds.settlement import validate_rewards_settings

    try:
        validate_rewards_settings(ServerConfig(rewards={key: value}))
    except ConfigError as exc:
        return not str(exc).startswith("unknown setting")
    return True


def _rewards_keys() -> set[str]:
    from zoo_gym.rewards import ReputationConfig
    from zoo_gym.server.rounds.settlement import _DEFAULTS

    return set(_DEFAULTS) | {"min_quality"} | {f"reputation_{f.name}" for f in dataclasses.fields(ReputationConfig)}


def _unknown_key(key: str, valid: set[str]) -> ConfigError:
    import difflib

    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.75)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return ConfigError(f"unknown setting `{key}`{hint} (valid settings: {', '.join(sorted(valid))}; dashes or "
                       "underscores alike)")


def build_config(file_values: dict[str, Any] | None = None, **flags: Any) -> ServerConfig:
    """Defaults < file values < flags (flags that are None are 'not given'). A value of the wrong type is an
    error naming its key and the type it needs; an unknown key one that names the closest valid key."""
    import typing

    merged: dict[str, Any] = {_norm(k): v for k, v in (file_values or {}).items()}
    merged.update({_norm(k): v for k, v in flags.items() if v is not None})
    from zoo_gym.aggregation import SoupConfig

    own = {f.name for f in dataclasses.fields(ServerConfig)} - {"soup", "rewards"}
    soup = {f.name for f in dataclasses.fields(SoupConfig)}
    hints = {**typing.get_type_hints(SoupConfig), **typing.get_type_hints(ServerConfig)}
    kwargs: dict[str, Any] = {"soup": {}, "rewards": {}}
    for key, value in merged.items():
        if key in own or key in soup:
            _check_type(key, value, hints.get(key))
        if key in own:
            kwargs[key] = value
        elif key in soup:
            kwargs["soup"][key] = value
        elif key in _rewards_keys() or _rewards_key(key, value):  # their values: validate_rewards_settings
            kwargs["rewards"][key] = value
        else:
            raise _unknown_key(key, own | soup | _rewards_keys())
    try:
        return ServerConfig(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def round_size_error(soup, n: int) -> str | None:
    """Why the configured rule cannot aggregate `n` deltas (None: it can)."""
    from zoo_gym.aggregation.bulyan import check_bulyan_config
    from zoo_gym.aggregation.krum import check_krum_config
    from zoo_gym.aggregation.trimmed_mean import trim_count

    try:
        if n < 1:
            return "there is nothing to aggregate"
        if soup.aggregator in ("krum", "multi-krum"):
            check_krum_config(n=n, f=soup.byzantine_f, rule=soup.aggregator)
        elif soup.aggregator == "bulyan":
            check_bulyan_config(n=n, f=soup.byzantine_f)
        elif soup.aggregator == "trimmed-mean":
            trim_count(n=n, beta=soup.trim_beta)
    except ValueError as exc:
        return str(exc)
    return None


def rule_minimum(soup, *, limit: int = 4096) -> int:
    """The fewest deltas the configured robust rule can aggregate (e.g. Krum with f: 2f + 3)."""
    return next((n for n in range(1, limit + 1) if round_size_error(soup, n) is None), limit)


def check_round_size(soup, min_contributors: int, *, flag: str = "--min-contributors") -> None:
    """Refuse a --min-contributors (or --buffer-size) too small for the robust rule (named in the message)."""
    error = round_size_error(soup, min_contributors)
    if error is not None:
        raise ConfigError(f"{flag} {min_contributors} is too few for --aggregator {soup.aggregator}: {error}")
