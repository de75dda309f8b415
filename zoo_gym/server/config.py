"""The server's settings, declared once: `ServerConfig`'s fields (with DeltaSoup's `SoupConfig` and the rewards
settings as sections) are the CLI flags of `gym-server serve`, the config-file keys and the `ZOO_GYM_<KEY>`
environment variables, with their defaults and help (zoo_gym/settings.py derives all of them).

Precedence: flag > environment > file > default. File keys may use dashes or underscores and may sit in the
sections `server`, `aggregation`, `soup`, `rewards` or `privacy` (for readability only); an unknown key is an
error naming the closest valid one, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from zoo_gym.aggregation import SoupConfig
from zoo_gym.rewards import ScoringConfig, SettlementConfig
from zoo_gym.rewards.scoring import SCORING_METRICS
from zoo_gym.settings import SettingError, collect, leaves, norm_key, resolve
from zoo_gym.settings_file import SettingsFileError, read_settings_file

MiB = 1 << 20
MIN_TOKEN_CHARS = 16  # a dashboard bearer token's shortest length
TOKEN_CHARS = re.compile(r"^[!-~]+$")  # printable ASCII, no spaces: what an Authorization header carries as is


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, [v6] bracketed or not, or "localhost") is reachable from this machine only."""
    bare = host.strip().strip("[]")
    if bare.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class ConfigError(SettingError):
    """A setting is missing, unknown or out of range; the message names it."""


@dataclass
class RewardsSettings:
    """How a round's contributions are scored and paid (zoo_gym.rewards)."""

    reward_pool: int = field(default=1000, metadata={"help": "integer reward units split each round"})
    reputation_weighting: bool = field(default=True, metadata={
        "help": "weight each delta in the aggregation by its sender's reputation"})
    scoring_method: str = field(default="first-order", metadata={
        "help": "first-order (one gradient of the held-out loss) or exact (forward passes per subset)"})
    scoring_marginal: str = field(default="gtg_shapley", metadata={
        "help": "marginal contribution: gtg_shapley, leave_one_out or none"})
    scoring_max_evaluations: int = field(default=32, metadata={
        "help": "exact scoring: held-out evaluations per round at most"})
    scoring_metric: str = field(default="loss", metadata={
        "help": "what contributions are scored on: loss (the validation completion loss) or exact-match (the "
                "share of validation answers greedy decoding writes exactly: for a verifiable task with short "
                "reference answers; needs --scoring-method exact)"})
    scoring_subsets: str = field(default="mean", metadata={
        "help": "exact scoring: a subset's aggregate is its members' report-weighted mean (mean) or the round's own "
                "rule over them, without DP noise (rule: leave-one-out then measures what each delta changed in the "
                "release; subsets too small for the rule take the mean)"})
    scoring_examples: int = field(default=32, metadata={
        "help": "validation examples (the first N, at most --validation-examples) rewards are scored on; exact "
                "scoring makes one forward pass over them per evaluation"})
    scoring_min_marginal_z: float = field(default=ScoringConfig.min_marginal_z, metadata={
        "help": "exact-match scoring: a contribution is paid only when its marginal gain is more than this many "
                "standard errors (over the scoring examples) above 0; 0 pays any positive gain"})
    settlement: SettlementConfig = field(default_factory=SettlementConfig)

    def __post_init__(self) -> None:
        if self.scoring_method not in ("first-order", "exact"):
            raise ConfigError("`scoring_method` must be 'first-order' (one gradient, default) or 'exact'")
        if self.scoring_metric not in SCORING_METRICS:
            raise ConfigError(f"`scoring_metric` must be one of {', '.join(SCORING_METRICS)}, "
                              f"got {self.scoring_metric!r}")
        if self.scoring_metric == "exact-match" and self.scoring_method != "exact":
            raise ConfigError("`scoring_metric` exact-match needs `scoring_method` exact (a share of exact answers "
                              "has no gradient): add --scoring-method exact")
        if self.scoring_subsets not in ("mean", "rule"):
            raise ConfigError(f"`scoring_subsets` must be 'mean' or 'rule', got {self.scoring_subsets!r}")
        if self.scoring_examples < 1:
            raise ConfigError(f"`scoring_examples` must be >= 1, got {self.scoring_examples}")
        if self.reward_pool < 0:
            raise ConfigError("`reward_pool` must be >= 0")
        self.scoring  # checks marginal and max_evaluations

    @property
    def scoring(self) -> ScoringConfig:
        return ScoringConfig(marginal=self.scoring_marginal, max_evaluations=self.scoring_max_evaluations,
                             min_marginal_z=self.scoring_min_marginal_z)


@dataclass
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50051, metadata={"help": "port to bind; 0 picks a free one"})
    min_contributors: int = field(default=3, metadata={
        "help": "submissions a round waits for until its timeout; then it closes with fewer if the rule can run"})
    quorum: int | None = field(default=None, metadata={"help": "close as soon as this many are in (default: min)"})
    round_timeout: float = field(default=600.0, metadata={"help": "seconds; then close once min_contributors are in"})
    max_payload_bytes: int = field(default=2048 * MiB, metadata={"help": "largest delta upload accepted, in bytes"})
    max_chunk_bytes: int = field(default=4 * MiB, metadata={"help": "largest upload message, in bytes (<= 64 MiB)"})
    download_chunk_bytes: int = field(default=1 * MiB, metadata={
        "help": "bytes per message of a checkpoint download (<= 64 MiB)"})
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
    mirrors: list[str] = field(default_factory=list, metadata={
        "help": "base URL of an HTTP(S) mirror of the published checkpoints (repeat --mirror for several; file "
                "key mirrors = [...]): a checkpoint is fetched from URL/<sha256>, so serve a directory that "
                "`gym-server mirror-sync DIR` fills. Signed into RoundInfo; clients try the mirrors in order, "
                "keep only bytes hashing to the signed sha256 and fall back to this server",
        "aliases": ("mirror",)})
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
    register_rate_global: float = field(default=120.0, metadata={
        "help": "uninvited new contributors per minute on average, all addresses and ingest processes together"})
    register_burst_global: int = field(default=200, metadata={
        "help": "uninvited new contributors at most in any burst / rate minutes, all addresses together"})
    sample_rate: float = field(default=1.0, metadata={
        "help": "each round, select each contributor registered before it opened with this probability, from "
                "the server's secret key (Poisson sampling; the accountant charges q); only the selected may "
                "submit. 1 = everyone (no sampling)"})
    # Asynchronous buffered rounds (zoo_gym/server/rounds/async_rounds.py): FedBuff (Nguyen et al., 2022) with
    # FedAsync's polynomial staleness weight (Xie et al., 2019), under the configured robust rule.
    mode: str = field(default="sync", metadata={
        "help": "sync: rounds close at quorum or timeout; async: a version is published every buffer_size deltas"})
    buffer_size: int = field(default=3, metadata={
        "help": "async: deltas aggregated per published version (the robust rule's f counts per buffer)"})
    max_staleness: int = field(default=4, metadata={
        "help": "async: a delta may be against any of the last max_staleness published bases (versions)"})
    server_lr: float = field(default=1.0, metadata={
        "help": "the server learning rate eta: each round (or async flush) adds eta x the aggregate to the base. "
                "Post-processing of the release, so free in epsilon; > 1 extrapolates a small averaged step "
                "(FedOpt, Reddi et al. 2021). Recorded when a round closes and signed into RoundInfo"})
    client_lr_decay: float = field(default=0.0, metadata={
        "help": "round r asks every contributor to train at its learning rate x 1 / (1 + d x (r - 1)) (signed into "
                "RoundInfo; 0: no schedule). d = 1 halves it in round 2 and thirds it in round 3 (measured: "
                "docs/measurements/learning.md)"})
    staleness_exponent: float = field(default=3.0, metadata={
        "help": "async: a delta s versions old is weighted (1 + s) ** -staleness_exponent (0: no discount)"})
    staleness_normalize: bool = field(default=True, metadata={
        "help": "async: scale each flush by K / the sum of its buffer's staleness weights, so that the weights set "
                "each delta's share (a staleness-weighted average) instead of shrinking the step; false: "
                "FedBuff's sum / K. Ignored under DP"})
    validation_data: str | None = field(default=None, metadata={
        "help": "held-out examples every checkpoint is evaluated on: alpaca or sharegpt records, .json or .jsonl "
                "(default: the file given to `init`, else the built-in task's validation set). Preference pairs "
                "(instruction/input or prompt, with chosen and rejected strings) add preference_accuracy (share "
                "of pairs whose chosen answer is more likely than the rejected one) and preference_margin (mean "
                "log-likelihood difference) to each checkpoint's report, and contributions are then scored on "
                "the pairs' loss mean(-log sigmoid(margin)); the held-out loss runs on the other records (on "
                "the chosen answers when all are pairs)",
        "aliases": ("validation_file",)})
    validation_examples: int = field(default=128, metadata={
        "help": "held-out examples evaluated per checkpoint (0: no evaluation and no scoring)"})
    evaluation_dtype: str = field(default="auto", metadata={
        "help": "what the held-out evaluation and the scoring gradient multiply in: bfloat16 (the checkpoint's "
                "bf16 weights as stored, float32 accumulation, norms and residual stream in float32), float32, "
                "or auto: bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), float32 "
                "elsewhere (emulated bf16 is slower than float32). Exact checks of base + delta always run in "
                "float32"})
    keep_checkpoints: int | None = field(default=None, metadata={
        "help": "published checkpoints whose files are kept besides the genesis; after each publish the older "
                "ones' archives and float32 masters, and the uploads of the rounds built on them, are removed "
                "(their rows, the lineage and the ledger stay; a pull of one is answered NOT_FOUND). Default: all"})
    # Aggregation sharded on Ray (zoo_gym/server/rounds/ray_engine.py, docs/design/SCALE-OUT.md step 2)
    aggregation_engine: str = field(default="local", metadata={
        "help": "local: this process aggregates tensor by tensor; ray: one Ray task per (tensor, row block), each "
                "reading the uploads and the base from the state directory (which every Ray node must mount at "
                "the same path) and writing its rows of the new checkpoint in place; the same bytes as local. "
                "Needs the ray extra (pip install 'zoo-gym[ray]')", "section": "Aggregation engine"})
    ray_address: str | None = field(default=None, metadata={
        "help": "the Ray cluster to join (e.g. 10.0.0.5:6379 or auto); default: start a local one",
        "section": "Aggregation engine"})
    ray_block_rows: int = field(default=4096, metadata={
        "help": "tensor rows per Ray task (a 2-D tensor's first dimension; 1-D: elements)",
        "section": "Aggregation engine"})
    ray_task_memory_mb: int = field(default=2048, metadata={
        "help": "memory one Ray task may use: a block's rows x (contributors x 16 + 20) bytes (its rows are decoded "
                "alone), checked before the round's tasks start (lower ray_block_rows when it does not fit)",
        "section": "Aggregation engine"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR", "section": "Output"})
    log_format: str = field(default="text", metadata={
        "help": "text, or json (one object a line, with the event's fields)", "section": "Output"})
    dashboard_port: int = field(default=0, metadata={
        "help": "serve the read-only web dashboard, its JSON API and /metrics on this port of dashboard_host "
                "(over TLS when serving TLS); 0 = off", "section": "Output"})
    dashboard_host: str = field(default="127.0.0.1", metadata={
        "help": "address the dashboard binds, loopback by default whatever --host is: its pages show "
                "per-contributor figures (pay, scores, reputations) that the DP epsilon does not cover. With "
                "server DP on, another address needs dashboard_token_file", "section": "Output"})
    dashboard_token_file: str | None = field(default=None, metadata={
        "help": "file holding a bearer token (at least 16 characters): every dashboard page, API call and "
                "/metrics then needs the header `Authorization: Bearer TOKEN` (401 otherwise)",
        "section": "Output"})
    # SoupConfig's own `min_contributors` (its refusal floor) stays at its default: the server's is above
    soup: SoupConfig = field(default_factory=SoupConfig, metadata={"section": "Aggregation and privacy",
                                                                   "exclude": ("min_contributors",)})
    rewards: RewardsSettings = field(default_factory=RewardsSettings, metadata={"section": "Rewards"})

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
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"`sample_rate` must be in (0, 1] (1 = every contributor, no sampling), "
                              f"got {self.sample_rate}")
        if self.soup.rule.needs_reference and self.validation_examples <= 0:
            raise ConfigError(f"`aggregator` {self.soup.aggregator} weighs each delta by its agreement with the "
                              "validation set's descent direction: it needs `validation_examples` > 0")
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
        if not 1 <= self.buffer_size <= 1_000_000:  # a flush of 10,000 is one planned population (issue 51)
            raise ConfigError("`buffer_size` must be in [1, 1000000] deltas")
        if not 0 <= self.max_staleness <= 1_000_000:
            raise ConfigError("`max_staleness` must be in [0, 1000000] versions")
        if not 0 < self.server_lr < float("inf"):
            raise ConfigError("`server_lr` must be a finite number > 0")
        if not 0 <= self.client_lr_decay < float("inf"):
            raise ConfigError("`client_lr_decay` must be a finite number >= 0 (0: every round at the contributors' "
                              "own learning rate)")
        if not 0 <= self.staleness_exponent < float("inf"):
            raise ConfigError("`staleness_exponent` must be a finite number >= 0")
        if self.evaluation_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"`evaluation_dtype` must be auto, float32 or bfloat16, got {self.evaluation_dtype!r}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ConfigError("`keep_checkpoints` must be >= 1 (the current base is always kept), or unset to keep all")
        if self.keep_checkpoints is not None and self.mode == "async" and self.keep_checkpoints <= self.max_staleness:
            raise ConfigError(f"`keep_checkpoints` must be >= max_staleness + 1 ({self.max_staleness + 1}) in async "
                              "mode: a delta may be against any of the last max_staleness published bases")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"`log_level` must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"`log_format` must be text or json, got {self.log_format!r}")
        self._check_dashboard()
        self._check_mirrors()
        self._check_engine()

    def _check_engine(self) -> None:
        """local or ray; ray installed (found, not imported: light commands stay light)."""
        if self.aggregation_engine not in ("local", "ray"):
            raise ConfigError(f"`aggregation_engine` must be local or ray, got {self.aggregation_engine!r}")
        if self.ray_block_rows < 1 or self.ray_task_memory_mb < 1:
            raise ConfigError("`ray_block_rows` and `ray_task_memory_mb` must be >= 1")
        if self.aggregation_engine == "local":
            if self.ray_address is not None:
                raise ConfigError("`ray_address` is for `aggregation_engine` ray (the default engine is local)")
            return
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("`aggregation_engine` ray needs Ray, which is not installed: pip install 'zoo-gym[ray]'")

    def _check_mirrors(self) -> None:
        """Each mirror an absolute http(s) URL with a host, stored without a trailing slash."""
        cleaned = []
        for url in self.mirrors:
            parts = urlsplit(url.strip())
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
                raise ConfigError(f"`mirror` {url!r} must be an http:// or https:// base URL without query or "
                                  "fragment, e.g. https://mirror.example.org/zoo-gym (a checkpoint is at "
                                  "URL/<sha256>)")
            cleaned.append(url.strip().rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ConfigError(f"`mirror` names a URL twice: {cleaned}")
        self.mirrors = cleaned

    def _check_dashboard(self) -> None:
        """Port in range; with the dashboard on, a readable token when one is named, and with server DP on no
        per-person figures on a non-loopback address without one (docs/design/privacy.md: the operator's own
        surfaces)."""
        if not 0 <= self.dashboard_port <= 65535:
            raise ConfigError("`dashboard_port` must be in [0, 65535] (0: no dashboard)")
        if not self.dashboard_host.strip():
            raise ConfigError("`dashboard_host` must be an address to bind, e.g. 127.0.0.1 (the default)")
        if self.dashboard_port:  # the token is read only for a dashboard that runs
            self.dashboard_token()
        if (self.dashboard_port and self.soup.dp_enabled and not is_loopback(self.dashboard_host)
                and self.dashboard_token_file is None):
            raise ConfigError(
                f"with server DP on, the dashboard on {self.dashboard_host} would publish per-contributor figures "
                "the epsilon does not cover: bind it to loopback (--dashboard-host 127.0.0.1, the default) or "
                "require a bearer token (--dashboard-token-file FILE, at least 16 characters)")

    def dashboard_token(self) -> str | None:
        """The bearer token in `dashboard_token_file` (whitespace around it stripped), None without one."""
        if self.dashboard_token_file is None:
            return None
        path = Path(self.dashboard_token_file).expanduser()
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"`dashboard_token_file` {path}: cannot read it ({why}); write a token of at least "
                              f"{MIN_TOKEN_CHARS} characters into it") from None
        if len(token) < MIN_TOKEN_CHARS or not TOKEN_CHARS.match(token):
            raise ConfigError(f"`dashboard_token_file` {path} must hold one token of at least {MIN_TOKEN_CHARS} "
                              f"printable ASCII characters without spaces (it holds {len(token)}), e.g. "
                              "`python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE`")
        return token

    @property
    def effective_quorum(self) -> int:
        return self.quorum if self.quorum is not None else self.min_contributors

    def check_transport(self) -> None:
        """TLS unless plaintext was asked for: a server given neither certificates nor `insecure` refuses."""
        if not self.insecure and not (self.ssl_certfile and self.ssl_keyfile):
            raise ConfigError("gym-server serves TLS by default: give --ssl-certfile and --ssl-keyfile (`gym-server "
                              "tls-cert --out DIR --host NAME` makes a private CA and a certificate), or --insecure "
                              "for plaintext on a network you trust")

    def client_lr_scale(self, round_id: int) -> float:
        """The factor round `round_id` asks contributors to train their learning rate at (--client-lr-decay)."""
        return client_lr_scale(self.client_lr_decay, round_id)

    def upload_deadline_s(self, payload_size: int) -> float:
        """Seconds a whole upload of `payload_size` bytes may take before it is refused."""
        return self.upload_idle_timeout + payload_size / self.upload_min_bytes_per_s

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True, default=str)


SECTIONS = ("server", "aggregation", "soup", "rewards", "privacy")


def client_lr_scale(decay: float, round_id: int) -> float:
    """Inverse-time decay over the federation's rounds, 1 / (1 + decay x (round_id - 1)): round 1 trains at the
    contributors' own learning rate; later rounds, whose base is already close, take smaller steps (Robbins-Monro).
    The one formula: the server signs it into RoundInfo, benchmarks/learning.py trains with it."""
    return 1.0 / (1.0 + decay * max(0, int(round_id) - 1))


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML (.toml) or YAML (.yaml/.yml) file into a flat dict with normalised keys."""
    try:
        raw = read_settings_file(path)
    except SettingsFileError as exc:
        raise ConfigError(str(exc)) from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and norm_key(key) in SECTIONS:
            for k, v in value.items():  # sections are only for readability
                flat[norm_key(k)] = v
        else:
            flat[norm_key(key)] = value
    return flat


def build_config(file_values: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None,
                 **flags: Any) -> ServerConfig:
    """Defaults < file values < environment (`ZOO_GYM_<KEY>`; none unless given) < flags (None: not given).
    A value of the wrong type is an error naming its key and the type it needs; an unknown key one that names
    the closest valid key."""
    try:
        return resolve(ServerConfig, file_values=file_values, environ=environ, flags=flags)
    except ConfigError:
        raise
    except SettingError as exc:
        raise ConfigError(str(exc)) from None


# `gym-server ingest` (docs/design/SCALE-OUT.md, "Ingest processes"): its own settings are these, the
# transport's; it takes every other one from the settings the `serve` of its state directory recorded, since
# what it signs (RoundInfo) and checks (a submission) must be serve's. Serve's own work it leaves alone:
INGEST_SETTINGS = ("host", "port", "ssl_certfile", "ssl_keyfile", "ssl_ca_certfile", "insecure", "max_uploads",
                   "max_pending_headers", "max_pending_headers_per_peer", "header_timeout", "query_workers",
                   "max_downloads", "download_idle_timeout", "upload_idle_timeout", "upload_min_bytes_per_s",
                   "register_rate_per_peer", "register_burst_per_peer", "log_level", "log_format", "dashboard_port",
                   "dashboard_host", "dashboard_token_file")  # an ingest process's dashboard serves its own /metrics
_NOT_INGEST = {"aggregation_engine": "local", "ray_address": None}


def ingest_leaves() -> list:
    """The settings `gym-server ingest` takes as flags (INGEST_SETTINGS), declared once with serve's."""
    return [leaf for leaf in leaves(ServerConfig) if leaf.key in INGEST_SETTINGS]


def ingest_config(recorded: Mapping[str, Any], file_values: Mapping[str, Any] | None = None, *,
                  environ: Mapping[str, str] | None = None, **flags: Any) -> ServerConfig:
    """An ingest process's settings: `recorded` (serve's, every key) but INGEST_SETTINGS, which come from the
    flags, the environment and the file as build_config orders them (else their defaults). Any other key set
    here to another value than serve's is a ConfigError naming it (the same --config as serve's passes);
    serve's Ray engine is not the ingest process's to check."""
    given: dict[str, Any] = {}
    try:
        for layer in collect(ServerConfig, file_values=file_values, environ=environ, flags=flags):
            given.update(layer)
    except ConfigError:
        raise
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    for key, value in given.items():
        if key not in INGEST_SETTINGS and key in recorded and value != recorded[key]:
            raise ConfigError(f"`{key}` is {value!r} here but {recorded[key]!r} in the running gym-server serve: an "
                              f"ingest process takes the round settings from serve; set `{key}` there, or not here")
    theirs = {k: v for k, v in recorded.items() if k not in INGEST_SETTINGS}  # ours: given here, or the defaults
    return build_config({**theirs, **{k: v for k, v in given.items() if k in INGEST_SETTINGS}, **_NOT_INGEST})


def check_round_size(soup, min_contributors: int, *, flag: str = "--min-contributors") -> None:
    """Refuse a --min-contributors (or --buffer-size) too small for the robust rule (named in the message)."""
    try:
        soup.rule.check_n(min_contributors)
    except ValueError as exc:
        raise ConfigError(f"{flag} {min_contributors} is too few for --aggregator {soup.rule.name}: {exc}") from None
