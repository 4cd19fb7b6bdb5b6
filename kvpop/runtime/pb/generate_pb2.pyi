from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORTED: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "stop", "ignore_eos", "logprobs", "policy", "budget_tokens", "budget_fraction", "session_id", "request_id", "sink_tokens", "recent_tokens", "messages", "evict_after_prompt", "prefill_allowance")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    EVICT_AFTER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ALLOWANCE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: bool
    policy: str
    budget_tokens: int
    budget_fraction: float
    session_id: str
    request_id: str
    sink_tokens: int
    recent_tokens: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    evict_after_prompt: bool
    prefill_allowance: float
    def __init__(self, prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., policy: _Optional[str] = ..., budget_tokens: _Optional[int] = ..., budget_fraction: _Optional[float] = ..., session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., sink_tokens: _Optional[int] = ..., recent_tokens: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., evict_after_prompt: _Optional[bool] = ..., prefill_allowance: _Optional[float] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "kv_blocks_resident", "kv_blocks_evicted", "policy", "fallback_evictions", "session_resumed", "reprefilled_tokens", "network_evictions", "advisor_heuristic_evictions", "fallback_reasons", "kv_blocks_peak")
    class FallbackReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_RESUMED_FIELD_NUMBER: _ClassVar[int]
    REPREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ADVISOR_HEURISTIC_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PEAK_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    kv_blocks_resident: int
    kv_blocks_evicted: int
    policy: str
    fallback_evictions: int
    session_resumed: bool
    reprefilled_tokens: int
    network_evictions: int
    advisor_heuristic_evictions: int
    fallback_reasons: _containers.ScalarMap[str, int]
    kv_blocks_peak: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., kv_blocks_resident: _Optional[int] = ..., kv_blocks_evicted: _Optional[int] = ..., policy: _Optional[str] = ..., fallback_evictions: _Optional[int] = ..., session_resumed: _Optional[bool] = ..., reprefilled_tokens: _Optional[int] = ..., network_evictions: _Optional[int] = ..., advisor_heuristic_evictions: _Optional[int] = ..., fallback_reasons: _Optional[_Mapping[str, int]] = ..., kv_blocks_peak: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "finish_reason_text", "usage")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_TEXT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    finish_reason_text: str
    usage: Usage
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., finish_reason_text: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    finished: Finished
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_model_len", "block_size", "policies", "default_policy", "placeholder", "vocab_size", "dtype", "device", "chat_template", "plan_interval", "page_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_POLICY_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PLAN_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    block_size: int
    policies: _containers.RepeatedScalarFieldContainer[str]
    default_policy: str
    placeholder: bool
    vocab_size: int
    dtype: str
    device: str
    chat_template: bool
    plan_interval: int
    page_size: int
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., policies: _Optional[_Iterable[str]] = ..., default_policy: _Optional[str] = ..., placeholder: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., chat_template: _Optional[bool] = ..., plan_interval: _Optional[int] = ..., page_size: _Optional[int] = ...) -> None: ...
