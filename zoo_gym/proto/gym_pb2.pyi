from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_STATE_UNSPECIFIED: _ClassVar[RoundState]
    ROUND_STATE_OPEN: _ClassVar[RoundState]
    ROUND_STATE_AGGREGATING: _ClassVar[RoundState]
    ROUND_STATE_PUBLISHED: _ClassVar[RoundState]
    ROUND_STATE_HALTED: _ClassVar[RoundState]
ROUND_STATE_UNSPECIFIED: RoundState
ROUND_STATE_OPEN: RoundState
ROUND_STATE_AGGREGATING: RoundState
ROUND_STATE_PUBLISHED: RoundState
ROUND_STATE_HALTED: RoundState

class RegisterRequest(_message.Message):
    __slots__ = ("public_key", "display_name", "nonce", "signature", "invite")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    INVITE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    display_name: str
    nonce: bytes
    signature: bytes
    invite: str
    def __init__(self, public_key: _Optional[bytes] = ..., display_name: _Optional[str] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., invite: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("contributor_id", "created", "server_public_key")
    CONTRIBUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SERVER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    contributor_id: str
    created: bool
    server_public_key: bytes
    def __init__(self, contributor_id: _Optional[str] = ..., created: _Optional[bool] = ..., server_public_key: _Optional[bytes] = ...) -> None: ...

class GetRoundRequest(_message.Message):
    __slots__ = ("contributor_id", "nonce", "signed_at_unix", "signature")
    CONTRIBUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    contributor_id: str
    nonce: bytes
    signed_at_unix: int
    signature: bytes
    def __init__(self, contributor_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., signed_at_unix: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_payload_bytes", "max_chunk_bytes", "download_chunk_bytes", "max_delta_norm")
    MAX_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_DELTA_NORM_FIELD_NUMBER: _ClassVar[int]
    max_payload_bytes: int
    max_chunk_bytes: int
    download_chunk_bytes: int
    max_delta_norm: float
    def __init__(self, max_payload_bytes: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., download_chunk_bytes: _Optional[int] = ..., max_delta_norm: _Optional[float] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round_id", "state", "base_checkpoint_id", "base_sha256", "base_size", "deadline_unix", "accepted_codecs", "limits", "submissions", "min_contributors", "you_submitted", "message", "aggregator", "dp_epsilon_spent", "dp_delta", "server_public_key", "signature", "mode", "buffer_size", "max_staleness", "staleness_exponent", "server_lr", "sample_rate", "selected_count", "selected", "dp_epsilon_round", "dp_epsilon_spent_rdp", "dp_participation", "mirrors", "client_lr_scale")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    BASE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_CODECS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    YOU_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_FIELD_NUMBER: _ClassVar[int]
    DP_EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    DP_DELTA_FIELD_NUMBER: _ClassVar[int]
    SERVER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    SERVER_LR_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    SELECTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    DP_EPSILON_ROUND_FIELD_NUMBER: _ClassVar[int]
    DP_EPSILON_SPENT_RDP_FIELD_NUMBER: _ClassVar[int]
    DP_PARTICIPATION_FIELD_NUMBER: _ClassVar[int]
    MIRRORS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    state: RoundState
    base_checkpoint_id: int
    base_sha256: str
    base_size: int
    deadline_unix: float
    accepted_codecs: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    submissions: int
    min_contributors: int
    you_submitted: bool
    message: str
    aggregator: str
    dp_epsilon_spent: float
    dp_delta: float
    server_public_key: bytes
    signature: bytes
    mode: str
    buffer_size: int
    max_staleness: int
    staleness_exponent: float
    server_lr: float
    sample_rate: float
    selected_count: int
    selected: bool
    dp_epsilon_round: float
    dp_epsilon_spent_rdp: float
    dp_participation: str
    mirrors: _containers.RepeatedScalarFieldContainer[str]
    client_lr_scale: float
    def __init__(self, round_id: _Optional[int] = ..., state: _Optional[_Union[RoundState, str]] = ..., base_checkpoint_id: _Optional[int] = ..., base_sha256: _Optional[str] = ..., base_size: _Optional[int] = ..., deadline_unix: _Optional[float] = ..., accepted_codecs: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., submissions: _Optional[int] = ..., min_contributors: _Optional[int] = ..., you_submitted: _Optional[bool] = ..., message: _Optional[str] = ..., aggregator: _Optional[str] = ..., dp_epsilon_spent: _Optional[float] = ..., dp_delta: _Optional[float] = ..., server_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., mode: _Optional[str] = ..., buffer_size: _Optional[int] = ..., max_staleness: _Optional[int] = ..., staleness_exponent: _Optional[float] = ..., server_lr: _Optional[float] = ..., sample_rate: _Optional[float] = ..., selected_count: _Optional[int] = ..., selected: _Optional[bool] = ..., dp_epsilon_round: _Optional[float] = ..., dp_epsilon_spent_rdp: _Optional[float] = ..., dp_participation: _Optional[str] = ..., mirrors: _Optional[_Iterable[str]] = ..., client_lr_scale: _Optional[float] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("checkpoint_sha256", "offset")
    CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    checkpoint_sha256: str
    offset: int
    def __init__(self, checkpoint_sha256: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("offset", "data", "total_size", "sha256")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_size: int
    sha256: str
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "codec", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    codec: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., codec: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class SubmitHeader(_message.Message):
    __slots__ = ("contributor_id", "round_id", "base_sha256", "payload_sha256", "payload_size", "manifest", "nonce", "signature", "metadata_json")
    CONTRIBUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    contributor_id: str
    round_id: int
    base_sha256: str
    payload_sha256: str
    payload_size: int
    manifest: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    nonce: bytes
    signature: bytes
    metadata_json: str
    def __init__(self, contributor_id: _Optional[str] = ..., round_id: _Optional[int] = ..., base_sha256: _Optional[str] = ..., payload_sha256: _Optional[str] = ..., payload_size: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SubmitHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[SubmitHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("submission_id", "round_id", "payload_sha256", "submissions")
    SUBMISSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    SUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    submission_id: int
    round_id: int
    payload_sha256: str
    submissions: int
    def __init__(self, submission_id: _Optional[int] = ..., round_id: _Optional[int] = ..., payload_sha256: _Optional[str] = ..., submissions: _Optional[int] = ...) -> None: ...

class BalanceRequest(_message.Message):
    __slots__ = ("contributor_id", "nonce", "signed_at_unix", "signature")
    CONTRIBUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    contributor_id: str
    nonce: bytes
    signed_at_unix: int
    signature: bytes
    def __init__(self, contributor_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., signed_at_unix: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Balance(_message.Message):
    __slots__ = ("contributor_id", "balance", "reputation", "entries", "last_seq")
    CONTRIBUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    REPUTATION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    contributor_id: str
    balance: int
    reputation: float
    entries: int
    last_seq: int
    def __init__(self, contributor_id: _Optional[str] = ..., balance: _Optional[int] = ..., reputation: _Optional[float] = ..., entries: _Optional[int] = ..., last_seq: _Optional[int] = ...) -> None: ...

class LedgerRequest(_message.Message):
    __slots__ = ("contributor_id", "since_seq", "limit", "nonce", "signed_at_unix", "signature", "whole_ledger")
    CONTRIBUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    WHOLE_LEDGER_FIELD_NUMBER: _ClassVar[int]
    contributor_id: str
    since_seq: int
    limit: int
    nonce: bytes
    signed_at_unix: int
    signature: bytes
    whole_ledger: bool
    def __init__(self, contributor_id: _Optional[str] = ..., since_seq: _Optional[int] = ..., limit: _Optional[int] = ..., nonce: _Optional[bytes] = ..., signed_at_unix: _Optional[int] = ..., signature: _Optional[bytes] = ..., whole_ledger: _Optional[bool] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("seq", "round_id", "contributor_id", "kind", "amount", "score", "reputation_after", "reason", "prev_hash", "entry_hash", "signature", "redacted")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    REPUTATION_AFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREV_HASH_FIELD_NUMBER: _ClassVar[int]
    ENTRY_HASH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    REDACTED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    round_id: int
    contributor_id: str
    kind: str
    amount: int
    score: float
    reputation_after: float
    reason: str
    prev_hash: str
    entry_hash: str
    signature: str
    redacted: bool
    def __init__(self, seq: _Optional[int] = ..., round_id: _Optional[int] = ..., contributor_id: _Optional[str] = ..., kind: _Optional[str] = ..., amount: _Optional[int] = ..., score: _Optional[float] = ..., reputation_after: _Optional[float] = ..., reason: _Optional[str] = ..., prev_hash: _Optional[str] = ..., entry_hash: _Optional[str] = ..., signature: _Optional[str] = ..., redacted: _Optional[bool] = ...) -> None: ...

class LedgerHeadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LedgerHead(_message.Message):
    __slots__ = ("entries", "last_hash", "signed_at_unix", "signature")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_HASH_FIELD_NUMBER: _ClassVar[int]
    SIGNED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    entries: int
    last_hash: str
    signed_at_unix: int
    signature: bytes
    def __init__(self, entries: _Optional[int] = ..., last_hash: _Optional[str] = ..., signed_at_unix: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...
