"""The model runner: executes the scheduler's steps on the native paged model.

It owns the model, the KV-cache tensors and the per-request state the sampler needs
(penalty counts, output position for seeded draws, prompt tokens for prompt logprobs),
keyed by ``req_id``.  It implements :class:`genserve.step.Runner` and never sees a request
object: everything arrives in :class:`~genserve.step.SchedulerOutput`.

One step is one forward pass over every scheduled token, flattened (no padding): decode
chunks first, then speculative chunks (the last token and its drafts), then prefill chunks,
each with its own positions and block table.  Every token of a speculative chunk is attended
as a decode row of its own (its context ends at its position), so verification uses the
decode attention path and needs nothing from the backends.  Logits are computed only for the
rows that need them (the last token of a chunk that samples, every token of a speculative
chunk, and the prompt positions of requests asking for prompt logprobs).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from genserve.model import rope_scaling
from genserve.model.attention import AttentionBackend, SeqSpec, select_backend
from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.config import load_model_config
from genserve.model.huge_pages import zeros_on_huge_pages
from genserve.model.loader import ResolvedModel
from genserve.model.lora import LoraHook, ModuleSplit, StepAdapters
from genserve.model.quantize_model import QuantizeSummary, model_weight_bytes, quantize_model
from genserve.model.registry import build_model
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from genserve.step import (
    AdapterRef,
    NewRequestData,
    PromptLogprobs,
    RunnerOutput,
    SampledToken,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
    TokenLogprob,
)
from genserve.worker.adapters import PreparedAdapter, install, prepare, read_adapter
from genserve.worker.cuda_graphs import DecodeGraphs
from genserve.worker.graph_plan import GraphPlan, graph_forward, plan_graphs
from genserve.worker.sampler import Sampler, SamplingRow

log = structlog.get_logger("genserve.worker")

# On CUDA, part of the budget stays free for activations and allocator fragmentation.
_CUDA_ACTIVATION_RESERVE = 0.1
# Prompt-logprob rows per LM-head call: bounds the float32 logits to ~100 MB (vocab 49152).
_PROMPT_LOGPROB_ROWS = 512
# Adapters prepared ahead of their first step (requests cancelled meanwhile leave entries).
_MAX_PREPARED_ADAPTERS = 16


@dataclass(slots=True)
class _RequestState:
    sampling: SamplingParams
    num_prompt_tokens: int
    num_tokens: int  # prompt + output tokens known so far
    num_output_tokens: int
    prompt_token_ids: tuple[int, ...]  # kept only when prompt logprobs are wanted
    token_counts: torch.Tensor | None  # [vocab] float32, only with penalties
    # [vocab] float32 occurrences in the output only, only with a presence penalty
    output_counts: torch.Tensor | None = None
    adapter_slot: int = -1  # LoRA slot, -1: the base model

    @classmethod
    def from_new(cls, new: NewRequestData, vocab_size: int, device: torch.device) -> _RequestState:
        p = new.sampling
        counts = output_counts = None
        if p.uses_penalties:
            ids = torch.tensor(new.all_token_ids, dtype=torch.int64, device=device)
            counts = torch.bincount(ids, minlength=vocab_size)[:vocab_size].float()
        if p.presence_penalty != 0.0:
            out_ids = ids[new.num_prompt_tokens :]  # a readmission brings its output so far
            output_counts = torch.bincount(out_ids, minlength=vocab_size)[:vocab_size].float()
        return cls(
            sampling=p,
            num_prompt_tokens=new.num_prompt_tokens,
            num_tokens=len(new.all_token_ids),
            num_output_tokens=new.num_output_tokens,
            prompt_token_ids=new.all_token_ids[: new.num_prompt_tokens]
            if p.prompt_logprobs
            else (),
            token_counts=counts,
            output_counts=output_counts,
            adapter_slot=new.adapter.slot if new.adapter is not None else -1,
        )


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
    ) -> None:
        self.resolved = model
        self.dtype = dtype
        self.device = device
        if device.type == "cpu":
            _keep_freed_memory()
        self.parallel = parallel or ParallelContext.single()
        self.config = load_model_config(model.local_dir, trust_remote_code)
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
            with SafetensorsWeights(model.local_dir) as weights:
                self.model.load_weights(weights)
        self.quantization = _quantize(self.model, model) if model.quantize else None
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
        self.model.eval()
        self.sampler = Sampler(device)
        self._requests: dict[str, _RequestState] = {}
        # LoRA: hooks are attached on the first adapter request, so base-only serving pays
        # nothing; _slot_ids says which adapter each slot holds now.
        self._lora_step = StepAdapters()
        self._lora_targets: dict[str, tuple[LoraHook, ModuleSplit]] | None = None
        self._slot_ids: dict[int, str] = {}
        # Adapters read and laid out off the step thread (prepare_adapter), by (id, path),
        # waiting for their first step; bounded in case requests are cancelled first.
        self._prepared: OrderedDict[tuple[str, str], PreparedAdapter] = OrderedDict()
        self._lora_lock = threading.Lock()
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.num_blocks = 0
        self.backend: AttentionBackend | None = None
        self._graph_plan: GraphPlan | None = None  # CUDA graphs for decode steps (#12)
        self._graphs: DecodeGraphs | None = None
        log.info(
            "model_loaded",
            model_id=model.model_id,
            architecture=self.config.architecture,
            dtype=str(dtype).removeprefix("torch."),
            device=str(device),
            rank=self.parallel.rank,
            world_size=self.parallel.world_size,
        )

    def weight_bytes(self) -> int:
        """Bytes of model weights this rank holds (quantized matrices at their packed size,
        a tied embedding and head once)."""
        return model_weight_bytes(self.model)

    # ----------------------------------------------------------------- KV cache sizing
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes on this rank: K and V, every layer, this rank's KV heads."""
        elem = torch.empty((), dtype=self.dtype).element_size()
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
        return max(0, int(_available_ram_bytes() * fraction))

    @torch.inference_mode()
    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate ``num_blocks`` blocks of ``block_size`` tokens for every layer.

        Zero-filled: attention masks out unused slots, but 0 * NaN garbage would still
        poison a softmax-weighted sum."""
        self.backend = select_backend(
            self.device, block_size, self.dtype, head_dim=self.config.head_dim
        )
        shape = self.backend.kv_cache_shape(
            num_blocks, block_size, self.model.num_local_kv_heads, self.config.head_dim
        )
        if self._graph_plan is not None:  # one scratch block past the scheduler's, for padding
            shape = self.backend.kv_cache_shape(
                num_blocks + 1, block_size, self.model.num_local_kv_heads, self.config.head_dim
            )
        pool = _zeros((self.config.num_layers, *shape), self.dtype, self.device)
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
        request does not pay one-time costs; then zero the cache and forget the requests."""
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must be called before warmup()")
        bs = self.block_size
        n = min(2 * bs, max(1, self.num_blocks * bs // 2 - 1))  # prompt length
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
        # A fresh zeroed pool (cheap: lazily mapped zero pages on CPU) rather than zero_() over
        # every block, which would touch — and make resident — the whole cache.
        self.kv_caches = []  # drop the used pool first: two pools may not fit a GPU
        self._graphs = None
        self.initialize_kv_cache(self.num_blocks, self.block_size)
        if self._graph_plan is not None:
            self._graphs = self._graph_plan.capture(self)

    def enable_cuda_graphs(self, sizes: tuple[int, ...], max_seq_len: int, block_size: int) -> None:
        """Capture decode steps of ``sizes`` rows as CUDA graphs in :meth:`warmup`; call
        before sizing the KV cache, whose budget then leaves room for the graphs (measured by
        a trial capture).  No-op on CPU or without the Triton decode kernel (logged)."""
        self._graph_plan = plan_graphs(self, sizes, max_seq_len, block_size)

    @property
    def cuda_graph_sizes(self) -> tuple[int, ...]:
        """Batch sizes replayed from CUDA graphs (empty: every step runs eagerly)."""
        return self._graphs.captured_sizes if self._graphs is not None else ()

    # ------------------------------------------------------------------------- steps
    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        """Run one step as described by :class:`genserve.step.SchedulerOutput`."""
        for req_id in step.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in step.new_requests:
            if new.adapter is not None:
                self._ensure_adapter(new.adapter)
            self._requests[new.req_id] = _RequestState.from_new(
                new, self.config.vocab_size, self.device
            )
        if not step.chunks:
            return RunnerOutput(step.step_id)
        if self.backend is None:
            raise RuntimeError("initialize_kv_cache() must be called before execute_model()")

        # Decodes first: the attention backend batches them into one op.
        chunks = [c for c in step.chunks if len(c.token_ids) == 1]
        num_single = len(chunks)
        chunks += [c for c in step.chunks if c.num_draft_tokens]
        num_decode_chunks = len(chunks)
        chunks += [c for c in step.chunks if not c.is_decode]
        seqs = [SeqSpec(1, c.start_pos, c.block_ids) for c in chunks[:num_single]]
        for c in chunks[num_single:num_decode_chunks]:
            seqs += [SeqSpec(1, c.start_pos + j, c.block_ids) for j in range(len(c.token_ids))]
        num_decodes = len(seqs)
        if self._graphs is not None and num_decode_chunks == len(chunks):  # pure decode
            hidden_or_none = graph_forward(self._graphs, self._lora_rows(chunks), chunks, seqs)
        else:
            hidden_or_none = None
        seqs += [
            SeqSpec(len(c.token_ids), c.start_pos, c.block_ids) for c in chunks[num_decode_chunks:]
        ]
        if hidden_or_none is not None:
            return self._finish_step(step, chunks, hidden_or_none)
        meta = self.backend.build(seqs, num_decodes, self.block_size)
        token_ids = torch.tensor(
            list(itertools.chain.from_iterable(c.token_ids for c in chunks)),
            dtype=torch.int64,
            device=self.device,
        )
        positions = torch.from_numpy(_positions(chunks, num_single)).to(self.device)
        if self._lora_targets is not None:
            slots = [self._requests[c.req_id].adapter_slot for c in chunks]
            self._lora_step.set_rows(
                [s for c, s in zip(chunks, slots, strict=True) for _ in c.token_ids], self.device
            )
        hidden = self.model(token_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        return self._finish_step(step, chunks, hidden)

    def _lora_rows(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether any chunk of the step runs under a LoRA adapter."""
        if self._lora_targets is None:
            return False
        return any(self._requests[c.req_id].adapter_slot >= 0 for c in chunks)

    def _finish_step(
        self, step: SchedulerOutput, chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> RunnerOutput:
        """Logits, sampling and prompt logprobs of a step whose forward gave ``hidden``."""
        offsets = np.cumsum([0] + [len(c.token_ids) for c in chunks])
        sample_chunks = [i for i, c in enumerate(chunks) if c.sample]
        sampled: tuple[SampledToken, ...] = ()
        if sample_chunks:
            # A speculative chunk samples after every one of its tokens.
            rows = [
                row
                for i in sample_chunks
                for row in range(
                    int(offsets[i + 1]) - 1 - chunks[i].num_draft_tokens, int(offsets[i + 1])
                )
            ]
            row_index = torch.tensor(rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, row_index))  # [rows, V]
            if self.parallel.is_driver:
                sampled = self._sample(logits, [chunks[i] for i in sample_chunks], step)
        prompt_parts = self._prompt_logprob_parts(chunks, offsets)
        prompt_logprobs = self._prompt_logprobs(hidden, prompt_parts) if prompt_parts else ()
        return RunnerOutput(step.step_id, sampled, prompt_logprobs)

    def prepare_adapter(self, ref: AdapterRef) -> None:
        """Read, validate and lay out ``ref``'s adapter for its slot, so that the step that
        first runs it only copies tensors.  Blocking and thread-safe: the engine calls it
        from a worker thread while steps run.  Raises
        :class:`~genserve.model.lora.AdapterError` for an adapter that does not fit."""
        key = (ref.adapter_id, ref.path)
        with self._lora_lock:
            if self._slot_ids.get(ref.slot) == ref.adapter_id or key in self._prepared:
                return
            targets = self._enable_lora()
        weights = read_adapter(ref.adapter_id, Path(ref.path), self.config)
        prepared = prepare(weights, targets, self.dtype, self.device)
        with self._lora_lock:
            self._prepared[key] = prepared
            while len(self._prepared) > _MAX_PREPARED_ADAPTERS:
                self._prepared.popitem(last=False)

    def _enable_lora(self) -> dict[str, tuple[LoraHook, ModuleSplit]]:
        """The model's LoRA hooks, attached on first use (base-only serving pays nothing).
        Attaching is safe while a step runs: hooks do nothing until the runner marks rows."""
        if self._lora_targets is None:
            from genserve.kernels import cpu as cpu_kernels

            # The BGMV kernel computes every row's delta in one op per projection; without
            # it (GPU, no compiler, --disable-cpu-kernels) the batched torch path runs.
            self._lora_step.use_kernel = self.device.type == "cpu" and cpu_kernels.load()
            self._lora_targets = self.model.enable_lora(self._lora_step)
        return self._lora_targets

    def _ensure_adapter(self, ref: AdapterRef) -> None:
        """Make slot ``ref.slot`` hold ``ref.adapter_id``: a slot copy of the adapter
        prepared off this thread, or (a shard worker, a test driving the runner directly)
        read and prepared here."""
        if self._slot_ids.get(ref.slot) == ref.adapter_id:
            return
        with self._lora_lock:
            targets = self._enable_lora()
            prepared = self._prepared.pop((ref.adapter_id, ref.path), None)
        if prepared is None:
            weights = read_adapter(ref.adapter_id, Path(ref.path), self.config)
            prepared = prepare(weights, targets, self.dtype, self.device)
        install(prepared, ref.slot, targets, self._lora_step)
        self._slot_ids[ref.slot] = ref.adapter_id

    def _state(self, req_id: str) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            raise KeyError(f"request {req_id!r} was scheduled but never registered")
        return state

    @staticmethod
    def _grammar_rows(
        chunks: list[ScheduledChunk], step: SchedulerOutput | None
    ) -> tuple[torch.Tensor | None, list[int]]:
        """The step's grammar bitmask and the logits row of each of its rows (constrained
        chunks never carry drafts, so each has one row)."""
        if step is None or step.grammar_bitmask is None:
            return None, []
        first_row: dict[str, int] = {}
        row = 0
        for c in chunks:
            first_row[c.req_id] = row
            row += c.num_draft_tokens + 1
        bitmask = step.grammar_bitmask
        if not isinstance(bitmask, torch.Tensor):  # a PendingBitmask, filled during forward
            bitmask = bitmask.result()  # type: ignore[attr-defined]
        assert isinstance(bitmask, torch.Tensor)
        return bitmask, [first_row[r] for r in step.grammar_req_ids]

    def _sample(
        self,
        logits: torch.Tensor,
        chunks: list[ScheduledChunk],
        step: SchedulerOutput | None = None,
    ) -> tuple[SampledToken, ...]:
        """One row of ``logits`` per sampling position: one per chunk, ``num_draft_tokens +
        1`` for a speculative chunk.  Drafts are accepted while each equals the token sampled
        at the position before it; the token sampled after the last accepted draft is kept
        too.  A draft row samples with the output index it would have had in one-token
        steps, so seeded sampling draws the same tokens with or without speculation."""
        if not chunks:
            return ()
        states = [self._state(c.req_id) for c in chunks]
        rows = []
        for c, s in zip(chunks, states, strict=True):
            if c.num_draft_tokens and s.token_counts is not None:
                raise ValueError(f"{c.req_id}: draft tokens for a request with penalties")
            rows += [
                SamplingRow(
                    s.sampling,
                    s.num_output_tokens + j,
                    s.num_tokens + j,
                    s.token_counts,
                    s.output_counts,
                    c.token_ids[len(c.token_ids) - c.num_draft_tokens - 1 + j],
                )
                for j in range(c.num_draft_tokens + 1)
            ]
        out = self.sampler(logits, rows, *self._grammar_rows(chunks, step))
        result: list[SampledToken] = []
        row = 0
        for c, state in zip(chunks, states, strict=True):
            drafts = c.token_ids[len(c.token_ids) - c.num_draft_tokens :]
            num_accepted = 0
            while num_accepted < len(drafts) and (
                out.token_ids[row + num_accepted] == drafts[num_accepted]
            ):
                num_accepted += 1
            for j in range(row, row + num_accepted + 1):
                token_id = out.token_ids[j]
                result.append(SampledToken(c.req_id, token_id, out.logprobs[j], out.top_tokens[j]))
                if state.token_counts is not None:
                    state.token_counts[token_id] += 1
                if state.output_counts is not None:
                    state.output_counts[token_id] += 1
            state.num_output_tokens += num_accepted + 1
            state.num_tokens += num_accepted + 1
            row += c.num_draft_tokens + 1
        return tuple(result)

    def _prompt_logprob_parts(
        self, chunks: list[ScheduledChunk], offsets: np.ndarray
    ) -> list[tuple[str, int, int, int, tuple[int, ...]]]:
        """For chunks of requests wanting prompt logprobs: ``(req_id, first_pos, first_row,
        count, target_ids)``; the row at position ``p`` predicts prompt token ``p + 1``."""
        parts = []
        for i, c in enumerate(chunks):
            state = self._requests.get(c.req_id)
            if state is None or not state.sampling.prompt_logprobs:
                continue
            last = min(c.start_pos + len(c.token_ids), state.num_prompt_tokens - 1)
            count = last - c.start_pos
            if count <= 0:
                continue
            targets = state.prompt_token_ids[c.start_pos + 1 : last + 1]
            parts.append((c.req_id, c.start_pos + 1, int(offsets[i]), count, targets))
        return parts

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        parts: list[tuple[str, int, int, int, tuple[int, ...]]],
    ) -> tuple[PromptLogprobs, ...]:
        """Logprobs of prompt tokens, computed ``_PROMPT_LOGPROB_ROWS`` rows at a time so that
        a long prompt chunk never materialises ``[chunk, vocab]`` float32 logits at once.
        Every rank runs the logits (the LM head gathers across shards); only rank 0 reports."""
        rows = list(itertools.chain.from_iterable(range(p[2], p[2] + p[3]) for p in parts))
        targets = list(itertools.chain.from_iterable(p[4] for p in parts))
        values: list[float] = []
        for start in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
            index = torch.tensor(rows[start : start + _PROMPT_LOGPROB_ROWS], device=self.device)
            target = torch.tensor(targets[start : start + _PROMPT_LOGPROB_ROWS], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, index))  # [rows, vocab]
            chosen = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
            values.extend(chosen.tolist())
        if not self.parallel.is_driver:
            return ()
        result = []
        start = 0
        for req_id, first_pos, _, count, target_ids in parts:
            lps = values[start : start + count]
            start += count
            result.append(
                PromptLogprobs(
                    req_id,
                    first_pos,
                    tuple(TokenLogprob(t, lp) for t, lp in zip(target_ids, lps, strict=True)),
                )
            )
        return tuple(result)

    def shutdown(self) -> None:
        """Release the KV cache and request state.  Idempotent."""
        self.kv_caches = []
        self._requests.clear()
        self.backend = None


def _positions(chunks: list[ScheduledChunk], num_single: int) -> np.ndarray:
    """``[num_tokens]`` int64 positions of the flat batch (``chunks[:num_single]`` have one
    token each)."""
    parts = [np.fromiter((c.start_pos for c in chunks[:num_single]), np.int64, num_single)]
    parts += [
        np.arange(c.start_pos, c.start_pos + len(c.token_ids), dtype=np.int64)
        for c in chunks[num_single:]
    ]
    return np.concatenate(parts)


def _quantize(model: DecoderForCausalLM, resolved: ResolvedModel) -> QuantizeSummary:
    """``--quantize``: the model's matrices in the quantized format (model/quantize_model)."""
    from genserve.model.quantization import QuantizationError

    method = str(resolved.quantize)
    tensors = None
    if method == "gguf":
        from genserve.model.gguf_weights import read_gguf_quantized

        if resolved.gguf_file is None:
            raise QuantizationError(
                "--quantize gguf keeps a GGUF file's quantization, but the model was not "
                "loaded from a .gguf file (use --quantize int8 or int4 for other checkpoints)"
            )
        from genserve.model.conversion import file_digest
        from genserve.model.quantized_cache import cache_path, load_or_build

        gguf, config = resolved.gguf_file, model.config
        digest = file_digest(gguf, resolved.local_dir.parent)
        tensors = load_or_build(
            cache_path(resolved.local_dir, digest),
            lambda: read_gguf_quantized(gguf, config.num_heads, config.num_kv_heads),
        )
    return quantize_model(model, method, tensors)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor.  On CPU it comes from calloc (numpy): the OS maps zero pages lazily, so a
    cache of many GiB costs neither start-up time nor resident memory until blocks are used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize])
    return torch.from_numpy(raw).view(dtype)


def _keep_freed_memory() -> None:
    """Stop glibc from handing freed multi-megabyte blocks back to the OS.

    By default blocks above the mmap threshold are unmapped on free and the heap top is
    trimmed, so every step page-faults its logits and activations back in: measured 8 ms of
    a 55 ms batch-32 decode step on the default model (a page fault is expensive in a VM).
    Process-wide and harmless elsewhere: freed memory is reused by the next step."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 256 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor.  On CPU the kernel hands out zero pages on first touch, so a
    many-gigabyte cache costs neither start-up time nor resident memory until blocks are
    used: huge pages where THP is in ``madvise`` mode (decode attention reads each
    sequence's blocks scattered over the pool, a TLB miss per 4 KiB block with small pages:
    +15% attention speed at 2K-token contexts, model/huge_pages.py), else ``calloc``
    (through numpy)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    huge = zeros_on_huge_pages(shape, dtype)
    if huge is not None:
        return huge
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _available_ram_bytes() -> int:
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil comes with accelerate, but /proc is enough on Linux
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("cannot determine available memory") from None
