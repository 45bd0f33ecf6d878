from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "structured_kind", "structured_spec", "prompt_logprobs", "prompt_only")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_KIND_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_SPEC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ONLY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    structured_kind: str
    structured_spec: str
    prompt_logprobs: int
    prompt_only: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured_kind: _Optional[str] = ..., structured_spec: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., prompt_only: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "adapter", "prompt", "chat", "prompt_token_ids", "sampling", "priority", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: str
    prompt: str
    chat: ChatInput
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    priority: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "admitted", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    admitted: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., admitted: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("first", "rest", "ranks")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    REST_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    first: TokenLogprob
    rest: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first: _Optional[_Union[TokenLogprob, _Mapping]] = ..., rest: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "token_bytes", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., token_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "pin", "wait")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    pin: bool
    wait: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., pin: _Optional[bool] = ..., wait: _Optional[bool] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "scaling", "target_modules", "state", "pinned", "requests_served", "tokens_generated", "active_requests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    state: str
    pinned: bool
    requests_served: int
    tokens_generated: int
    active_requests: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., scaling: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., state: _Optional[str] = ..., pinned: _Optional[bool] = ..., requests_served: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., active_requests: _Optional[int] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_blocks_total", "kv_blocks_used", "adapters", "model", "max_model_len", "lora_slots", "steps", "tokens_generated", "adapter_cache", "draining", "prefix_cache_queries", "prefix_cache_hits")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CACHE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    model: str
    max_model_len: int
    lora_slots: int
    steps: int
    tokens_generated: int
    adapter_cache: AdapterCacheStats
    draining: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., lora_slots: _Optional[int] = ..., steps: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., adapter_cache: _Optional[_Union[AdapterCacheStats, _Mapping]] = ..., draining: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class AdapterCacheStats(_message.Message):
    __slots__ = ("slot_hits", "slot_misses", "evictions", "loads", "fills_ahead")
    SLOT_HITS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    FILLS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    slot_hits: int
    slot_misses: int
    evictions: int
    loads: int
    fills_ahead: int
    def __init__(self, slot_hits: _Optional[int] = ..., slot_misses: _Optional[int] = ..., evictions: _Optional[int] = ..., loads: _Optional[int] = ..., fills_ahead: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "chat", "add_special_tokens", "add_generation_prompt", "return_token_strs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatInput
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "token_strs", "max_model_len")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., token_strs: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    def __init__(self, prompt: _Optional[str] = ...) -> None: ...
