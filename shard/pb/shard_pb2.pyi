from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "dtype", "device", "rank", "world_size", "block_size", "num_blocks", "attention_backend", "attention_backend_reason", "max_position_embeddings", "vocab_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_REASON_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    device: str
    rank: int
    world_size: int
    block_size: int
    num_blocks: int
    attention_backend: str
    attention_backend_reason: str
    max_position_embeddings: int
    vocab_size: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., attention_backend: _Optional[str] = ..., attention_backend_reason: _Optional[str] = ..., max_position_embeddings: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("max_batch_prefill_tokens", "max_total_tokens", "max_batch_size", "max_total_tokens_derived")
    MAX_BATCH_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_DERIVED_FIELD_NUMBER: _ClassVar[int]
    max_batch_prefill_tokens: int
    max_total_tokens: int
    max_batch_size: int
    max_total_tokens_derived: bool
    def __init__(self, max_batch_prefill_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_total_tokens_derived: _Optional[bool] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("num_blocks", "block_size")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "min_p", "do_sample", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    min_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., min_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("id", "input_ids", "cache_len", "block_ids", "sampling", "num_tokens", "top_n_tokens", "prompt_logprobs", "num_generated", "grammar")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    id: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_len: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParameters
    num_tokens: int
    top_n_tokens: int
    prompt_logprobs: bool
    num_generated: int
    grammar: str
    def __init__(self, id: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., cache_len: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., num_tokens: _Optional[int] = ..., top_n_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., num_generated: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("id", "new_block_ids", "num_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, id: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class TopToken(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob", "top_tokens", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    token_id: int
    logprob: float
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopToken]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[_Union[TopToken, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("forward_ns", "total_ns", "propose_ns")
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_NS_FIELD_NUMBER: _ClassVar[int]
    forward_ns: int
    total_ns: int
    propose_ns: int
    def __init__(self, forward_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., propose_ns: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("finished_request_ids", "cached_requests", "new_requests", "step", "restart", "decode", "row_appends")
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ROW_APPENDS_FIELD_NUMBER: _ClassVar[int]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    step: int
    restart: bool
    decode: bool
    row_appends: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    def __init__(self, finished_request_ids: _Optional[_Iterable[int]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., step: _Optional[int] = ..., restart: _Optional[bool] = ..., decode: _Optional[bool] = ..., row_appends: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ...) -> None: ...

class GrammarFailure(_message.Message):
    __slots__ = ("request_id", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    message: str
    def __init__(self, request_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("generations", "timings", "grammar_failures", "decode")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    timings: Timings
    grammar_failures: _containers.RepeatedCompositeFieldContainer[GrammarFailure]
    decode: DecodeResponse
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., grammar_failures: _Optional[_Iterable[_Union[GrammarFailure, _Mapping]]] = ..., decode: _Optional[_Union[DecodeResponse, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("finished_request_ids", "cached_requests", "step", "restart", "num_speculative_tokens")
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    step: int
    restart: bool
    num_speculative_tokens: int
    def __init__(self, finished_request_ids: _Optional[_Iterable[int]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., step: _Optional[int] = ..., restart: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "generations", "timings", "grammar_failures", "step", "num_tokens", "num_proposed")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    timings: Timings
    grammar_failures: _containers.RepeatedCompositeFieldContainer[GrammarFailure]
    step: int
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_proposed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., grammar_failures: _Optional[_Iterable[_Union[GrammarFailure, _Mapping]]] = ..., step: _Optional[int] = ..., num_tokens: _Optional[_Iterable[int]] = ..., num_proposed: _Optional[_Iterable[int]] = ...) -> None: ...
