from . import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "has_seed", "seed", "repetition_penalty", "stop", "ignore_eos", "logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ...) -> None: ...

class Eviction(_message.Message):
    __slots__ = ("policy", "budget_tokens", "budget_fraction", "sink_tokens", "recent_tokens", "evict_after_prompt", "prefill_allowance")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICT_AFTER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ALLOWANCE_FIELD_NUMBER: _ClassVar[int]
    policy: str
    budget_tokens: int
    budget_fraction: float
    sink_tokens: int
    recent_tokens: int
    evict_after_prompt: bool
    prefill_allowance: float
    def __init__(self, policy: _Optional[str] = ..., budget_tokens: _Optional[int] = ..., budget_fraction: _Optional[float] = ..., sink_tokens: _Optional[int] = ..., recent_tokens: _Optional[int] = ..., evict_after_prompt: _Optional[bool] = ..., prefill_allowance: _Optional[float] = ...) -> None: ...

class ComputeRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "eviction", "session_id", "continue_session", "history_token_ids", "messages", "chat_history", "reply_end_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_SESSION_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CHAT_HISTORY_FIELD_NUMBER: _ClassVar[int]
    REPLY_END_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    eviction: Eviction
    session_id: str
    continue_session: bool
    history_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[_generate_pb2.ChatMessage]
    chat_history: _containers.RepeatedCompositeFieldContainer[_generate_pb2.ChatMessage]
    reply_end_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., eviction: _Optional[_Union[Eviction, _Mapping]] = ..., session_id: _Optional[str] = ..., continue_session: _Optional[bool] = ..., history_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[_generate_pb2.ChatMessage, _Mapping]]] = ..., chat_history: _Optional[_Iterable[_Union[_generate_pb2.ChatMessage, _Mapping]]] = ..., reply_end_token_id: _Optional[int] = ...) -> None: ...

class ComputeResponse(_message.Message):
    __slots__ = ("response", "prompt_token_ids")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    response: _generate_pb2.GenerateResponse
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, response: _Optional[_Union[_generate_pb2.GenerateResponse, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ServeRequest(_message.Message):
    __slots__ = ("start", "cancel", "timeout_s", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    start: ComputeRequest
    cancel: str
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, start: _Optional[_Union[ComputeRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ServeEvent(_message.Message):
    __slots__ = ("request_id", "response", "status_code", "status_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: ComputeResponse
    status_code: int
    status_message: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[ComputeResponse, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...

class ServeEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ServeEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[ServeEvent, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pages_total", "pages_free", "pages_used", "running", "waiting", "evictions", "fallback_evictions", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    pages_total: int
    pages_free: int
    pages_used: int
    running: int
    waiting: int
    evictions: int
    fallback_evictions: int
    extra: _containers.ScalarMap[str, float]
    def __init__(self, pages_total: _Optional[int] = ..., pages_free: _Optional[int] = ..., pages_used: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., evictions: _Optional[int] = ..., fallback_evictions: _Optional[int] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "stats", "advisor_connected", "replica_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ADVISOR_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    model: _generate_pb2.ModelInfo
    stats: PoolStats
    advisor_connected: bool
    replica_id: str
    def __init__(self, model: _Optional[_Union[_generate_pb2.ModelInfo, _Mapping]] = ..., stats: _Optional[_Union[PoolStats, _Mapping]] = ..., advisor_connected: _Optional[bool] = ..., replica_id: _Optional[str] = ...) -> None: ...
