"""The model runner: executes the scheduler's steps on the native paged model.

It owns the model, the KV-cache tensors and the per-request state the sampler needs
(worker/request_state.py), keyed by ``req_id``.  It implements :class:`genserve.step.Runner`
and never sees a request object: everything arrives in :class:`~genserve.step.SchedulerOutput`.

One step is one forward pass over every scheduled token, flattened (no padding), in the order
worker/step_inputs.py lays out; a pure-decode step replays a CUDA graph where one is captured
(worker/graph_plan.py).  Logits are computed only for the rows that need them (the last token
of a chunk that samples, every token of a speculative chunk, and the prompt positions of
requests asking for prompt logprobs); worker/step_outputs.py turns the sampled rows into the
step's tokens.  Host → device data goes through worker/device_io.py (pinned, asynchronous on
CUDA) and a decode step reads one packed block back (issue #29).  LoRA slots are
worker/adapters.py's :class:`~genserve.worker.adapters.AdapterSlots`.

Past ~500 lines (~550) on purpose: what is left is the runner's own state - the model, the
KV tensors, the per-request sampling state and the CUDA graphs - and the two things that
touch all of it, the start-up sequence (load, size, warm up, capture) and one step
(register, lay out, forward, sample).  Each part that stands alone already lives beside it
(step_inputs, step_outputs, request_state, runner_setup, graph_plan, adapters, sampler).
"""

from __future__ import annotations

import dataclasses
import os

import structlog
import torch

from genserve.kernels import fused_gpu_ops
from genserve.model import rope_scaling
from genserve.model.attention import AttentionBackend, TorchPagedAttention
from genserve.model.attention_backend import (
    PrefillAttentionFlag,
    resolve_prefill_attention,
    select_backend,
)
from genserve.model.config import UnsupportedModelError, load_model_config
from genserve.model.gpu_gemv_plan import enabled as gpu_gemv_enabled
from genserve.model.loader import ResolvedModel
from genserve.model.mla import latent_cache_shape
from genserve.model.quantize_model import model_weight_bytes
from genserve.model.registry import build_model
from genserve.model.serving_path import choose_serving_path
from genserve.parallel import ParallelContext
from genserve.step import (
    AdapterRef,
    NewRequestData,
    RunnerOutput,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from genserve.worker.adapters import AdapterSlots
from genserve.worker.cuda_graphs import DecodeGraphs
from genserve.worker.device_io import DeviceIO, Readback
from genserve.worker.graph_plan import (
    GraphPlan,
    GraphTarget,
    graph_forward,
    graph_greedy,
    graph_sample,
    plan_graphs,
    sampling_state,
)
from genserve.worker.launched_step import LaunchedStep, advance_counts
from genserve.worker.request_state import RequestState
from genserve.worker.runner_setup import (
    available_ram_bytes,
    keep_freed_memory,
    load_weights,
    zeros,
)
from genserve.worker.sampler import Sampler, SamplingRow
from genserve.worker.sampling_table import TableRows, uses_output_count
from genserve.worker.step_inputs import StepLayout, flat_inputs, layout
from genserve.worker.step_outputs import (
    accept,
    grammar_rows,
    prompt_logprob_parts,
    prompt_logprobs,
    sampling_rows,
)

log = structlog.get_logger("genserve.worker")

# On CUDA, part of the budget stays free for activations and allocator fragmentation.
_CUDA_ACTIVATION_RESERVE = 0.1
# The CPU warm-up's prompt: two of them make an 8-row prefill step (the batched kernels'
# path) and the decode step 2 rows, each one pass over the weights (see warmup()).
_CPU_WARMUP_PROMPT = 4


class ModelRunner:
    """Implements :class:`genserve.step.Runner` for the Llama family.

    Lifecycle: construct (loads weights) → :meth:`kv_cache_bytes_per_block` /
    :meth:`available_kv_memory_bytes` to size the cache → :meth:`initialize_kv_cache` →
    :meth:`warmup` → :meth:`execute_model` per step → :meth:`shutdown`.
    """

    def __init__(
        self,
        model: ResolvedModel,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext | None = None,
        trust_remote_code: bool = False,
        explicit_transfers: bool = False,
        prefill_attention: PrefillAttentionFlag = "auto",
    ) -> None:
        """``explicit_transfers``: on a CPU device, make every host↔device transfer an
        explicit copy and sample without value-dependent branches — the CUDA path, run on
        the CPU (the proof test of issue #29); no effect on CUDA.  ``prefill_attention``:
        ``--gpu-prefill-attention`` (``model/attention_backend.py``), resolved when the KV
        cache's block size is known."""
        self.resolved = model
        self.prefill_attention: PrefillAttentionFlag = prefill_attention
        self.dtype = dtype
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()
        self.parallel = parallel or ParallelContext.single()
        self.io = DeviceIO(device, explicit=explicit_transfers)
        # Native when genserve implements the architecture, else transformers' own modeling
        # code with the paged cache (model/serving_path.py, model/transformers_backend.py).
        self.serving = choose_serving_path(
            model.local_dir, trust_remote_code, model.model_impl, model.derived_memo
        )
        if not self.serving.is_native:
            self._init_fallback(model, trust_remote_code)
            return
        self.config = load_model_config(model.local_dir, trust_remote_code, model.derived_memo)
        if model.rope_scaling is not None or model.rope_factor is not None:
            self.config = dataclasses.replace(
                self.config,
                rope=rope_scaling.override(
                    self.config.rope,
                    model.rope_scaling,
                    model.rope_factor,
                    self.config.max_position_embeddings,
                ),
            )
        with torch.inference_mode():
            self.model = build_model(self.config, self.parallel, dtype, device)
        self.quantization = load_weights(self.model, model)
        if self.quantization is not None and device.type != "cpu":
            log.warning(
                "quantized_weights_without_kernel",
                device=device.type,
                detail="--quantize has CPU kernels only; on this device every matmul "
                "dequantizes its weight first (correct, slower than --dtype alone)",
            )
        from genserve.kernels import cpu as cpu_kernels

        if cpu_kernels.usable(device, dtype):
            # float32 and quantized weights go to column panels; half-precision decode steps
            # stream the plain weights through genserve's matvec up to a CPU-dependent row
            # count (oneDNN's GEMM beyond), so none are packed for oneDNN.
            self.model.use_fused_cpu_ops(matvec_rows=cpu_kernels.matvec_max_rows())
        else:
            with torch.inference_mode():
                self.model.pack_weights()
            if device.type == "cuda" and fused_gpu_ops.triton_runs(device):
                # One Triton launch per norm, rotary + K/V store and activation (#29); the
                # rotary tables cover every position the limits let a request reach.
                self.model.use_fused_gpu_ops(
                    rope_scaling.scaled_max_positions(
                        self.config.max_position_embeddings, model.rope_scaling, model.rope_factor
                    )
                )
                if gpu_gemv_enabled():
                    # Steps of 1-4 rows: projections whose Triton tile beats cuBLAS here.
                    self.model.use_gpu_gemv()
        self.model.eval()
        self._init_state(model)

    def _init_fallback(self, model: ResolvedModel, trust_remote_code: bool) -> None:
        """The transformers fallback: what it cannot do was switched off before (the
        launcher, genserve.model.fallback_options); here it is refused if asked anyway."""
        from genserve.model.transformers_backend import load_transformers_model

        if model.rope_scaling is not None or model.rope_factor is not None:
            raise UnsupportedModelError(
                "--rope-scaling/--rope-factor apply to natively served models only; "
                f"{self.serving.architecture} runs through the transformers fallback"
            )
        if model.quantize:
            raise UnsupportedModelError(
                f"--quantize {model.quantize} applies to natively served models only; "
                f"{self.serving.architecture} runs through the transformers fallback"
            )
        if self.parallel.world_size > 1:
            raise UnsupportedModelError("the transformers fallback runs on one shard only")
        with torch.inference_mode():
            self.model, self.config = load_transformers_model(  # type: ignore[assignment]
                model.local_dir, self.serving, self.dtype, self.device, trust_remote_code
            )
        self.quantization = None
        self._init_state(model)

    def _init_state(self, model: ResolvedModel) -> None:
        """Sampler, request and LoRA state (either model path), then the load log line."""
        self.sampler = Sampler(self.device, self.io)
        self._requests: dict[str, RequestState] = {}
        self._graph_plan: GraphPlan | None = None  # CUDA graphs for decode steps (#12)
        # Sampling parameters and penalty counts on the device, one slot per request, kept
        # across steps.
        self._fresh_sampling_state()
        # LoRA: hooks attached on the first adapter request; what each slot holds.
        self._adapters = AdapterSlots(self.model.enable_lora, self.config, self.dtype, self.device)
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.num_blocks = 0
        self.backend: AttentionBackend | None = None
        self._graphs: DecodeGraphs | None = None
        self._prompt_rows: bool | None = None  # see _prompt_rows_graphed
        self._graph_readback = Readback(self.io)  # the graph tails' one copy back
        # The last sampling step's token ids on the device and each request's row in them:
        # a placeholder chunk of the next step reads its input token there (issue #29).
        self._last_ids: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        # Steps launched and not yet collected (at most two: launch/collect, overlap).
        self._in_flight: list[LaunchedStep] = []
        log.info(
            "model_loaded",
            model_id=model.model_id,
            architecture=self.config.architecture,
            implementation=self.serving.implementation,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            rank=self.parallel.rank,
            world_size=self.parallel.world_size,
        )

    def weight_bytes(self) -> int:
        """Bytes of model weights this rank holds (quantized matrices at their packed size,
        a tied embedding and head once)."""
        return model_weight_bytes(self.model)

    # ----------------------------------------------------------------- KV cache sizing
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes on this rank: K and V, every layer, this rank's KV heads;
        with latent attention the latent and rope key rows instead (every rank holds them
        whole: model/mla.py)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        mla = self.config.mla
        if mla is not None:
            per_token = mla.cache_width * elem
        else:
            per_token = 2 * self.model.num_local_kv_heads * self.config.head_dim * elem
        return per_token * block_size * self.config.num_layers

    def available_kv_memory_bytes(self, fraction: float) -> int:
        """Memory the KV cache may take, measured now (after the weights are loaded).

        CUDA: ``total * fraction - used`` (used = everything already allocated on the
        device, by anyone), minus 10% kept for activations.  CPU: ``fraction`` of the
        memory the OS reports available (``MemAvailable``), activations being small next to
        the remainder.
        """
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * fraction - (total - free)
            graph_bytes = self._graph_plan.reserve_bytes if self._graph_plan else 0
            return max(0, int(budget * (1.0 - _CUDA_ACTIVATION_RESERVE)) - graph_bytes)
        return max(0, int(available_ram_bytes() * fraction))

    @torch.inference_mode()
    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate ``num_blocks`` blocks of ``block_size`` tokens for every layer.

        Zero-filled: attention masks out unused slots, but 0 * NaN garbage would still
        poison a softmax-weighted sum."""
        mla = self.config.mla
        prefill = resolve_prefill_attention(
            self.prefill_attention,
            self.device,
            block_size,
            self.dtype,
            self.config.head_dim,
            model_supported=self.serving.is_native and mla is None,
        )
        self.backend = select_backend(
            self.device,
            block_size,
            self.dtype,
            head_dim=self.config.head_dim,
            prefill=prefill,
            upload=self.io.upload_tensor,
        )
        sinks = self.serving.is_native and self.config.attention.sinks
        torch_metadata = not self.serving.is_native or sinks or mla is not None
        if torch_metadata and not isinstance(self.backend, TorchPagedAttention):
            from genserve.kernels import cpu as cpu_kernels

            # The fallback's attention and latent attention read TorchAttentionMetadata (and
            # the fallback its cache layout); flash-attn's paged kernel has no attention
            # sinks (gpt-oss).
            self.backend = TorchPagedAttention(
                self.device,
                use_cpu_kernel=cpu_kernels.usable(self.device, self.dtype),
                prefill=prefill,
                upload=self.io.upload_tensor,
            )
        # One scratch block past the scheduler's, for padding CUDA graph steps.
        allocated = num_blocks + (1 if self._graph_plan is not None else 0)
        if mla is not None:
            shape = latent_cache_shape(allocated, block_size, mla.cache_width)
        else:
            shape = self.backend.kv_cache_shape(
                allocated, block_size, self.model.num_local_kv_heads, self.config.head_dim
            )
        pool = zeros((self.config.num_layers, *shape), self.dtype, self.device)
        self.kv_caches = list(pool.unbind(0))
        self.block_size = block_size
        self.num_blocks = num_blocks
        log.info(
            "kv_cache_allocated",
            num_blocks=num_blocks,
            block_size=block_size,
            attention_backend=self.backend.name,
            bytes=pool.numel() * pool.element_size(),
        )

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run a prefill step, a decode step and the sampling paths once, so the first real
        request does not pay one-time costs; then zero the cache and forget the requests.

        What it guards: on a GPU, the Triton kernels' JIT compiles and CUDA graph capture
        (a prompt of two KV blocks, so block-crossing paths compile too); on CPU, the first
        call of each path (the C++ ops' dispatch, torch's and oneDNN's lazily made
        primitives, the sampler's ops) and the first touch of every weight page.  On CPU
        none of that depends on the prompt's length, while the step's cost grows with it
        (two 32-token prompts were ~1 minute of an 8B K-quant start on a busy 2-core host):
        there a prompt of :data:`_CPU_WARMUP_PROMPT` tokens, one pass over the weights."""
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must be called before warmup()")
        bs = self.block_size
        longest = 2 * bs if self.device.type != "cpu" else _CPU_WARMUP_PROMPT
        n = min(longest, max(1, self.num_blocks * bs // 2 - 1))  # prompt length
        blocks_each = -(-(n + 1) // bs)  # room for the prompt and one decoded token
        num_seqs = min(2, self.num_blocks // blocks_each)
        prompt = tuple(range(1, n + 1))
        reqs = [
            NewRequestData("warmup-greedy", prompt, n, 0, SamplingParams(num_top_tokens=2)),
            NewRequestData(
                "warmup-sampled",
                prompt,
                n,
                0,
                SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.1, seed=1),
            ),
        ][:num_seqs]
        tables = [tuple(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(num_seqs)]
        chunks = tuple(
            ScheduledChunk(r.req_id, prompt, 0, t, True) for r, t in zip(reqs, tables, strict=True)
        )
        out = self.execute_model(SchedulerOutput(-2, chunks, new_requests=tuple(reqs)))
        decode = tuple(
            ScheduledChunk(s.req_id, (s.token_id,), n, t, True)
            for s, t in zip(out.sampled, tables, strict=True)
        )
        self.execute_model(SchedulerOutput(-1, decode))
        self._requests.clear()
        if self.serving.per_request_state:
            self.model.end_requests()  # type: ignore[operator]
        self._fresh_sampling_state()
        self._last_ids, self._last_rows = None, {}
        self._in_flight.clear()
        if self.device.type == "cpu":
            self._zero_blocks(num_seqs * blocks_each)
        else:
            # A fresh zeroed pool rather than zero_() over every block.
            self.kv_caches = []  # drop the used pool first: two pools may not fit a GPU
            self._graphs = None
            self.initialize_kv_cache(self.num_blocks, self.block_size)
        if self._graph_plan is not None:
            self._graphs = self._graph_plan.capture(
                self.model,
                self.kv_caches,
                self.device,
                self._adapters.attached,
                (self._table, self._penalties),
            )

    def _zero_blocks(self, count: int) -> None:
        """Zero blocks ``0..count-1`` of every layer: what the warm-up wrote, on CPU.

        Not a fresh pool, as on CUDA: on CPU every (layer, K/V, KV head) slice of the pool is
        its own run of blocks (``(2, heads, blocks, block_size, head_dim)``), so a step over
        block 0 touches one page in each, a 2 MiB huge page each where THP is in madvise mode
        (256 for a 1B Llama: 16 layers, 8 KV heads).  A fresh pool made the first request
        fault them all in again (kernel zeroing, compaction under memory pressure: seconds
        on a busy host); the block pool hands out low ids first, so it reuses these."""
        for cache in self.kv_caches:
            # Block axis 2 in both CPU layouts (paged attention's and latent attention's).
            cache.narrow(2, 0, count).zero_()

    def _fresh_sampling_state(self) -> None:
        """Empty per-slot sampling state (slots allocated up front where graphs read it)."""
        self._table, self._penalties = sampling_state(
            self.config.vocab_size, self.device, self.io, self._graph_plan is not None
        )

    def enable_cuda_graphs(self, sizes: tuple[int, ...], max_seq_len: int, block_size: int) -> None:
        """Capture decode steps of ``sizes`` rows as CUDA graphs in :meth:`warmup`; call
        before sizing the KV cache, whose budget then leaves room for the graphs (measured by
        a trial capture).  No-op on CPU or without the Triton decode kernel (logged)."""
        if not self.serving.is_native:
            log.info("cuda_graphs_off", reason="the transformers fallback runs eagerly")
            return
        if self.config.attention.sinks:
            log.info("cuda_graphs_off", reason="attention sinks decode through eager attention")
            return
        if self.config.mla is not None:
            log.info("cuda_graphs_off", reason="latent attention runs eagerly")
            return
        target = GraphTarget(
            self.model,
            self.device,
            self.dtype,
            self.config.num_layers,
            self.model.num_local_kv_heads,
            self.config.head_dim,
            self.parallel.world_size,
        )
        self._graph_plan = plan_graphs(target, sizes, max_seq_len, block_size)

    @property
    def cuda_graph_sizes(self) -> tuple[int, ...]:
        """Batch sizes replayed from CUDA graphs (empty: every step runs eagerly)."""
        return self._graphs.captured_sizes if self._graphs is not None else ()

    # ------------------------------------------------------------------------- steps
    @property
    def supports_token_from_last_step(self) -> bool:
        """Whether chunks may carry a placeholder token (overlapped scheduling): one rank
        only; shard workers never see rank 0's sampled ids."""
        return self.parallel.world_size == 1

    @property
    def steps_inline(self) -> bool:
        """Whether a serial engine may call :meth:`execute_model` on its own thread instead
        of a step thread: on the CPU a step computes synchronously on the cores the engine
        shares, so a step thread buys no concurrency without overlap, only two thread
        hand-offs per step (~0.3 ms each measured on 2 vCPUs; docs/benchmarks/cpu.md).
        One rank only: a sharded step may never return, and a dead shard must still be able
        to fail the requests on the engine thread."""
        return self.device.type == "cpu" and self.parallel.world_size == 1

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        """Run one step as described by :class:`genserve.step.SchedulerOutput`:
        :meth:`launch`, then :meth:`collect`."""
        return self.collect(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        """Queue ``step`` on the device — inputs, forward, sampling, its one readback copy —
        and return without waiting for it; :meth:`collect` waits and gives its output.
        Call :meth:`collect` for each launched step, in launch order; the step thread of
        an overlapping engine launches step *n + 1* before it collects step *n*, whose
        sampled ids step *n + 1*'s placeholders read on the device.  A launch that needs
        a value only the readback gives (worker/launched_step.py) first collects the step
        before it, and at most two steps are ever uncollected (two readback buffers)."""
        if len(self._in_flight) > 1 or (self._in_flight and self._needs_values(step)):
            for launched in list(self._in_flight):
                self._settle(launched)
        for req_id in step.finished_req_ids:
            self._requests.pop(req_id, None)
            self._penalties.remove(req_id)
            self._table.remove(req_id)
        if self.serving.per_request_state and step.finished_req_ids:
            self.model.end_requests(step.finished_req_ids)  # type: ignore[operator]
        for new in step.new_requests:
            if new.adapter is not None:
                self._adapters.ensure(new.adapter)
            self._requests[new.req_id] = RequestState.from_new(new)
            self._table.add(new.req_id, new.sampling, new.num_prompt_tokens, new.num_output_tokens)
            self._penalties.remove(new.req_id)  # a readmission recounts from its tokens
            if new.sampling.uses_penalties:
                self._penalties.add(new)
        if not step.chunks:
            return LaunchedStep(step.step_id, RunnerOutput(step.step_id))
        if self.backend is None:
            raise RuntimeError("initialize_kv_cache() must be called before execute_model()")

        plan = layout(step, self._known_len)
        placeholders = [
            i for i, c in enumerate(plan.chunks[: plan.num_single]) if c.token_from_last_step
        ]
        hidden = None
        rows_plan = plan
        graphs = self._graphs
        if (
            graphs is not None
            and not plan.pure_decode
            and sum(len(c.token_ids) for c in step.chunks) <= graphs.sizes[-1]
            and self._prompt_rows_graphed()
        ):
            # Prompt tokens as decode rows of the graphs (step_inputs.layout): a small prompt
            # step replays a graph instead of an eager forward; its logits and sampling stay
            # eager (the rows that sample are not the graph's leading rows).
            rows_plan = layout(step, None, prompt_rows=True)
        if self._graphs is not None and rows_plan.pure_decode:
            # Placeholders are filled on the device, between the graph's input copy and
            # its replay, from the last step's sampled ids (not yet read back).
            hidden = graph_forward(
                self._graphs,
                self._lora_rows(rows_plan.chunks),
                rows_plan.chunks,
                rows_plan.seqs,
                (self._table, self._penalties) if plan.pure_decode else None,
                step.grammar_req_ids if step.grammar_bitmask is not None else (),
                self._known_tokens(rows_plan.chunks) if placeholders else None,
                (lambda ids: self._fill_placeholders(ids, placeholders, plan.chunks))
                if placeholders
                else None,
            )
        replayed = None
        if hidden is not None and plan.pure_decode:
            replayed = self._graphs  # logits computed there too
        elif hidden is not None:
            plan = rows_plan  # the same chunks in the same order, as rows
        if hidden is None:
            meta = self.backend.build(plan.seqs, plan.num_decodes, self.block_size)
            token_ids, positions = flat_inputs(plan, self.io)
            if placeholders:
                self._fill_placeholders(token_ids, placeholders, plan.chunks)
            if self._adapters.attached:
                slots = [self._requests[c.req_id].adapter_slot for c in plan.chunks]
                self._adapters.step.set_rows(
                    [s for c, s in zip(plan.chunks, slots, strict=True) for _ in c.token_ids],
                    self.device,
                )
            if self.serving.per_request_state:  # the fallback's per-request caches
                rows = [(c.req_id, len(c.token_ids), c.start_pos) for c in plan.chunks]
                self.model.bind_step(rows)  # type: ignore[operator]
            hidden = self.model(token_ids, positions, self.kv_caches, meta)  # [tokens, hidden]
        launched = self._finish_step(step, plan, hidden, replayed)
        if launched.output is None:
            self._in_flight.append(launched)
        return launched

    # The runner's tensors are inference tensors (made under inference mode): a collect
    # called apart from its launch (the overlapped engine's step thread) writes them too.
    @torch.inference_mode()
    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """The output of a :meth:`launch`ed step: waits for its readback (the step's one
        synchronisation), then the host's bookkeeping of its tokens."""
        if launched.output is None:
            self._settle(launched)
        assert launched.output is not None
        return launched.output

    def _settle(self, launched: LaunchedStep) -> None:
        """Wait for ``launched``'s readback and apply what only its values tell."""
        assert launched.pending is not None
        self._in_flight.remove(launched)  # first: a failed readback is not waited on again
        out = launched.pending.result()
        accepted = accept(
            out, launched.chunks, launched.states, self._penalties, counted=not launched.speculative
        )
        if launched.speculative:  # how many tokens each chunk kept is known on the host only
            self._table.set_output_counts(
                [c.req_id for c in launched.chunks], [s.num_output_tokens for s in launched.states]
            )
            self._last_ids, self._last_rows = out.device_token_ids, accepted.last_rows
        launched.output = RunnerOutput(launched.step_id, accepted.sampled, launched.prompt)
        launched.pending = None

    def _needs_values(self, step: SchedulerOutput) -> bool:
        """Whether launching ``step`` needs host values of the uncollected step: its draft
        acceptance (a speculative step), or a placeholder's token on the host (no device
        ids to read it from, or a watermarked row, whose green list hashes it)."""
        if any(launched.speculative for launched in self._in_flight):
            return True
        placeholders = [c.req_id for c in step.chunks if c.token_from_last_step]
        if not placeholders:
            return False
        if self._last_ids is None:
            return True
        return any(
            (state := self._requests.get(r)) is not None and state.sampling.watermark
            for r in placeholders
        )

    def _fill_placeholders(
        self, token_ids: torch.Tensor, rows: list[int], chunks: list[ScheduledChunk]
    ) -> None:
        """Write into ``token_ids[rows]`` (placeholders are one-token decode chunks, laid
        out first: ``chunks[i]`` is flat row ``i``) the token each one's request got in the
        last step, copied on the device from that step's sampled ids (int64 from the eager
        sampler, float32 columns of a graph tail's block): no round trip through the host,
        and no wait for that step's readback."""
        req_ids = [chunks[i].req_id for i in rows]
        missing = [r for r in req_ids if r not in self._last_rows]
        if missing:
            raise RuntimeError(f"placeholder tokens without a token sampled last step: {missing}")
        # A steady batch reads the same rows step after step: uploaded once.
        dst = self.io.upload_cached("placeholder_dst", rows)
        if self._last_ids is None:
            # The last step's ids are on the host only (launch collected it first).
            host = [self._state(r).last_token for r in req_ids]
            token_ids.index_copy_(0, dst, self.io.upload(host, torch.int64))
            return
        src = self.io.upload_cached("placeholder_src", [self._last_rows[r] for r in req_ids])
        token_ids.index_copy_(0, dst, self._last_ids.index_select(0, src).to(torch.int64))

    def _known_tokens(self, chunks: list[ScheduledChunk]) -> list[int]:
        """The flat batch's token ids, 0 for each placeholder (filled on the device; a
        list, not new chunk objects: this runs for every row of every step)."""
        tokens: list[int] = []
        for c in chunks:
            if c.token_from_last_step:
                tokens.append(0)
            else:
                tokens.extend(c.token_ids)
        return tokens

    def _prompt_rows_graphed(self) -> bool:
        """Whether prompt chunks may run as decode rows of the CUDA graphs: every token's
        rotation depends on its position alone (not longrope / dynamic NTK, where a prompt
        token rotates by the prompt's length), attention is not latent (its prompt and
        decode paths are different computations, only the decode one proven in graphs), and
        ``GENSERVE_PROMPT_ROWS_IN_GRAPHS`` is not ``off``."""
        if self._prompt_rows is None:
            self._prompt_rows = (
                self.serving.is_native
                and self.config.mla is None
                and not self.model.rotary_needs_lengths
                and os.environ.get("GENSERVE_PROMPT_ROWS_IN_GRAPHS", "auto").lower() != "off"
            )
        return self._prompt_rows

    def _lora_rows(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether any chunk of the step runs under a LoRA adapter."""
        if not self._adapters.attached:
            return False
        return any(self._requests[c.req_id].adapter_slot >= 0 for c in chunks)

    def _finish_step(
        self,
        step: SchedulerOutput,
        plan: StepLayout,
        hidden: torch.Tensor,
        graphs: DecodeGraphs | None = None,
    ) -> LaunchedStep:
        """Logits, sampling (queued) and prompt logprobs of a step whose forward gave
        ``hidden`` (``graphs``: replayed from them, which computed the logits of its rows
        as well)."""
        launched = LaunchedStep(step.step_id)
        self._last_ids, self._last_rows = None, {}
        rows, leading = plan.sample_rows()
        if rows:
            # A pure decode step samples rows 0..n-1: a view, nothing to upload or gather.
            if leading and graphs is not None:
                logits = graphs.logits(len(rows))  # the final norm and LM head ran in it
            else:
                if leading:
                    picked = hidden[: len(rows)]
                else:
                    picked = hidden.index_select(0, self.io.upload(rows, torch.int64))
                logits = self.model.compute_logits(picked)  # [rows, vocab]
                graphs = None
            if self.parallel.is_driver:
                launched.chunks = [c for c in plan.chunks if c.sample]
                self._sample(logits, launched, step, graphs)
        parts = prompt_logprob_parts(plan.chunks, plan.offsets, self._requests)
        if parts:
            launched.prompt = prompt_logprobs(
                self.model.compute_logits,
                hidden,
                parts,
                self.io,
                self.parallel.is_driver,
                [self._requests[p[0]].sampling.num_top_tokens for p in parts],
            )
        if launched.pending is None:
            launched.output = RunnerOutput(step.step_id, (), launched.prompt)
        return launched

    def prepare_adapter(self, ref: AdapterRef) -> None:
        """Read, validate and lay out ``ref``'s adapter for its slot, so that the step that
        first runs it only copies tensors.  Blocking and thread-safe: the engine calls it
        from a worker thread while steps run.  Raises
        :class:`~genserve.model.adapter_errors.AdapterError` for an adapter that does not fit."""
        self._adapters.prepare(ref)

    def _known_len(self, req_id: str) -> int:
        """``req_id``'s prompt length: what every chunk of its prompt rotates by under
        length-dependent rotary (``SeqSpec.rotary_lens``).  A preempted request computed
        again rotates its prompt so and its outputs by their own positions, as when they
        were decoded: its blocks come out as the first time, under its prompt's prefix-cache
        salt (``engine/rotary_salt.py``)."""
        state = self._requests.get(req_id)
        return 0 if state is None else state.num_prompt_tokens

    def _state(self, req_id: str) -> RequestState:
        state = self._requests.get(req_id)
        if state is None:
            raise KeyError(f"request {req_id!r} was scheduled but never registered")
        return state

    def _sample(
        self,
        logits: torch.Tensor,
        launched: LaunchedStep,
        step: SchedulerOutput | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        """Queue the sampling of ``launched.chunks``: one row of ``logits`` per sampling
        position (``num_draft_tokens + 1`` a chunk; worker/step_outputs.py says which tokens
        each chunk keeps), into ``launched.pending``.  Penalty counts advance from the
        device's token ids in one scatter, the slots' output counts on the device and the
        host's counts at once (a step without drafts: worker/launched_step.py).
        ``graphs``: the step was replayed from them (``logits`` their rows), whose greedy
        tail serves all-greedy steps and whose sampled tail the others it can (it advances
        the slots' counts itself)."""
        chunks = launched.chunks
        if not chunks:
            return
        states = [self._state(c.req_id) for c in chunks]
        launched.states = states
        rows = sampling_rows(chunks, states, self._penalties)
        speculative = any(c.num_draft_tokens for c in chunks)
        launched.speculative = speculative
        bitmask, constrained = grammar_rows(chunks, step)
        pending = None
        tail_sampled = False
        if graphs is not None:
            if bitmask is None:
                pending = graph_greedy(graphs, rows, self._graph_readback)
            if pending is None:
                sampling = (self._table, self._penalties)
                grammar = (bitmask, constrained) if bitmask is not None else None
                pending = graph_sample(
                    graphs, rows, chunks, sampling, self._graph_readback, grammar
                )
                tail_sampled = pending is not None  # it advanced the slots' counts itself
        if not tail_sampled:
            table = self._table.rows(
                [c.req_id for c in chunks for _ in range(c.num_draft_tokens + 1)],
                [j for c in chunks for j in range(c.num_draft_tokens + 1)] if speculative else None,
            )
            if pending is None:
                pending = self.sampler.launch(logits, rows, bitmask, constrained, table=table)
            if not speculative:
                self._advance_output_counts(table, rows)
            self._record_penalties(chunks, pending.device_token_ids, len(rows))
        assert pending is not None
        launched.pending = pending
        if not speculative:
            self._last_ids = pending.device_token_ids
            self._last_rows = advance_counts(chunks, states)

    def _record_penalties(
        self, chunks: list[ScheduledChunk], ids: torch.Tensor | None, num_rows: int
    ) -> None:
        """Add the step's tokens (``ids``: every sampling row's, on the device) to the
        penalised requests' counts (their chunks carry no drafts: one row each)."""
        req_ids: list[str] = []
        pen_rows: list[int] = []
        row = 0
        for c in chunks:
            if c.req_id in self._penalties:
                req_ids.append(c.req_id)
                pen_rows.append(row)
            row += c.num_draft_tokens + 1
        if not req_ids or ids is None:
            return
        if len(pen_rows) != num_rows:
            ids = ids.index_select(0, self.io.upload(pen_rows, torch.int64))
        self._penalties.record(req_ids, ids)

    def _advance_output_counts(self, table: TableRows, rows: list[SamplingRow]) -> None:
        """One more output token on the device for the rows whose output count is read
        (seeded draws, TGI's frequency penalty): an all-greedy step launches nothing."""
        counted = [i for i, r in enumerate(rows) if uses_output_count(r.params)]
        if len(counted) == len(rows):
            self._table.advance(table)
        elif counted:
            self._table.advance(table.subset(self.io.upload_cached("counted_rows", counted)))

    def shutdown(self) -> None:
        """Release the CUDA graphs (and with them their memory pool), the KV cache and the
        request state.  Idempotent."""
        if self._graphs is not None:
            self._graphs.release()
        self._graphs = None
        self._graph_plan = None
        self.kv_caches = []
        self._requests.clear()
        if self.serving.per_request_state:
            self.model.end_requests()  # type: ignore[operator]
        self._fresh_sampling_state()
        self._last_ids, self._last_rows = None, {}
        self._in_flight.clear()
        self.backend = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
