"""The launcher's options: TGI's flag names and environment variables, one frozen config.

This is the only module that reads the process environment.  Every option is a flag whose
environment variable is the flag's name in upper snake case (``--max-total-tokens`` ↔
``MAX_TOTAL_TOKENS``), as in ``text-generation-launcher``; a flag on the command line wins over
the environment.

Longer than ~500 lines on purpose: it is one table (the ``Config`` fields and the flag of
each, with its help text), and keeping every option in one place is what lets the docs'
flag reference be generated from it and a reader find any flag with one search.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

# "auto" (or unset): genserve.dtype_choice picks for the machine at start-up.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
SchedulePolicy = Literal["fcfs", "lpm"]
CpuIntDot = Literal["auto", "on", "off"]
PrefillBatching = Literal["auto", "on", "off"]
GpuPrefillAttention = Literal["auto", "triton", "sdpa", "sdpa-pinned"]
AdapterSource = Literal["local", "hub"]

DEFAULT_PORT = 50051
# Services answered without --api-key: probes (kubelet, grpc_health_probe, mesh sidecars)
# carry no credentials, and reflection serves only the public schema (grpcurl, ghz).
DEFAULT_API_KEY_EXEMPT: tuple[str, ...] = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
)
VERSION = "0.1.0"


# --genserve-cache where neither the flag nor GENSERVE_CACHE names one.
DEFAULT_GENSERVE_CACHE = Path.home() / ".cache" / "genserve"


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the launcher was asked for.  ``None`` means "derive it" (from the model, the
    memory left after loading, or the hardware) — the derived values are reported by ``Info``."""

    model_id: str | None = None
    revision: str | None = None
    dtype: Dtype | None = None
    trust_remote_code: bool = False
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    watermark_gamma: float = 0.5  # issue #15: TGI's green-list fraction
    watermark_delta: float = 2.0  # issue #15: TGI's green-logit bias
    rope_scaling: str | None = None  # issue #15: linear | dynamic (TGI's --rope-scaling)
    rope_factor: float | None = None
    quantize: str | None = None  # issue #14: int8 | int4 | gguf (eetq: int8), weight-only
    model_impl: str = "auto"  # issue #25: auto | transformers (model/serving_path.py)
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 20  # OpenAI's top_logprobs allows 20
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_client_batch_size: int = 4
    waiting_served_ratio: float = 1.2
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    chunked_prefill_size: int | None = None
    disable_chunked_prefill: bool = False
    schedule_policy: SchedulePolicy = "fcfs"
    disable_prefix_caching: bool = False
    disable_grammar_support: bool = False
    # issue #29: schedule step n + 1 while step n runs; None: on CUDA only (serving_defaults)
    overlap_scheduling: bool | None = None
    # issue #29: the engine loop in a spawned child process; None: on one CUDA GPU only
    engine_process: bool | None = None
    prefill_batching: PrefillBatching = "auto"  # issue #29: TGI's admission rule, chunked too
    # issue #29: how CUDA steps with prompt rows attend (model/attention_backend.py)
    gpu_prefill_attention: GpuPrefillAttention = "auto"
    speculate: int = 0
    speculate_max_batch_size: int = 32
    disable_cpu_kernels: bool = False
    cpu_int_dot: CpuIntDot = "auto"  # issue #28: auto | on | off (kernels/int_dot.py)
    # testing/benchmarking: CPU features the kernels treat as absent (kernels/cpu_features.py)
    cpu_features_mask: str = ""
    deterministic: bool = False
    block_size: int = 16
    cuda_memory_fraction: float = 1.0
    cuda_graphs: tuple[int, ...] | None = None  # None: default buckets; (): disabled (#12)
    cpu_memory_fraction: float = 0.3
    hostname: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    huggingface_hub_cache: Path | None = None
    genserve_cache: Path = DEFAULT_GENSERVE_CACHE
    num_shard: int | None = None
    sharded: bool | None = None
    expert_parallel: bool = False  # issue #26: whole routed experts per shard
    master_addr: str = "localhost"
    master_port: int = 29500
    shutdown_timeout: float = 30.0
    json_output: bool = False
    log_requests: bool = False
    otlp_endpoint: str | None = None
    otlp_service_name: str = "genserve"
    prometheus_port: int | None = 9000
    env: bool = False
    chat_template: str | None = None
    tokenizer_config_path: Path | None = None
    served_model_name: str | None = None
    # Issue #27: tool-call and reasoning formats of Chat replies (server/tool_calls/,
    # server/reasoning.py); None: the template's tool format (else Hermes), no reasoning split.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # Deployment: authentication, TLS, transport limits (server/security.py, server/app.py).
    api_key: str | None = field(default=None, repr=False)  # never printed with the config
    api_key_exempt: tuple[str, ...] = DEFAULT_API_KEY_EXEMPT
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    max_message_size: int = 64 * 1024 * 1024
    keepalive_min_ping_interval: float = 10.0
    max_connection_idle: float = 300.0
    max_connection_age: float = 0.0
    max_connection_age_grace: float = 30.0
    otel_propagators: tuple[str, ...] = ("tracecontext", "baggage", "b3")
    # LoRA adapters (genserve.engine.adapter_manager)
    lora_adapters: str | None = None
    adapter_id: str | None = None
    adapter_source: AdapterSource = "local"
    max_active_adapters: int = 8
    max_loras_per_batch: int | None = None
    adapter_cycle_time_s: float = 2.0


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` → ``(1, 2, 4, 8)`` (sorted, unique); ``"0"`` → ``()`` (graphs off)."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"expected comma-separated batch sizes or 0, got {text!r}") from None
    if values == [0]:
        return ()
    if not values or values[0] < 1:
        raise ValueError(f"batch sizes must be positive (or a single 0 to disable), got {text!r}")
    return tuple(values)


def _cuda_graph_sizes(text: str) -> tuple[int, ...]:
    try:
        return parse_batch_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _service_list(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


_PROPAGATOR_NAMES = ("tracecontext", "baggage", "b3", "b3multi", "none")


def _propagators(text: str) -> tuple[str, ...]:
    names = _service_list(text)
    unknown = [name for name in names if name not in _PROPAGATOR_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown propagator(s) {', '.join(unknown)}; known: {', '.join(_PROPAGATOR_NAMES)}"
        )
    return names


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {value}")
    return value


def _is_ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def _bind_address(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the address is empty")
    return text.strip()


@dataclass(frozen=True, slots=True)
class _Flag:
    dest: str
    names: tuple[str, ...]
    help: str
    parse: Callable[[str], Any] | None = None  # None: a switch (store_true)
    env: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    # A switch with a --no- form whose default (None) the launcher decides (on CUDA: on).
    negatable: bool = False


def _flag(
    dest: str,
    help: str,
    parse: Callable[[str], Any] | None = str,
    *,
    aliases: Sequence[str] = (),
    env: Sequence[str] = (),
    choices: Sequence[str] | None = None,
    negatable: bool = False,
) -> _Flag:
    names = ("--" + dest.replace("_", "-"), *aliases)
    return _Flag(
        dest=dest,
        names=names,
        help=help,
        parse=parse,
        env=tuple(env) or (dest.upper(),),
        choices=tuple(choices) if choices else None,
        negatable=negatable,
    )


_SWITCH = None

FLAGS: tuple[_Flag, ...] = (
    _flag(
        "model_id",
        "Local save_pretrained directory, .gguf file, or hub id in the local HF cache. "
        "Default: the embedded SmolLM2-135M-Instruct.",
    ),
    _flag("revision", "Hub revision (branch, tag or commit) of --model-id."),
    _flag(
        "dtype",
        "Weights and compute dtype. auto (default): bfloat16 on CUDA (float16 without bf16) "
        "and on CPUs that compute bf16 natively (AVX512-BF16/AMX), float32 on other CPUs.",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    _flag("trust_remote_code", "Allow custom tokenizer code shipped with the model.", _SWITCH),
    _flag(
        "max_concurrent_requests", "Requests in flight before RESOURCE_EXHAUSTED.", _positive_int
    ),
    _flag("max_best_of", "Largest best_of a client may ask for.", _positive_int),
    _flag("watermark_gamma", "Watermark green-list fraction of the vocabulary.", _fraction),
    _flag("watermark_delta", "Watermark bias added to green-list logits.", float),
    _flag(
        "rope_scaling",
        "Rotary scaling for contexts past the model's: linear or dynamic (NTK). "
        "Default factor 1 unless --rope-factor is given.",
        choices=("linear", "dynamic"),
    ),
    _flag(
        "rope_factor",
        "Rotary scaling factor; alone it implies --rope-scaling linear (as TGI).",
        _positive_float,
    ),
    _flag(
        "quantize",
        "Weight-only quantization, CPU kernels: int8 (per-channel; eetq is accepted as its "
        "TGI name), int4 (groups of 32, Q4_1's scheme; the vocabulary matrix int8), gguf "
        "(keep a .gguf model's Q8_0/Q4_0/Q4_1 blocks), or none (all in --dtype). Activations "
        "stay in --dtype. Default: gguf for a .gguf model on CPU, none otherwise.",
        choices=("int8", "int4", "gguf", "eetq", "none"),
    ),
    _flag(
        "model_impl",
        "auto: genserve's native model where the architecture has one, else transformers' "
        "modeling code with genserve's paged KV cache (docs/models/fallback.md); "
        "transformers: that fallback for every architecture (vLLM's --model-impl).",
        choices=("auto", "transformers"),
    ),
    _flag(
        "disable_grammar_support",
        "Refuse GenerateParameters.grammar (structured output) with UNIMPLEMENTED.",
        _SWITCH,
    ),
    _flag(
        "overlap_scheduling",
        "Schedule step n + 1 before step n's tokens are known (its decode tokens are filled "
        "on the device from step n's) and stream step n while step n + 1 runs; stop "
        "conditions apply one step late and the extra token is dropped, so outputs are "
        "unchanged. auto: on where the model serves on CUDA, off on CPU (no gain measured "
        "there).",
        _SWITCH,
        negatable=True,
    ),
    _flag(
        "engine_process",
        "Run the engine loop (scheduler, KV cache, model runner, detokenisers) in a process of "
        "its own, so the gRPC process's Python work does not hold the engine's GIL "
        "(docs/gpu-step.md). Structured output, LoRA adapters and tensor parallelism "
        "(--num-shard, --sharded: the engine process is rank 0 and starts the other ranks) "
        "work as without it. auto: on where the model serves on one CUDA GPU (an H200 "
        "served 1.66x the tokens at 256 streams with it), off on CPU and across several "
        "GPUs (not yet run there).",
        _SWITCH,
        negatable=True,
    ),
    _flag("max_stop_sequences", "Largest number of stop sequences per request.", int),
    _flag("max_top_n_tokens", "Largest top_n_tokens per request.", int),
    _flag(
        "max_input_tokens",
        "Longest prompt in tokens. Default: min(max_position_embeddings - 1, 4095).",
        _positive_int,
        aliases=("--max-input-length",),
        env=("MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"),
    ),
    _flag(
        "max_total_tokens",
        "Prompt + generated tokens per request. Default: min(max_position_embeddings, 4096).",
        _positive_int,
    ),
    _flag(
        "max_batch_prefill_tokens",
        "Prompt tokens computed in one step. Default: max_input_tokens + 50.",
        _positive_int,
    ),
    _flag(
        "max_batch_total_tokens",
        "KV-cache capacity in tokens across the batch. Default: derived from free memory.",
        _positive_int,
    ),
    _flag("max_client_batch_size", "Most inputs in one Generate call.", _positive_int),
    _flag(
        "waiting_served_ratio",
        "With chunked prefill disabled or --prefill-batching: waiting/running ratio that "
        "triggers a prefill batch.",
        float,
    ),
    _flag(
        "max_waiting_tokens",
        "With chunked prefill disabled or --prefill-batching: decode steps before waiting "
        "requests are forced in.",
        int,
    ),
    _flag("max_batch_size", "Most requests in the running batch.", _positive_int),
    _flag(
        "chunked_prefill_size",
        "Most prompt tokens of one request per step. Default: max_batch_prefill_tokens on "
        "CUDA, at most 256 on CPU.",
        _positive_int,
    ),
    _flag("disable_chunked_prefill", "Prefill whole prompts in one step (TGI's policy).", _SWITCH),
    _flag("schedule_policy", "Order of the waiting queue.", choices=("fcfs", "lpm")),
    _flag(
        "prefill_batching",
        "Hold arrivals while a batch runs, by TGI's rule (--waiting-served-ratio, "
        "--max-waiting-tokens), also with chunked prefill, so prompts are prefilled in fewer, "
        "fuller steps. auto: on where decode steps replay CUDA graphs (a step with a prefill "
        "chunk runs eagerly and costs several graph steps); off: every arrival joins the "
        "next step.",
        choices=("auto", "on", "off"),
    ),
    _flag(
        "gpu_prefill_attention",
        "On CUDA, how a step with prompt rows attends: triton (one Triton paged-attention "
        "launch per layer for every row of the step), sdpa (torch's SDPA per prompt batch "
        "and per continuing chunk), sdpa-pinned (SDPA with flash / memory-efficient "
        "attention pinned and K/V expanded for GQA). auto: triton where the kernel runs "
        "(Triton >= 3.0, a power-of-two block size >= 16), else sdpa. Ignored on CPU.",
        choices=("auto", "triton", "sdpa", "sdpa-pinned"),
    ),
    _flag("disable_prefix_caching", "Do not reuse KV blocks across requests.", _SWITCH),
    _flag(
        "speculate",
        "N-gram draft tokens verified per decode step (TGI's n-gram speculation; 0: off). "
        "Greedy output is unchanged; the speedup depends on how much outputs repeat.",
        _non_negative_int,
    ),
    _flag(
        "speculate_max_batch_size",
        "Draft only while at most this many requests run (larger batches are compute-bound).",
        _non_negative_int,
    ),
    _flag(
        "disable_cpu_kernels",
        "On CPU: use torch ops instead of genserve's C++ kernels (a .gguf model is then "
        "dequantized unless --quantize asks otherwise).",
        _SWITCH,
    ),
    _flag(
        "cpu_int_dot",
        "On CPU, quantized weights (GGUF Q8_0/Q4_0/Q4_1/K-quants, --quantize int8/int4, MoE "
        "experts): multiply by activations rounded to int8 per block with integer dot "
        "products (VNNI or AVX2) instead of dequantizing to float32, as llama.cpp does. "
        "auto (default): integer wherever the CPU has a path, else float; on: integer, "
        "refused where impossible; off: the float path (greedy output equal to transformers' "
        "on the dequantized weights). Info.quantized_matmul says which "
        "(docs/cpu/integer-kernels.md).",
        choices=("auto", "on", "off"),
    ),
    _flag(
        "cpu_features_mask",
        "Testing and benchmarking only: CPU features genserve's kernels treat as absent, to "
        "run the paths of another CPU on this one: avx2 (an AVX2-only CPU), avx512 (AVX-512 "
        "without VNNI/bfloat16/AMX/GFNI) or a comma list of GCC cpu names (avx512vnni, "
        "avx512bf16, avxvnni, amx-bf16, gfni, ...). Only removes paths "
        "(docs/benchmarks/cpu-avx2.md).",
        env=("GENSERVE_CPU_FEATURES_MASK",),
    ),
    _flag(
        "deterministic",
        "Batch-invariant kernels (CPU): greedy and seeded output, tokens and logprobs, "
        "independent of what else is batched, the prefill chunk size and prefix-cache hits, "
        "in every dtype. Costs speed (docs/operations/first-start.md).",
        _SWITCH,
    ),
    _flag("block_size", "Tokens per KV-cache block.", _positive_int),
    _flag("cuda_memory_fraction", "Share of GPU memory genserve may use.", _fraction),
    _flag(
        "cuda_graphs",
        "Decode batch sizes captured as CUDA graphs, e.g. 1,2,4,8; 0 disables. Default: "
        "1,2,4,8,16,24,32,... up to --max-batch-size or 256. Ignored on CPU.",
        _cuda_graph_sizes,
    ),
    _flag(
        "cpu_memory_fraction",
        "On CPU: share of the memory available after loading used for the KV cache.",
        _fraction,
    ),
    _flag(
        "hostname",
        "Address to listen on. HOSTNAME is honoured only when it holds an IP address: shells "
        "and container runtimes set it to the machine's name.",
        _bind_address,
    ),
    _flag("port", "gRPC port.", int, aliases=("-p",)),
    _flag(
        "huggingface_hub_cache",
        "Hugging Face hub cache to resolve hub ids from.",
        Path,
        env=("HUGGINGFACE_HUB_CACHE", "HF_HUB_CACHE"),
    ),
    _flag(
        "genserve_cache",
        "Where converted models (GGUF → safetensors) and compiled CPU kernels are cached.",
        Path,
    ),
    _flag("num_shard", "Tensor-parallel shards.", _positive_int),
    _flag("sharded", "Shard the model (true: every visible GPU by default).", _bool),
    _flag(
        "expert_parallel",
        "Mixture-of-experts models on --num-shard 2 or more: each shard holds whole routed "
        "experts (a contiguous range, any expert count) instead of a slice of every "
        "expert's width; the shards' outputs are summed (docs/models/moe.md). Refused on "
        "one shard and for models without experts.",
        _SWITCH,
    ),
    _flag("master_addr", "torch.distributed rendezvous address.", str),
    _flag("master_port", "torch.distributed rendezvous port.", int),
    _flag("shutdown_timeout", "Seconds in-flight requests get to finish on SIGTERM.", float),
    _flag("json_output", "One JSON object per log line.", _SWITCH),
    _flag("log_requests", "Log prompts and outputs (off: they never reach the logs).", _SWITCH),
    _flag("otlp_endpoint", "OTLP/gRPC collector URL, e.g. http://collector:4317.", str),
    _flag("otlp_service_name", "service.name of exported spans.", str),
    _flag("prometheus_port", "Port of the Prometheus /metrics endpoint (0: off).", int),
    _flag(
        "chat_template",
        "Chat template for Chat/ChatStream: a Jinja file, or the template text itself "
        "(SGLang/vLLM). Default: the model's own.",
    ),
    _flag(
        "tokenizer_config_path",
        "A tokenizer_config.json whose chat_template is used (TGI's flag).",
        Path,
    ),
    _flag(
        "tool_call_parser",
        "Format tool calls are parsed from in Chat replies (SGLang/vLLM names). Default: the "
        "chat template's, else hermes (the server then writes the tools in the prompt).",
        choices=("hermes", "llama3", "llama3_json", "mistral", "qwen", "qwen25", "qwen3"),
    ),
    _flag(
        "reasoning_parser",
        "Split <think>...</think> out of Chat replies into reasoning_content (SGLang/vLLM).",
        choices=("deepseek-r1", "deepseek_r1", "qwen3"),
    ),
    _flag(
        "served_model_name",
        "The model name clients give as OpenAI's `model` and Info reports. Default: model id.",
    ),
    _flag(
        "lora_adapters",
        "LoRA adapters to preload (TGI): id=path,id2=path2 (PEFT directories) or hub ids.",
    ),
    _flag("adapter_id", "LoRA adapter for requests that name none (LoRAX). Default: none."),
    _flag(
        "adapter_source",
        "Where adapter ids not in --lora-adapters are found: local (a directory path) or hub "
        "(the local Hugging Face cache; no network).",
        choices=("local", "hub"),
    ),
    _flag(
        "max_active_adapters",
        "LoRA adapters held in memory; beyond it the least recently used idle one is evicted.",
        _positive_int,
    ),
    _flag(
        "max_loras_per_batch",
        "Distinct LoRA adapters in one step (SGLang). Default: --max-active-adapters.",
        _positive_int,
    ),
    _flag(
        "adapter_cycle_time_s",
        "Seconds an adapter keeps taking new requests while another adapter waits for a "
        "place under --max-loras-per-batch, before it drains and yields (LoRAX). Default: 2.",
        _seconds,
    ),
    # No environment variable, as TGI: "ENV" means something else to POSIX shells.
    _flag("env", "Log the runtime environment at start-up.", _SWITCH, aliases=("-e",), env=("",)),
    _flag(
        "api_key",
        "Require 'authorization: Bearer KEY' metadata on every RPC (UNAUTHENTICATED otherwise) "
        "except the --api-key-exempt services. Prefer the environment variable: flags show in ps.",
    ),
    _flag(
        "api_key_exempt",
        "Comma-separated services answered without the API key (health probes, reflection); "
        "empty: none.",
        _service_list,
    ),
    _flag("tls_cert_file", "PEM server certificate chain: serve TLS instead of plaintext.", Path),
    _flag("tls_key_file", "PEM private key of --tls-cert-file.", Path),
    _flag(
        "tls_client_ca_file",
        "PEM CA bundle: require client certificates signed by it (mutual TLS).",
        Path,
    ),
    _flag(
        "max_message_size",
        "Largest gRPC message in bytes, either way; larger ones get RESOURCE_EXHAUSTED.",
        _positive_int,
        aliases=("--payload-limit",),
        env=("MAX_MESSAGE_SIZE", "PAYLOAD_LIMIT"),
    ),
    _flag(
        "keepalive_min_ping_interval",
        "Seconds a client must leave between HTTP/2 pings; faster pingers, or pings on a "
        "connection with no call, get GOAWAY (too_many_pings).",
        _seconds,
    ),
    _flag(
        "max_connection_idle",
        "Seconds a connection may stay without calls before GOAWAY (0: forever).",
        _seconds,
    ),
    _flag(
        "max_connection_age",
        "Seconds before a connection gets GOAWAY, to spread clients over replicas (0: forever).",
        _seconds,
    ),
    _flag(
        "max_connection_age_grace",
        "Seconds calls on a connection past --max-connection-age may still run.",
        _seconds,
    ),
    _flag(
        "otel_propagators",
        "Trace headers continued from callers, comma-separated: tracecontext, baggage, b3 "
        "(reads b3 and x-b3-*), b3multi, none.",
        _propagators,
        env=("OTEL_PROPAGATORS",),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="genserve",
        description="genserve: gRPC text-generation server. Every flag can also be given as "
        "an environment variable (upper snake case, as TGI).",
    )
    defaults = Config()
    for flag in FLAGS:
        default = getattr(defaults, flag.dest)
        env_text = ", ".join(name for name in flag.env if name)
        help_text = f"{flag.help} [env: {env_text}]" if env_text else flag.help
        if flag.parse is None and flag.negatable:
            parser.add_argument(
                *flag.names,
                dest=flag.dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text + " [default: auto]",
            )
            continue
        if flag.parse is None:
            parser.add_argument(*flag.names, dest=flag.dest, action="store_true", help=help_text)
            continue
        if default is not None and not isinstance(default, bool):
            shown = ",".join(default) if isinstance(default, tuple) else default
            help_text += f" [default: {shown}]"
        parser.add_argument(
            *flag.names,
            dest=flag.dest,
            type=flag.parse,
            choices=flag.choices,
            default=None,
            help=help_text,
        )
    parser.add_argument("-V", "--version", action="version", version=f"genserve {VERSION}")
    return parser


def _from_env(flag: _Flag, environ: Mapping[str, str]) -> Any:
    for name in flag.env:
        raw = environ.get(name) if name else None
        if raw is None or raw == "":
            continue
        if name == "HOSTNAME" and not _is_ip_literal(raw):
            continue
        if flag.parse is None:
            return _bool(raw)
        value = flag.parse(raw)
        if flag.choices and value not in flag.choices:
            raise SystemExit(f"genserve: {name}={raw!r} is not one of {', '.join(flag.choices)}")
        return value
    return None


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Parse flags, falling back to environment variables, then to the defaults."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    for flag in FLAGS:
        given = getattr(args, flag.dest)
        if flag.parse is None and not flag.negatable:
            given = True if given else None
        if given is None:
            try:
                given = _from_env(flag, environ)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise SystemExit(
                    f"genserve: bad environment value for {flag.env[0]}: {exc}"
                ) from None
        if given is not None:
            values[flag.dest] = given
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in values.items() if k in known})


def environment_cache(environ: Mapping[str, str] | None = None) -> Path:
    """The cache this environment names (``GENSERVE_CACHE``, else ``~/.cache/genserve``): what
    ``--genserve-cache`` falls back to, for code that runs without the launcher's config (the
    CPU kernels' build, ``python -m genserve.kernels.cpu``, tests).  Reads that variable
    only, so a bad value of another one cannot stop it."""
    flag = next(f for f in FLAGS if f.dest == "genserve_cache")
    given = _from_env(flag, os.environ if environ is None else environ)
    return Path(given) if given is not None else DEFAULT_GENSERVE_CACHE


def runtime_environment() -> dict[str, str]:
    """What ``--env`` logs: enough to reproduce a bug report."""
    import platform

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
        "genserve": VERSION,
    }
    for var in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "HF_HUB_OFFLINE"):
        if var in os.environ:
            info[var] = os.environ[var]
    return info
