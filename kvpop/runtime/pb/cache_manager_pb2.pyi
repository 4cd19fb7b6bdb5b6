from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FloatArray(_message.Message):
    __slots__ = ("shape", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class IntArray(_message.Message):
    __slots__ = ("shape", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BlockFeatures(_message.Message):
    __slots__ = ("block", "position", "age", "key_mean", "value_norm", "attention", "reach")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    KEY_MEAN_FIELD_NUMBER: _ClassVar[int]
    VALUE_NORM_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    REACH_FIELD_NUMBER: _ClassVar[int]
    block: int
    position: int
    age: int
    key_mean: FloatArray
    value_norm: FloatArray
    attention: FloatArray
    reach: FloatArray
    def __init__(self, block: _Optional[int] = ..., position: _Optional[int] = ..., age: _Optional[int] = ..., key_mean: _Optional[_Union[FloatArray, _Mapping]] = ..., value_norm: _Optional[_Union[FloatArray, _Mapping]] = ..., attention: _Optional[_Union[FloatArray, _Mapping]] = ..., reach: _Optional[_Union[FloatArray, _Mapping]] = ...) -> None: ...

class BlockArrays(_message.Message):
    __slots__ = ("block", "position", "age", "key_mean", "value_norm", "attention", "reach")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    KEY_MEAN_FIELD_NUMBER: _ClassVar[int]
    VALUE_NORM_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    REACH_FIELD_NUMBER: _ClassVar[int]
    block: IntArray
    position: IntArray
    age: IntArray
    key_mean: FloatArray
    value_norm: FloatArray
    attention: FloatArray
    reach: FloatArray
    def __init__(self, block: _Optional[_Union[IntArray, _Mapping]] = ..., position: _Optional[_Union[IntArray, _Mapping]] = ..., age: _Optional[_Union[IntArray, _Mapping]] = ..., key_mean: _Optional[_Union[FloatArray, _Mapping]] = ..., value_norm: _Optional[_Union[FloatArray, _Mapping]] = ..., attention: _Optional[_Union[FloatArray, _Mapping]] = ..., reach: _Optional[_Union[FloatArray, _Mapping]] = ...) -> None: ...

class FeaturesBatch(_message.Message):
    __slots__ = ("request_id", "blocks", "gone", "more", "prompt_tokens", "arrays")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockFeatures]
    gone: IntArray
    more: bool
    prompt_tokens: int
    arrays: BlockArrays
    def __init__(self, request_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockFeatures, _Mapping]]] = ..., gone: _Optional[_Union[IntArray, _Mapping]] = ..., more: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., arrays: _Optional[_Union[BlockArrays, _Mapping]] = ...) -> None: ...

class SequenceFinished(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AdvisorMessage(_message.Message):
    __slots__ = ("features", "finished", "traceparent", "tracestate")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    features: FeaturesBatch
    finished: SequenceFinished
    traceparent: str
    tracestate: str
    def __init__(self, features: _Optional[_Union[FeaturesBatch, _Mapping]] = ..., finished: _Optional[_Union[SequenceFinished, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class EvictionPlan(_message.Message):
    __slots__ = ("request_id", "evict", "covers", "ranker", "estimator")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    COVERS_FIELD_NUMBER: _ClassVar[int]
    RANKER_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    evict: IntArray
    covers: int
    ranker: str
    estimator: str
    def __init__(self, request_id: _Optional[str] = ..., evict: _Optional[_Union[IntArray, _Mapping]] = ..., covers: _Optional[int] = ..., ranker: _Optional[str] = ..., estimator: _Optional[str] = ...) -> None: ...

class AdvisorInputs(_message.Message):
    __slots__ = ("reads",)
    READS_FIELD_NUMBER: _ClassVar[int]
    reads: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reads: _Optional[_Iterable[str]] = ...) -> None: ...

class AdvisorReply(_message.Message):
    __slots__ = ("plan", "inputs")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    plan: EvictionPlan
    inputs: AdvisorInputs
    def __init__(self, plan: _Optional[_Union[EvictionPlan, _Mapping]] = ..., inputs: _Optional[_Union[AdvisorInputs, _Mapping]] = ...) -> None: ...
