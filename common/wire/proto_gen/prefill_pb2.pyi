from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens", "min_new_tokens", "stop_token_ids", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "return_logprob", "top_logprobs_num", "token_ids_logprob", "json_schema", "regex", "ebnf_grammar", "structural_tag", "n", "logprob_start_len")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    max_new_tokens: int
    min_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    return_logprob: bool
    top_logprobs_num: int
    token_ids_logprob: _containers.RepeatedScalarFieldContainer[int]
    json_schema: str
    regex: str
    ebnf_grammar: str
    structural_tag: str
    n: int
    logprob_start_len: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., token_ids_logprob: _Optional[_Iterable[int]] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf_grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ..., n: _Optional[int] = ..., logprob_start_len: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_values", "ids_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_VALUES_FIELD_NUMBER: _ClassVar[int]
    IDS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_values: _containers.RepeatedScalarFieldContainer[float]
    ids_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_values: _Optional[_Iterable[float]] = ..., ids_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling_params", "max_chunk_bytes", "first_output_position", "kv_destination", "kv_start", "kv_start_digest")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_OUTPUT_POSITION_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    KV_START_FIELD_NUMBER: _ClassVar[int]
    KV_START_DIGEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    max_chunk_bytes: int
    first_output_position: int
    kv_destination: KvDestination
    kv_start: int
    kv_start_digest: bytes
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ..., first_output_position: _Optional[int] = ..., kv_destination: _Optional[_Union[KvDestination, _Mapping]] = ..., kv_start: _Optional[int] = ..., kv_start_digest: _Optional[bytes] = ...) -> None: ...

class KvRegion(_message.Message):
    __slots__ = ("k_ptrs", "v_ptrs", "slot_bytes")
    K_PTRS_FIELD_NUMBER: _ClassVar[int]
    V_PTRS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    k_ptrs: _containers.RepeatedScalarFieldContainer[int]
    v_ptrs: _containers.RepeatedScalarFieldContainer[int]
    slot_bytes: int
    def __init__(self, k_ptrs: _Optional[_Iterable[int]] = ..., v_ptrs: _Optional[_Iterable[int]] = ..., slot_bytes: _Optional[int] = ...) -> None: ...

class SlotRun(_message.Message):
    __slots__ = ("token_start", "slot", "length")
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    token_start: int
    slot: int
    length: int
    def __init__(self, token_start: _Optional[int] = ..., slot: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("session", "target", "draft", "runs", "tp_ranks", "capability")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    session: str
    target: KvRegion
    draft: KvRegion
    runs: _containers.RepeatedCompositeFieldContainer[SlotRun]
    tp_ranks: _containers.RepeatedCompositeFieldContainer[KvRankDestination]
    capability: bytes
    def __init__(self, session: _Optional[str] = ..., target: _Optional[_Union[KvRegion, _Mapping]] = ..., draft: _Optional[_Union[KvRegion, _Mapping]] = ..., runs: _Optional[_Iterable[_Union[SlotRun, _Mapping]]] = ..., tp_ranks: _Optional[_Iterable[_Union[KvRankDestination, _Mapping]]] = ..., capability: _Optional[bytes] = ...) -> None: ...

class KvRankDestination(_message.Message):
    __slots__ = ("session", "target", "draft", "kv_head_start", "kv_head_count", "capability")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    session: str
    target: KvRegion
    draft: KvRegion
    kv_head_start: int
    kv_head_count: int
    capability: bytes
    def __init__(self, session: _Optional[str] = ..., target: _Optional[_Union[KvRegion, _Mapping]] = ..., draft: _Optional[_Union[KvRegion, _Mapping]] = ..., kv_head_start: _Optional[int] = ..., kv_head_count: _Optional[int] = ..., capability: _Optional[bytes] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id",)
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    def __init__(self, token_id: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("token_start", "num_tokens", "layer_start", "draft", "k", "v")
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    token_start: int
    num_tokens: int
    layer_start: int
    draft: bool
    k: Tensor
    v: Tensor
    def __init__(self, token_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layer_start: _Optional[int] = ..., draft: _Optional[bool] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class KvWritten(_message.Message):
    __slots__ = ("token_start", "num_tokens", "layer_start", "num_layers", "draft", "bytes")
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    token_start: int
    num_tokens: int
    layer_start: int
    num_layers: int
    draft: bool
    bytes: int
    def __init__(self, token_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layer_start: _Optional[int] = ..., num_layers: _Optional[int] = ..., draft: _Optional[bool] = ..., bytes: _Optional[int] = ...) -> None: ...

class PrebuiltRecord(_message.Message):
    __slots__ = ("prompt_len", "first_token", "num_kv_chunks", "draft_seed", "queue_us", "compute_us", "cached_tokens", "first_logprobs", "more_first_tokens", "more_first_logprobs", "prompt_logprobs", "more_draft")
    class DraftSeedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    class MoreDraftEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SEED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_DRAFT_FIELD_NUMBER: _ClassVar[int]
    prompt_len: int
    first_token: int
    num_kv_chunks: int
    draft_seed: _containers.MessageMap[str, Tensor]
    queue_us: int
    compute_us: int
    cached_tokens: int
    first_logprobs: TokenLogprobs
    more_first_tokens: _containers.RepeatedScalarFieldContainer[int]
    more_first_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    more_draft: _containers.MessageMap[str, Tensor]
    def __init__(self, prompt_len: _Optional[int] = ..., first_token: _Optional[int] = ..., num_kv_chunks: _Optional[int] = ..., draft_seed: _Optional[_Mapping[str, Tensor]] = ..., queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., more_first_tokens: _Optional[_Iterable[int]] = ..., more_first_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., more_draft: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("first_token", "kv", "record", "written")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    kv: KvChunk
    record: PrebuiltRecord
    written: KvWritten
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., kv: _Optional[_Union[KvChunk, _Mapping]] = ..., record: _Optional[_Union[PrebuiltRecord, _Mapping]] = ..., written: _Optional[_Union[KvWritten, _Mapping]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_tokens")
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_tokens: int
    def __init__(self, num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., num_used_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ...) -> None: ...
