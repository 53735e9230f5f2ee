"""The ``genserve`` launcher: flags → config → model runner, engine and gRPC server, wired.

The gRPC port opens first, with health NOT_SERVING, so that probes see "loading" rather
than "connection refused" while the model loads and warms up.

Over ~500 lines because it is the wiring: every object the server runs is built here from
the config (the layers below never read it), so each new capability adds its few lines of
construction to this one module."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from genserve import serving_defaults
from genserve.adapter_metrics import AdapterCollector
from genserve.chat_template import ChatRenderer, load_template_override
from genserve.config import VERSION, Config, load_config, runtime_environment
from genserve.dtype_choice import choose_dtype
from genserve.engine.adapter_manager import AdapterSettings, start_adapters
from genserve.engine.async_engine import AsyncEngine
from genserve.engine.engine_process import (
    EnginePartDiedError,
    EngineProcess,
    FrontLink,
    serve_engine,
    spawn_engine,
)
from genserve.engine.heap import freeze_startup_heap, unfreeze_heap
from genserve.engine.process_engine import ProcessEngine
from genserve.engine.rotary_salt import LengthRotary, length_rotary
from genserve.engine.scheduler import Scheduler
from genserve.engine.scheduler_config import SchedulePolicy, SchedulerConfig
from genserve.engine.step_wire import EngineHello
from genserve.limits import LimitsError, ServingLimits, derive_limits, token_limits
from genserve.logging import configure_logging
from genserve.metrics import Metrics, MetricsServer, start_metrics_server
from genserve.model.fallback_options import disabled_features, restrict_for_fallback
from genserve.model.serving_path import choose_serving_path
from genserve.server.app import GrpcApp
from genserve.server.chat_reply import ChatFeatures, system_fingerprint
from genserve.server.conversion.limits import Limits
from genserve.server.decoding import RequestDecodingInterceptor
from genserve.server.interceptors import ObservabilityInterceptor
from genserve.server.observe import RequestObserver
from genserve.server.reasoning import reasoning_parser_named
from genserve.server.security import security_interceptors, server_credentials, server_options
from genserve.server.servicer import Serving, TextGenerationServicer
from genserve.server.tool_calls import choose_parser
from genserve.stray_output import capture as capture_stray_output
from genserve.tokenizer import Tokenizer
from genserve.tracing import configure_tracing, set_propagators
from genserve.v1 import generate_pb2 as pb

if TYPE_CHECKING:  # torch and the model load lazily: the port opens before they import
    import torch

    from genserve.engine.grammar import GrammarCompiler
    from genserve.model.loader import ResolvedModel
    from genserve.worker.model_runner import ModelRunner

log = structlog.get_logger("genserve")


@dataclass(frozen=True, slots=True)
class Loaded:
    """Everything built from the model before the engine starts."""

    runner: Any  # genserve.worker.model_runner.ModelRunner (a Runner)
    tokenizer: Tokenizer
    limits: ServingLimits
    info: pb.InfoResponse
    chat: ChatRenderer
    grammars: GrammarCompiler | None = None
    chat_features: ChatFeatures | None = None
    # The launcher's config as the model path allows it (genserve.model.fallback_options).
    config: Config | None = None
    model_dir: Path | None = None  # the resolved model's directory (tokenizer files)


def chat_features(config: Config, template: str | None, info: pb.InfoResponse) -> ChatFeatures:
    """--tool-call-parser / --reasoning-parser, and the fingerprint replies carry (#27)."""
    return ChatFeatures(
        tool_parser=choose_parser(config.tool_call_parser, template),
        reasoning=reasoning_parser_named(config.reasoning_parser)
        if config.reasoning_parser
        else None,
        system_fingerprint=system_fingerprint(
            VERSION, info.model_id, info.model_sha, info.model_dtype
        ),
    )


def _load(config: Config, on_shard_failure: Callable[[str], None]) -> Loaded:
    """Blocking: resolve and load the model, size the KV cache, warm up.  Runs in a thread.

    With more than one shard, ranks 1..N-1 are started here; ``on_shard_failure(reason)``
    is called (from another thread) if one of them dies, now or later."""
    import torch

    from genserve.kernels import cpu as cpu_kernels
    from genserve.kernels import int_dot
    from genserve.kernels.cpu_features import parse_mask
    from genserve.model.loader import resolve_model
    from genserve.model.quantization import MethodChoice, choose_method
    from genserve.parallel import ParallelContext
    from genserve.worker.model_runner import ModelRunner
    from genserve.worker.shard_plan import check_expert_parallel, resolve_num_shard

    # A bad --chat-template fails the start before minutes of loading, not after.
    chat_template = load_template_override(config.chat_template, config.tokenizer_config_path)
    resolved = resolve_model(
        config.model_id,
        revision=config.revision,
        hub_cache=config.huggingface_hub_cache,
        cache_dir=config.genserve_cache / "models",
        trust_remote_code=config.trust_remote_code,
    )
    # Native or the transformers fallback; the fallback switches off what it cannot do.
    serving = choose_serving_path(
        resolved.local_dir, config.trust_remote_code, config.model_impl, resolved.derived_memo
    )
    log.info(
        "serving_path",
        architecture=serving.architecture,
        implementation=serving.implementation,
        reason=serving.reason,
    )
    config = restrict_for_fallback(config, serving)
    # Before any weight is read: a directory without a tokenizer fails in a second.
    tokenizer = _tokenizer(resolved.local_dir, config.trust_remote_code, resolved.derived_memo)
    try:
        hidden_features = parse_mask(config.cpu_features_mask)
    except ValueError as exc:
        raise SystemExit(f"genserve: --cpu-features-mask: {exc}") from None
    cpu_kernels.configure(
        config.genserve_cache / "kernels",
        not config.disable_cpu_kernels,
        batch_invariant=config.deterministic,
        hidden_features=hidden_features,
    )
    if hidden_features:
        log.warning(
            "cpu_features_hidden",
            features=",".join(hidden_features),
            reason="--cpu-features-mask: an emulation for testing and benchmarking",
        )
    if config.disable_cpu_kernels:
        log.info("cpu_kernels_disabled", reason="--disable-cpu-kernels")
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    dtype = choose_dtype(config.dtype, on_cuda, hidden_features)
    log.info("dtype", dtype=dtype.name, reason=dtype.reason)
    dtype_name = dtype.name
    quantize = choose_method(
        config.quantize,
        from_gguf=resolved.gguf_file is not None,
        kernels=cpu_kernels.usable(device, getattr(torch, dtype_name)),
    )
    if not serving.is_native and quantize.method is not None:
        quantize = MethodChoice(None, "the transformers fallback serves the model's own weights")
    log.info("quantize", method=quantize.method or "none", reason=quantize.reason)
    int_dot.configure(config.cpu_int_dot, dtype_name)
    int_dot_choice: int_dot.IntDotChoice | None = None  # None: no quantized weight on CPU
    if quantize.method is not None and not on_cuda:
        int_dot_choice = int_dot.choose()  # --cpu-int-dot on where impossible: refused here
        log.info(
            "cpu_int_dot",
            path=int_dot_choice.path,
            enabled=int_dot_choice.enabled,
            isa=int_dot_choice.isa.name if int_dot_choice.isa is not None else None,
            reason=int_dot_choice.reason,
        )
    if config.deterministic:
        _check_deterministic(device, cpu_kernels.batch_invariant())
    resolved = dataclasses.replace(
        resolved,
        rope_scaling=config.rope_scaling,
        rope_factor=config.rope_factor,
        quantize=quantize.method,
        model_impl=config.model_impl,
    )
    num_gpus = torch.cuda.device_count() if on_cuda else 0
    num_shard = resolve_num_shard(config.num_shard, config.sharded, num_gpus)
    check_expert_parallel(config.expert_parallel, num_shard)
    runner: ModelRunner
    if num_shard > 1:
        from genserve.worker.sharded_runner import ShardSettings, launch_sharded_runner

        settings = ShardSettings(
            master_addr=config.master_addr,
            master_port=config.master_port,
            cuda_memory_fraction=config.cuda_memory_fraction,
            cpu_memory_fraction=config.cpu_memory_fraction,
            json_output=config.json_output,
            trust_remote_code=config.trust_remote_code,
            kernel_cache_dir=config.genserve_cache / "kernels",
            cpu_kernels=not config.disable_cpu_kernels,
            deterministic=config.deterministic,
            cpu_int_dot=config.cpu_int_dot,
            cpu_features_mask=config.cpu_features_mask,
            expert_parallel=config.expert_parallel,
            gpu_prefill_attention=config.gpu_prefill_attention,
        )
        runner = launch_sharded_runner(resolved, settings, num_shard, dtype_name, on_shard_failure)
    else:
        runner = ModelRunner(
            resolved,
            dtype=getattr(torch, dtype_name),
            device=device,
            parallel=ParallelContext.single(),
            trust_remote_code=config.trust_remote_code,
            prefill_attention=config.gpu_prefill_attention,
        )
    try:
        loaded = _size_and_warm_up(
            config, resolved, runner, tokenizer, dtype_name, device, num_shard, chat_template
        )
    except BaseException:
        runner.shutdown()  # a sharded runner stops its workers
        raise
    if int_dot_choice is not None:
        loaded.info.quantized_matmul = int_dot_choice.path
        loaded.info.quantized_matmul_isa = (
            int_dot_choice.isa.name if int_dot_choice.isa is not None else ""
        )
    return loaded


def _tokenizer(model_dir: Path, trust_remote_code: bool, memo_dir: Path | None) -> Tokenizer:
    """The model's tokenizer, of the class remembered from an earlier start where there is
    one (``model/derived_memo.py``: no transformers config class imported for it)."""
    from genserve.model.derived_memo import DerivedMemo

    memo = DerivedMemo(memo_dir, model_dir, trust_remote_code)
    remembered = memo.tokenizer_class()
    tokenizer = Tokenizer(model_dir, trust_remote_code, remembered)
    if remembered is None:
        memo.remember_tokenizer_class(type(tokenizer.hf))
    return tokenizer


def _check_deterministic(device: Any, batch_invariant: bool) -> None:
    """--deterministic is a promise: refuse to start where the batch-invariant kernels do not
    run, rather than serve output that moves with load."""
    if device.type != "cpu":
        raise ValueError(
            "--deterministic has batch-invariant kernels on CPU only; this server would run "
            f"on {device.type}, whose matmul and attention kernels change with the batch"
        )
    if not batch_invariant:
        raise ValueError(
            "--deterministic needs genserve's CPU kernels (drop --disable-cpu-kernels, or see "
            "the cpu_kernels_unavailable log line for why they did not build)"
        )
    log.info("deterministic", detail="batch-invariant kernels: output independent of batching")


def _enable_cuda_graphs(config: Config, runner: ModelRunner, max_positions: int | None) -> None:
    from genserve.worker.cuda_graphs import default_batch_sizes

    sizes = config.cuda_graphs
    if sizes is None:
        sizes = default_batch_sizes(config.max_batch_size or config.max_concurrent_requests)
    # The block table's width: the longest context a request may reach, i.e. the derived
    # total-token limit (TGI's min(max_pos, 4096) by default), not max_position_embeddings
    # (131,072 for Llama-3.1 would mean 8,192 columns and a 16 GiB trial cache).
    max_seq_len = token_limits(config, _scaled_max_pos(max_positions, config))[1]
    runner.enable_cuda_graphs(sizes, max_seq_len, config.block_size)


def _size_and_warm_up(
    config: Config,
    resolved: ResolvedModel,
    runner: ModelRunner,  # rank 0's (a ShardedModelRunner keeps the workers in step)
    tokenizer: Tokenizer,
    dtype_name: str,
    device: torch.device,
    num_shard: int,
    chat_template: str | None = None,
) -> Loaded:
    on_cuda = device.type == "cuda"
    chat = ChatRenderer(tokenizer.hf, resolved.model_id, chat_template)
    log.info("chat_template", loaded=chat.has_template, source=_template_source(config, chat))
    hf_config = json.loads((resolved.local_dir / "config.json").read_text())
    fraction = config.cuda_memory_fraction if on_cuda else config.cpu_memory_fraction
    if on_cuda and num_shard == 1 and config.cuda_graphs != ():  # before sizing: #12
        _enable_cuda_graphs(config, runner, hf_config.get("max_position_embeddings"))
    bytes_per_block = runner.kv_cache_bytes_per_block(config.block_size)
    memory_budget = runner.available_kv_memory_bytes(fraction)
    memory_num_blocks = memory_budget // bytes_per_block
    limits = derive_limits(
        config,
        _scaled_max_pos(hf_config.get("max_position_embeddings"), config),
        int(memory_num_blocks),
        on_cuda,
    )
    # What was taken and why: the limits' need, unless the memory budget (or an explicit
    # --max-batch-total-tokens) set it.
    log.info(
        "kv_cache_sized",
        num_blocks=limits.num_kv_blocks,
        block_size=limits.block_size,
        max_batch_total_tokens=limits.max_batch_total_tokens,
        bytes=limits.num_kv_blocks * bytes_per_block,
        bytes_per_block=bytes_per_block,
        sized_by=limits.kv_sized_by,
        full_length_requests=limits.kv_requests,
        needed_bytes=limits.kv_blocks_needed * bytes_per_block,
        memory_budget_bytes=memory_budget,
        memory_fraction=fraction,
    )
    runner.initialize_kv_cache(limits.num_kv_blocks, limits.block_size)
    runner.warmup()
    info = pb.InfoResponse(
        model_id=resolved.model_id,
        model_sha=resolved.revision or "",
        model_dtype=dtype_name,
        model_device_type=device.type,
        num_shard=num_shard,
        block_size=limits.block_size,
        num_kv_blocks=limits.num_kv_blocks,
        cuda_graph_batch_sizes=list(runner.cuda_graph_sizes),
        quantize=resolved.quantize or "",
        model_weight_bytes=runner.weight_bytes(),
        max_concurrent_requests=config.max_concurrent_requests,
        max_best_of=config.max_best_of,
        watermark_gamma=config.watermark_gamma,
        watermark_delta=config.watermark_delta,
        max_stop_sequences=config.max_stop_sequences,
        max_top_n_tokens=config.max_top_n_tokens,
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
        max_batch_total_tokens=limits.max_batch_total_tokens,
        max_client_batch_size=config.max_client_batch_size,
        version=VERSION,
        speculate=config.speculate,
        has_chat_template=chat.has_template,
        served_model_name=config.served_model_name or resolved.model_id,
        grammar_support=not config.disable_grammar_support,
        # The logits width bounds logit_bias / stop_token_ids / input_ids (issue #15).
        vocab_size=int(hf_config.get("vocab_size") or tokenizer.vocab_size),
        max_active_adapters=config.max_active_adapters,
        max_loras_per_batch=config.max_loras_per_batch or config.max_active_adapters,
        default_adapter_id=config.adapter_id or "",
        architecture=runner.serving.architecture,
        implementation=runner.serving.implementation,
        disabled_features=list(disabled_features(runner.serving)),
        kv_cache_bytes=limits.num_kv_blocks * bytes_per_block,
        kv_cache_sized_by=limits.kv_sized_by,
        fill_in_middle=tokenizer.fim_tokens is not None,
    )
    features = chat_features(config, chat.template, info)
    info.tool_call_parser = features.tool_parser.name
    info.reasoning_parser = features.reasoning.name if features.reasoning else ""
    grammars = None
    if not config.disable_grammar_support:
        from genserve.engine.grammar import GrammarCompiler

        # Masks span the logits (the model's vocab_size), which may exceed the tokenizer's.
        vocab = int(hf_config.get("vocab_size") or tokenizer.vocab_size)
        grammars = GrammarCompiler(tokenizer.hf, vocab, sorted(tokenizer.eos_token_ids))
    return Loaded(
        runner=runner,
        tokenizer=tokenizer,
        limits=limits,
        info=info,
        chat=chat,
        grammars=grammars,
        config=config,
        chat_features=features,
        model_dir=resolved.local_dir,
    )


def _limit_sources(limits: ServingLimits) -> dict[str, str]:
    """What refused requests cite for the per-request limits: their flags, or the cause that
    lowered them (limits.derive_limits)."""
    if limits.lowered_by is None:
        return {}
    cause = f"lowered to fit the KV cache by {limits.lowered_by}"
    return {"input_limit_source": cause, "total_limit_source": cause}


def _template_source(config: Config, chat: ChatRenderer) -> str | None:
    if config.chat_template:
        return "--chat-template"
    if config.tokenizer_config_path is not None:
        return "--tokenizer-config-path"
    return "model" if chat.has_template else None


def batch_arrivals(mode: str, graphs_replayed: bool) -> bool:
    """``--prefill-batching``: auto holds arrivals (TGI's rule) where decode steps replay CUDA
    graphs.  There a step that carries a prefill chunk runs eagerly: on the GPU machine an 8B
    model's eager step cost several graph steps of host time, so admitting each arrival at
    once made every other step eager (64 streams: 1.4k tok/s served against 11.7k for the
    runner's graph steps)."""
    return mode == "on" or (mode == "auto" and graphs_replayed)


def _length_rotary(runner: Any) -> LengthRotary | None:
    """The served model's length-dependent rotary, if any (None for the transformers
    fallback, whose runner has no ``config.rope``)."""
    rope = getattr(getattr(runner, "config", None), "rope", None)
    return None if rope is None else length_rotary(rope.rope_type, rope.params)


def _scheduler(
    config: Config, limits: ServingLimits, graphs_replayed: bool, runner: Any
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=limits.num_kv_blocks,
            block_size=limits.block_size,
            max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
            chunked_prefill_enabled=not config.disable_chunked_prefill,
            chunked_prefill_size=limits.chunked_prefill_size,
            max_num_running=config.max_batch_size,
            policy=SchedulePolicy(config.schedule_policy),
            enable_prefix_caching=not config.disable_prefix_caching,
            length_rotary=_length_rotary(runner),
            waiting_served_ratio=config.waiting_served_ratio,
            max_waiting_tokens=config.max_waiting_tokens,
            batch_arrivals=batch_arrivals(config.prefill_batching, graphs_replayed),
            num_speculative_tokens=config.speculate,
            speculate_max_batch_size=config.speculate_max_batch_size,
            max_loras_per_batch=config.max_loras_per_batch,
            adapter_cycle_time_s=config.adapter_cycle_time_s,
        )
    )


async def _load_in_thread(config: Config, on_shard_failure: Callable[[str], None]) -> Loaded:
    """Load in a daemon thread: a signal during loading must not wait for it to finish."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Loaded] = loop.create_future()

    def work() -> None:
        try:
            loaded = _load(config, on_shard_failure)
        except BaseException as exc:  # handed to the event loop, which reports it
            loop.call_soon_threadsafe(_set_exception, future, exc)
        else:
            loop.call_soon_threadsafe(_set_result, future, loaded)

    threading.Thread(target=work, name="genserve-load", daemon=True).start()
    return await future


def _set_result(future: asyncio.Future[Loaded], value: Loaded) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Loaded], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


# ------------------------------------------------------------------ --engine-process (#29)
@dataclass(frozen=True, slots=True)
class _EngineSummary:
    """What the engine process sends the gRPC process once it has loaded (picklable)."""

    info: bytes  # pb.InfoResponse, serialised
    limits: ServingLimits
    config: Config  # as the model path allows it (restrict_for_fallback)
    model_dir: Path
    chat_template: str | None
    model_config: Any  # genserve.model.spec.ModelConfig: what LoRA adapters are checked against


def _engine_child(config: Config, from_front: Any, to_front: Any) -> None:
    """The engine process's entry point (spawned): load, then serve the engine loop.

    With ``--num-shard`` > 1 / ``--sharded`` this process is rank 0: ``_load`` starts and
    joins ranks 1..N-1 exactly as the one-process launcher does (gloo on CPU, NCCL on CUDA);
    a rank's death is reported to the front (``FrontLink.part_died``), and this process's
    exit, however it comes, ends the ranks through their lifeline pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C drains the gRPC process; it ends us
    configure_logging(config.json_output)
    link = FrontLink(to_front)
    try:
        loaded = _load(config, link.part_died)
        served = loaded.config if loaded.config is not None else config
        scheduler = _scheduler(
            served, loaded.limits, bool(loaded.info.cuda_graph_batch_sizes), loaded.runner
        )
        assert loaded.model_dir is not None
        summary = _EngineSummary(
            loaded.info.SerializeToString(),
            loaded.limits,
            served,
            loaded.model_dir,
            loaded.chat.template,
            loaded.runner.config,
        )
    except BaseException as exc:  # the gRPC process reports it and exits as it would
        link.send_failure(exc)
        os._exit(1)
    freeze_startup_heap()
    serve_engine(
        scheduler,
        loaded.runner,
        loaded.tokenizer,
        bool(served.overlap_scheduling),  # None (auto, not decided: tests): off
        loaded.grammars,
        summary,
        from_front,
        link,
    )


def _front_loaded(summary: _EngineSummary) -> Loaded:
    """Blocking: the gRPC process's share: its own tokenizer, chat template and grammar
    compiler (a grammar is validated and compiled here, then again in the engine process
    from its spec), no runner."""
    config = summary.config
    info = pb.InfoResponse.FromString(summary.info)
    from genserve.model.model_cache import derived_memo_dir

    memo_dir = derived_memo_dir(config.genserve_cache / "models")
    tokenizer = _tokenizer(summary.model_dir, config.trust_remote_code, memo_dir)
    chat = ChatRenderer(tokenizer.hf, info.model_id, summary.chat_template)
    grammars = None
    if info.grammar_support:
        from genserve.engine.grammar import GrammarCompiler

        # The width the engine process's compiler uses (its masks span the logits).
        grammars = GrammarCompiler(tokenizer.hf, info.vocab_size, sorted(tokenizer.eos_token_ids))
    return Loaded(
        runner=None,
        tokenizer=tokenizer,
        limits=summary.limits,
        info=info,
        chat=chat,
        chat_features=chat_features(config, chat.template, info),
        grammars=grammars,
        config=config,
        model_dir=summary.model_dir,
    )


async def _load_engine_process(config: Config) -> tuple[Loaded, EngineProcess, EngineHello]:
    engine = spawn_engine(_engine_child, config)
    try:
        hello = await asyncio.to_thread(engine.wait_hello)
        loaded = await asyncio.to_thread(_front_loaded, hello.payload)
    except BaseException:  # a failed load, or a shutdown during it: no orphan
        engine.kill()
        raise
    log.info("engine_process_started", pid=hello.pid)
    return loaded, engine, hello


class Service:
    """One genserve server: the gRPC port, the model loading behind it, the engine.

    ``start`` opens the port at once (health NOT_SERVING); ``wait_ready`` returns when the
    model is loaded and health says SERVING; ``stop`` drains and shuts everything down."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # Observability: metrics unless --prometheus-port 0, traces only with --otlp-endpoint.
        self.metrics = Metrics() if config.prometheus_port else None
        set_propagators(config.otel_propagators)
        self.tracing = configure_tracing(config.otlp_endpoint, config.otlp_service_name, VERSION)
        tracer = self.tracing.tracer if self.tracing is not None else None
        observer = RequestObserver(self.metrics, tracer, log_requests=config.log_requests)
        self.servicer = TextGenerationServicer(observer)
        self.app = GrpcApp(
            self.servicer,
            interceptors=[
                RequestDecodingInterceptor(),
                *security_interceptors(config),
                ObservabilityInterceptor(self.metrics, tracer),
            ],
            options=server_options(config),
        )
        self.metrics_server: MetricsServer | None = None
        self.port = 0
        self.engine: AsyncEngine | ProcessEngine | None = None
        self.loaded: Loaded | None = None
        self._loading: asyncio.Future[Any] | None = None
        self._health_watch: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.shard_failed = asyncio.Event()  # set once a shard process died
        self.shard_failure: str | None = None
        self._not_serving: asyncio.Future[None] | None = None

    async def start(self) -> int:
        self._loop = asyncio.get_running_loop()
        if self.metrics is not None and self.config.prometheus_port:
            self.metrics_server = start_metrics_server(
                self.metrics, self.config.hostname, self.config.prometheus_port
            )
            log.info("metrics_endpoint_started", port=self.metrics_server.port, path="/metrics")
        credentials = server_credentials(self.config)
        self.port = await self.app.start(self.config.hostname, self.config.port, credentials)
        log.info(
            "listening",
            address=f"{self.config.hostname}:{self.port}",
            health="NOT_SERVING",
            tls="mutual" if self.config.tls_client_ca_file else bool(credentials),
            api_key=self.config.api_key is not None,
        )
        self._loading = asyncio.ensure_future(self._load())
        return self.port

    async def _load(self) -> Loaded | tuple[Loaded, EngineProcess, EngineHello]:
        """Decide the switches left to the launcher (``serving_defaults``: it imports torch to
        count GPUs, so after the port is open and off the event loop), then load here or in
        the engine process."""
        if self.config.overlap_scheduling is None or self.config.engine_process is None:
            gpus = await asyncio.to_thread(serving_defaults.visible_gpus)
            self.config = serving_defaults.decide(self.config, gpus)
            log.info(
                "serving_defaults",
                overlap_scheduling=self.config.overlap_scheduling,
                engine_process=self.config.engine_process,
                reason="auto: on where the model serves on CUDA (the engine process on one GPU)",
            )
        if self.config.engine_process:
            return await _load_engine_process(self.config)
        return await _load_in_thread(self.config, self._on_shard_failure)

    async def wait_ready(self) -> None:
        """Raises what loading raised (LimitsError, FileNotFoundError, ...)."""
        assert self._loading is not None, "start() first"
        loaded, engine = await self._engine(await self._loading)
        config = loaded.config if loaded.config is not None else self.config
        engine.step_observers.append(self.servicer.observer.on_step)
        engine.start()
        if self.metrics is not None:
            if isinstance(engine, ProcessEngine):  # the stats of the last step received
                self.metrics.scheduler.bind(engine.scheduler_stats)
            else:  # the scheduler belongs to the engine thread: scrapes read it there
                self.metrics.scheduler.bind(engine.scheduler.stats, engine.engine_loop)
            self.metrics.set_info(
                model_id=loaded.info.model_id,
                dtype=loaded.info.model_dtype,
                device=loaded.info.model_device_type,
                version=VERSION,
            )
        self.servicer.attach(
            Serving(
                engine=engine,
                tokenizer=loaded.tokenizer,
                limits=Limits(
                    max_best_of=config.max_best_of,
                    watermark_gamma=config.watermark_gamma,
                    watermark_delta=config.watermark_delta,
                    max_stop_sequences=config.max_stop_sequences,
                    max_top_n_tokens=config.max_top_n_tokens,
                    max_input_tokens=loaded.limits.max_input_tokens,
                    max_total_tokens=loaded.limits.max_total_tokens,
                    max_client_batch_size=config.max_client_batch_size,
                    vocab_size=loaded.info.vocab_size,
                    **_limit_sources(loaded.limits),
                ),
                info=loaded.info,
                max_concurrent_requests=config.max_concurrent_requests,
                chat=loaded.chat,
                grammars=loaded.grammars,
                chat_features=loaded.chat_features,
            )
        )
        self.engine, self.loaded = engine, loaded
        await self.app.set_serving(True)
        self._health_watch = asyncio.ensure_future(self._follow_engine(engine))
        # Start-up is done: keep the collector's full passes off the model's objects.
        frozen = freeze_startup_heap()
        log.info(
            "serving",
            gc_frozen_objects=frozen,
            model_id=loaded.info.model_id,
            dtype=loaded.info.model_dtype,
            max_input_tokens=loaded.limits.max_input_tokens,
            max_total_tokens=loaded.limits.max_total_tokens,
            max_batch_total_tokens=loaded.limits.max_batch_total_tokens,
        )

    async def _engine(self, load_result: Any) -> tuple[Loaded, AsyncEngine | ProcessEngine]:
        """The engine over what loading gave: in this process, or the --engine-process one."""
        engine: AsyncEngine | ProcessEngine
        process: EngineProcess | None = None
        if self.config.engine_process:
            loaded, process, hello = load_result
            config = loaded.config if loaded.config is not None else self.config
            # Its death ends the server as a shard's does (UNAVAILABLE, NOT_SERVING, exit 1).
            engine = ProcessEngine(process, hello, self._on_shard_failure)
            if loaded.grammars is not None:  # both processes compile a new grammar at once
                loaded.grammars.on_compile = engine.compile_ahead
            model_config = hello.payload.model_config
        else:
            loaded = load_result
            config = loaded.config if loaded.config is not None else self.config
            engine = AsyncEngine(
                _scheduler(
                    config,
                    loaded.limits,
                    bool(loaded.info.cuda_graph_batch_sizes),
                    loaded.runner,
                ),
                loaded.runner,
                loaded.tokenizer,
                overlap=bool(config.overlap_scheduling),  # None: not decided (tests): off
            )
            model_config = loaded.runner.config
        adapter_settings = AdapterSettings(
            lora_adapters=config.lora_adapters,
            default_id=config.adapter_id,
            source=config.adapter_source,
            max_active=config.max_active_adapters,
        )
        try:
            engine.adapters = await start_adapters(adapter_settings, model_config, loaded.info)
        except BaseException:  # a bad --lora-adapters entry: no engine process left behind
            if process is not None:
                await asyncio.to_thread(process.kill)
            raise
        if self.metrics is not None:
            self.metrics.registry.register(AdapterCollector(engine.adapters))
        return loaded, engine

    def _on_shard_failure(self, reason: str) -> None:
        """A shard process died or the group broke.  Called from any thread: fails every
        in-flight request (UNAVAILABLE), turns health NOT_SERVING, wakes ``serve``."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._shard_failed_now, reason)

    def _shard_failed_now(self, reason: str) -> None:
        if self.shard_failure is not None:
            return
        self.shard_failure = reason
        if self.engine is not None:
            self.engine.mark_dead(reason)
        self._not_serving = asyncio.ensure_future(self.app.set_serving(False))
        self.shard_failed.set()

    async def _follow_engine(self, engine: AsyncEngine | ProcessEngine) -> None:
        """grpc.health follows the engine: NOT_SERVING once it can no longer generate (a
        shard worker died), not only at shutdown.  Polls: two reads per second."""
        while engine.is_ready:  # noqa: ASYNC110 (the engine exposes no "died" event)
            await asyncio.sleep(0.5)
        if engine.dead_reason is not None:
            await self.app.set_serving(False)
            log.error("health_not_serving", reason=engine.dead_reason)

    def end_drain(self, signal_name: str) -> None:
        """Abort the in-flight requests instead of waiting for them (a second signal)."""
        log.warning("shutdown_drain_ended", signal=signal_name, in_flight=self._in_flight())
        if self.engine is not None:
            self.engine.end_drain()

    def _in_flight(self) -> int:
        return self.engine.num_in_flight if self.engine is not None else 0

    async def stop(self) -> None:
        """Health NOT_SERVING, refuse new calls, give in-flight ones the shutdown timeout,
        abort the rest, stop the runner and the port."""
        log.info("shutdown_started", in_flight=self.servicer.num_in_flight)
        await self.app.set_serving(False)
        if self._health_watch is not None:
            self._health_watch.cancel()
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self.engine is not None:
            self.engine.stop_accepting()
            await self.engine.shutdown(self.config.shutdown_timeout)
        await self.app.stop(1.0)
        if self.tracing is not None:  # export the spans still buffered
            await asyncio.to_thread(self.tracing.shutdown)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)
        unfreeze_heap()  # a process that goes on (in-process tests) collects it again
        log.info("shutdown_complete")


async def serve(config: Config) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    service = Service(config)

    def on_signal(sig: signal.Signals) -> None:
        # The first signal drains (--shutdown-timeout); a second one, as an operator's
        # repeated Ctrl-C means, ends the drain at once.
        if stop.is_set():
            service.end_drain(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await service.start()
    except OSError as exc:  # a port is taken: say which, no traceback
        log.error("startup_failed", error=str(exc))
        await service.stop()
        return 2
    ready = asyncio.ensure_future(service.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(service.shard_failed.wait())
    await asyncio.wait({ready, stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
    if failed.done():
        ready.cancel()
        return await _exit_after_shard_failure(service, stopping, linger=False)
    if not ready.done():
        log.info("shutdown_during_load")
        ready.cancel()
        await service.stop()
        return 0
    try:
        ready.result()
    except EnginePartDiedError as exc:  # a shard died while the engine process loaded
        service.shard_failure = str(exc)
        return await _exit_after_shard_failure(service, stopping, linger=False)
    except (LimitsError, FileNotFoundError, ValueError) as exc:
        log.error("startup_failed", error=str(exc))
        await service.stop()
        return 2
    except Exception:
        log.exception("startup_failed")
        await service.stop()
        return 1
    await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
    if failed.done() and not stopping.done():
        return await _exit_after_shard_failure(service, stopping, linger=True)
    failed.cancel()
    await service.stop()
    return 0


# After a shard failure the server stays up this long answering health NOT_SERVING and
# every call UNAVAILABLE (with the reason), so probes and clients see why, then exits.
_FAILURE_LINGER_S = 2.0
EXIT_SHARD_FAILED = 1


async def _exit_after_shard_failure(
    service: Service, stopping: asyncio.Future[Any], linger: bool
) -> int:
    log.error("shard_failure_exit", reason=service.shard_failure, exit_code=EXIT_SHARD_FAILED)
    if linger:
        await asyncio.wait({stopping}, timeout=_FAILURE_LINGER_S)
    stopping.cancel()
    await service.stop()
    return EXIT_SHARD_FAILED


def _scaled_max_pos(max_pos: int | None, config: Config) -> int | None:
    """--rope-scaling/--rope-factor stretch the context the default limits derive from."""
    from genserve.model.rope_scaling import scaled_max_positions

    if max_pos is None:
        return None
    return scaled_max_positions(int(max_pos), config.rope_scaling, config.rope_factor)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["cache"]:  # genserve cache list|prune: no server, no torch
        from genserve.cache_cli import main as cache_main

        sys.exit(cache_main(args[1:]))
    config = load_config(args)
    # --json-output: stdout/stderr lines that bypass the logger (progress bars, libraries'
    # prints, C++ warnings, worker processes) are wrapped into JSON objects too.
    stray = capture_stray_output() if config.json_output else None
    configure_logging(config.json_output)
    if config.env:
        log.info("runtime_environment", **runtime_environment())
    cache: Path = config.genserve_cache
    log.info("starting", version=VERSION, model_id=config.model_id or "(default)", cache=str(cache))
    code = asyncio.run(serve(config))
    # serve() has stopped everything that needs an orderly stop.  Skip interpreter teardown:
    # a thread may still be inside torch — the model still loading when SIGTERM came (its
    # C++ state destroyed under it aborts the process), or a step stuck in a collective with
    # a dead peer (NCCL waits for its timeout) — and teardown would crash or wait for it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if stray is not None:
        stray.close()
    os._exit(code)


if __name__ == "__main__":
    main()
