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
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class GenerateParameters(_message.Message):
    __slots__ = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "frequency_penalty", "seed", "stop", "truncate", "return_full_text", "details", "decoder_input_details", "top_n_tokens", "best_of", "watermark", "presence_penalty", "grammar", "min_p", "min_new_tokens", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "n", "adapter_id", "output_frequency_penalty")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_FULL_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    DECODER_INPUT_DETAILS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    repetition_penalty: float
    frequency_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    truncate: int
    return_full_text: bool
    details: bool
    decoder_input_details: bool
    top_n_tokens: int
    best_of: int
    watermark: bool
    presence_penalty: float
    grammar: Grammar
    min_p: float
    min_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logit_bias: _containers.ScalarMap[int, float]
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    n: int
    adapter_id: str
    output_frequency_penalty: float
    def __init__(self, max_new_tokens: _Optional[int] = ..., do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., truncate: _Optional[int] = ..., return_full_text: _Optional[bool] = ..., details: _Optional[bool] = ..., decoder_input_details: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., best_of: _Optional[int] = ..., watermark: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., min_p: _Optional[float] = ..., min_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., n: _Optional[int] = ..., adapter_id: _Optional[str] = ..., output_frequency_penalty: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "logprob", "special")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    special: bool
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., special: _Optional[bool] = ...) -> None: ...

class TopTokens(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class Details(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens", "input_length", "cached_tokens", "stop_token_id", "best_of_sequences", "prefill_top_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    generated_tokens: int
    seed: int
    prefill: _containers.RepeatedCompositeFieldContainer[Token]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    input_length: int
    cached_tokens: int
    stop_token_id: int
    best_of_sequences: _containers.RepeatedCompositeFieldContainer[BestOfSequence]
    prefill_top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ..., input_length: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., stop_token_id: _Optional[int] = ..., best_of_sequences: _Optional[_Iterable[_Union[BestOfSequence, _Mapping]]] = ..., prefill_top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("inputs", "parameters", "input_ids", "suffix")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    parameters: GenerateParameters
    input_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    suffix: str
    def __init__(self, inputs: _Optional[_Iterable[str]] = ..., parameters: _Optional[_Union[GenerateParameters, _Mapping]] = ..., input_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., suffix: _Optional[str] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("generated_text", "details", "prompt_text")
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    generated_text: str
    details: Details
    prompt_text: str
    def __init__(self, generated_text: _Optional[str] = ..., details: _Optional[_Union[Details, _Mapping]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GenerateResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GenerateResult, _Mapping]]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("inputs", "parameters", "input_ids", "suffix")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    parameters: GenerateParameters
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    suffix: str
    def __init__(self, inputs: _Optional[str] = ..., parameters: _Optional[_Union[GenerateParameters, _Mapping]] = ..., input_ids: _Optional[_Iterable[int]] = ..., suffix: _Optional[str] = ...) -> None: ...

class StreamDetails(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "seed", "input_length", "cached_tokens", "stop_token_id")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    generated_tokens: int
    seed: int
    input_length: int
    cached_tokens: int
    stop_token_id: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., input_length: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "token", "top_tokens", "generated_text", "details")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token: Token
    top_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    generated_text: str
    details: StreamDetails
    def __init__(self, index: _Optional[int] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., generated_text: _Optional[str] = ..., details: _Optional[_Union[StreamDetails, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "model_sha", "model_dtype", "model_device_type", "num_shard", "block_size", "num_kv_blocks", "max_concurrent_requests", "max_best_of", "max_stop_sequences", "max_top_n_tokens", "max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens", "max_batch_total_tokens", "max_client_batch_size", "version", "speculate", "has_chat_template", "served_model_name", "grammar_support", "vocab_size", "max_active_adapters", "loaded_adapters", "max_loras_per_batch", "default_adapter_id", "watermark_gamma", "watermark_delta", "cuda_graph_batch_sizes", "quantize", "model_weight_bytes", "tool_call_parser", "reasoning_parser", "fill_in_middle", "architecture", "implementation", "disabled_features", "kv_cache_bytes", "kv_cache_sized_by", "quantized_matmul", "quantized_matmul_isa")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BEST_OF_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_GAMMA_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_DELTA_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    FILL_IN_MIDDLE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FEATURES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SIZED_BY_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_MATMUL_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_MATMUL_ISA_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_sha: str
    model_dtype: str
    model_device_type: str
    num_shard: int
    block_size: int
    num_kv_blocks: int
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_client_batch_size: int
    version: str
    speculate: int
    has_chat_template: bool
    served_model_name: str
    grammar_support: bool
    vocab_size: int
    max_active_adapters: int
    loaded_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_loras_per_batch: int
    default_adapter_id: str
    watermark_gamma: float
    watermark_delta: float
    cuda_graph_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    quantize: str
    model_weight_bytes: int
    tool_call_parser: str
    reasoning_parser: str
    fill_in_middle: bool
    architecture: str
    implementation: str
    disabled_features: _containers.RepeatedScalarFieldContainer[str]
    kv_cache_bytes: int
    kv_cache_sized_by: str
    quantized_matmul: str
    quantized_matmul_isa: str
    def __init__(self, model_id: _Optional[str] = ..., model_sha: _Optional[str] = ..., model_dtype: _Optional[str] = ..., model_device_type: _Optional[str] = ..., num_shard: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., max_best_of: _Optional[int] = ..., max_stop_sequences: _Optional[int] = ..., max_top_n_tokens: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_batch_prefill_tokens: _Optional[int] = ..., max_batch_total_tokens: _Optional[int] = ..., max_client_batch_size: _Optional[int] = ..., version: _Optional[str] = ..., speculate: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., served_model_name: _Optional[str] = ..., grammar_support: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., max_active_adapters: _Optional[int] = ..., loaded_adapters: _Optional[_Iterable[str]] = ..., max_loras_per_batch: _Optional[int] = ..., default_adapter_id: _Optional[str] = ..., watermark_gamma: _Optional[float] = ..., watermark_delta: _Optional[float] = ..., cuda_graph_batch_sizes: _Optional[_Iterable[int]] = ..., quantize: _Optional[str] = ..., model_weight_bytes: _Optional[int] = ..., tool_call_parser: _Optional[str] = ..., reasoning_parser: _Optional[str] = ..., fill_in_middle: _Optional[bool] = ..., architecture: _Optional[str] = ..., implementation: _Optional[str] = ..., disabled_features: _Optional[_Iterable[str]] = ..., kv_cache_bytes: _Optional[int] = ..., kv_cache_sized_by: _Optional[str] = ..., quantized_matmul: _Optional[str] = ..., quantized_matmul_isa: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("inputs", "add_special_tokens")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    add_special_tokens: bool
    def __init__(self, inputs: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class SimpleToken(_message.Message):
    __slots__ = ("id", "text", "start", "stop")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    start: int
    stop: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[SimpleToken]
    def __init__(self, tokens: _Optional[_Iterable[_Union[SimpleToken, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "type", "function")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    function: FunctionCall
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[FunctionCall, _Mapping]] = ...) -> None: ...

class FunctionCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("type", "function")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    type: str
    function: FunctionDefinition
    def __init__(self, type: _Optional[str] = ..., function: _Optional[_Union[FunctionDefinition, _Mapping]] = ...) -> None: ...

class FunctionDefinition(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function_name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function_name: str
    def __init__(self, mode: _Optional[str] = ..., function_name: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "call")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    index: int
    call: ToolCall
    def __init__(self, index: _Optional[int] = ..., call: _Optional[_Union[ToolCall, _Mapping]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: str
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("messages", "parameters", "n", "logprobs", "top_logprobs", "response_format", "model", "add_generation_prompt", "continue_final_message", "tools", "tool_choice", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    parameters: GenerateParameters
    n: int
    logprobs: bool
    top_logprobs: int
    response_format: ResponseFormat
    model: str
    add_generation_prompt: bool
    continue_final_message: bool
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., parameters: _Optional[_Union[GenerateParameters, _Mapping]] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., model: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: Token
    top_logprobs: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, token: _Optional[_Union[Token, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class ChatChoice(_message.Message):
    __slots__ = ("index", "message", "finish_reason", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    message: ChatMessage
    finish_reason: FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., message: _Optional[_Union[ChatMessage, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ChatResponse(_message.Message):
    __slots__ = ("id", "model", "created", "choices", "usage", "system_fingerprint")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoice]
    usage: Usage
    system_fingerprint: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChatChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., system_fingerprint: _Optional[str] = ...) -> None: ...

class ChatStreamRequest(_message.Message):
    __slots__ = ("messages", "parameters", "n", "logprobs", "top_logprobs", "response_format", "model", "add_generation_prompt", "continue_final_message", "tools", "tool_choice", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    parameters: GenerateParameters
    n: int
    logprobs: bool
    top_logprobs: int
    response_format: ResponseFormat
    model: str
    add_generation_prompt: bool
    continue_final_message: bool
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., parameters: _Optional[_Union[GenerateParameters, _Mapping]] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., model: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class ChatStreamResponse(_message.Message):
    __slots__ = ("id", "model", "created", "index", "delta", "token", "top_logprobs", "finish_reason", "usage", "tool_calls", "reasoning_delta", "system_fingerprint")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_DELTA_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    index: int
    delta: str
    token: Token
    top_logprobs: _containers.RepeatedCompositeFieldContainer[Token]
    finish_reason: FinishReason
    usage: Usage
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    reasoning_delta: str
    system_fingerprint: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., index: _Optional[int] = ..., delta: _Optional[str] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., reasoning_delta: _Optional[str] = ..., system_fingerprint: _Optional[str] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "ebnf", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    ebnf: str
    choice: GrammarChoice
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., choice: _Optional[_Union[GrammarChoice, _Mapping]] = ...) -> None: ...

class GrammarChoice(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BestOfSequence(_message.Message):
    __slots__ = ("generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens", "cached_tokens")
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int
    prefill: _containers.RepeatedCompositeFieldContainer[Token]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    cached_tokens: int
    def __init__(self, generated_text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
