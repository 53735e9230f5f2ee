"""Hugging Face transformers baselines on the benchmark's prompts, in this process.

* :func:`run_padded_generate` — what most users run: ``model.generate()`` on left-padded
  batches of ``batch_size`` prompts, greedy.  A batch ends when its longest row ends; rows
  that finished early keep occupying the batch.
* :func:`run_static_generate` — ``generate()`` with a static KV cache and (on CUDA) its
  ``torch.compile`` forward (``mode="reduce-overhead"``: CUDA graphs), at a fixed batch and
  a fixed padded prompt width so it compiles once; the strongest plain-transformers setup.
* :func:`run_generate_batch` — transformers' own continuous batching
  (``model.generate_batch``, present in the installed 5.x), all prompts submitted at once.

Both produce :class:`~genserve.bench.records.RequestRecord` so they summarise exactly like the
genserve runs.  Per-token times for ``generate()`` come from a logits processor that records
the moment each decoding step's logits are ready (the token is picked right after), which
works for any batch size, unlike streamers.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from genserve.bench.prompts import Prompt
from genserve.bench.records import RequestRecord, RunResult
from genserve.model.loader import transformers_weights_kwargs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _StepClock:
    """A logits processor that only records when each decoding step reached sampling."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def load_model(
    model_dir: Path, dtype: str, num_threads: int, device: str = "cpu"
) -> tuple[Any, Any]:
    """Load a ``save_pretrained`` directory (weights + tokenizer) on ``device`` (``auto``:
    CUDA when available).

    Sets torch's intra-op thread count for this process to ``num_threads``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = transformers_weights_kwargs(Path(model_dir))  # a GGUF entry: the .gguf file
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype], **weights)
    model = model.to(device)
    model.eval()
    return model, tokenizer


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _num_real_tokens(row: list[int], eos_ids: set[int]) -> tuple[int, bool]:
    """Generated tokens up to and including the first EOS; whether an EOS ended the row."""
    for index, token_id in enumerate(row):
        if token_id in eos_ids:
            return index + 1, True
    return len(row), False


def _sampling_kwargs(prompts: Sequence[Prompt]) -> dict[str, Any]:
    """``generate()`` arguments for the prompts' decoding: greedy, or sampling at their
    (common) temperature."""
    temperatures = {p.temperature for p in prompts}
    if len(temperatures) != 1:
        raise ValueError("all prompts of a baseline run must share one temperature")
    (temperature,) = temperatures
    if temperature <= 0:
        return {"do_sample": False}
    # genserve applies no top-k/top-p unless asked: neither may the model's generation_config.
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def run_padded_generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    batch_size: int,
    on_done: Callable[[int], None] | None = None,
    *,
    generate_kwargs: dict[str, Any] | None = None,
    pad_to: int | None = None,
    system: str = "hf_generate",
) -> RunResult:
    """Greedy ``generate()`` over ``prompts`` in consecutive left-padded batches.

    ``generate_kwargs`` are added to every ``generate()`` call; ``pad_to`` left-pads every
    batch to that many prompt tokens (fixed shapes for compiled runs).

    Each row's start is its batch's start (before tokenization); its tokens are the ones up to
    its first EOS.  ``on_done(n)`` is called after each batch with the number of prompts done.
    All prompts must share one ``max_new_tokens``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    max_new_tokens = {p.max_new_tokens for p in prompts}
    if len(max_new_tokens) != 1:
        raise ValueError("all prompts of a padded run must share max_new_tokens")
    (num_new,) = max_new_tokens
    from transformers import LogitsProcessorList

    tokenizer.padding_side = "left"
    eos_ids = _eos_ids(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    records: list[RequestRecord] = []
    num_early_eos = 0
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        clock = _StepClock()
        start = time.perf_counter()
        if pad_to is None:
            encoded = tokenizer([p.text for p in batch], return_tensors="pt", padding=True)
        else:
            encoded = tokenizer(
                [p.text for p in batch], return_tensors="pt", padding="max_length",
                max_length=pad_to,
            )  # fmt: skip
        encoded = encoded.to(model.device)
        with torch.inference_mode():
            output = model.generate(
                **encoded,
                **(generate_kwargs or {}),
                max_new_tokens=num_new,
                **_sampling_kwargs(prompts),
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        end = time.perf_counter()
        prompt_width = encoded["input_ids"].shape[1]
        generated = output[:, prompt_width:].tolist()  # [batch, num_steps]
        input_lengths = encoded["attention_mask"].sum(dim=1).tolist()  # [batch]
        for prompt, row, input_length in zip(batch, generated, input_lengths, strict=True):
            num_tokens, ended_by_eos = _num_real_tokens(row, eos_ids)
            num_early_eos += ended_by_eos
            token_times = tuple(clock.times[:num_tokens])
            records.append(
                RequestRecord(
                    prompt_id=prompt.prompt_id,
                    start=start,
                    # A row is done for its user when its last token exists, not when the
                    # batch's longest row is: the batch end only counts for full-length rows.
                    end=token_times[-1] if ended_by_eos and token_times else end,
                    token_times=token_times,
                    num_generated_tokens=num_tokens,
                    max_new_tokens=num_new,
                    input_length=int(input_length),
                    finish_reason="eos_token" if ended_by_eos else "length",
                )
            )
        if on_done is not None:
            on_done(len(batch))
    wall = max(r.end for r in records) - min(r.start for r in records)
    notes = [f"{num_early_eos} of {len(records)} rows ended with EOS"] if num_early_eos else []
    return RunResult(
        name=f"{system}_b{batch_size}",
        system=system,
        concurrency=batch_size,
        records=tuple(records),
        wall_s=wall,
        notes=tuple(notes),
    )


def run_static_generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    batch_size: int,
    compile: bool = True,
    on_done: Callable[[int], None] | None = None,
    measure_gate: Callable[[], AbstractContextManager[object]] | None = None,
) -> RunResult:
    """``generate()`` with ``cache_implementation="static"`` at a fixed ``batch_size``, every
    batch padded to the longest prompt, and the forward compiled when ``compile`` (on CUDA
    transformers then captures CUDA graphs; on CPU ``compile`` forces compilation of all
    devices, which is slow).  One unmeasured batch runs first so compilation and graph capture
    stay outside the measured span.  The last batch is filled up with repeated prompts when
    ``len(prompts)`` is not a multiple of ``batch_size`` (a static cache has a fixed batch);
    only the real prompts are recorded.  ``measure_gate``: entered around the measured span
    only (after compilation), so several processes can compile at once and measure one at
    a time (``python -m genserve.bench.hf_only --go-file``)."""
    from transformers import CompileConfig

    pad_to = max(len(tokenizer(p.text)["input_ids"]) for p in prompts)
    kwargs: dict[str, Any] = {"cache_implementation": "static", "disable_compile": not compile}
    if compile:
        options: dict[str, Any] = {"fullgraph": True, "mode": "reduce-overhead"}
        # Older transformers (5.17 on the GPU machine) have no ``_compile_all_devices``; it
        # only matters on CPU, where compilation is otherwise skipped.
        if "_compile_all_devices" in inspect.signature(CompileConfig).parameters:
            options["_compile_all_devices"] = model.device.type == "cpu"
        kwargs["compile_config"] = CompileConfig(**options)
    remainder = len(prompts) % batch_size
    padded = list(prompts) + [prompts[0]] * ((batch_size - remainder) % batch_size)
    run_padded_generate(  # warm-up: compile and capture, not measured
        model, tokenizer, padded[:batch_size], batch_size, generate_kwargs=kwargs, pad_to=pad_to
    )
    system = "hf_static_compile" if compile else "hf_static"
    with measure_gate() if measure_gate is not None else contextlib.nullcontext():
        result = run_padded_generate(
            model, tokenizer, padded, batch_size, on_done, generate_kwargs=kwargs,
            pad_to=pad_to, system=system,
        )  # fmt: skip
    records = result.records[: len(prompts)]
    wall = max(r.end for r in records) - min(r.start for r in records)
    return RunResult(
        name=result.name,
        system=system,
        concurrency=batch_size,
        records=records,
        wall_s=wall,
        notes=(*result.notes, f"prompts left-padded to {pad_to} tokens"),
    )


def has_generate_batch(model: Any) -> bool:
    """Whether the installed transformers offers continuous batching on this model."""
    return callable(getattr(model, "generate_batch", None))


def run_generate_batch(
    model: Any, tokenizer: Any, prompts: Sequence[Prompt], block_size: int = 256
) -> RunResult:
    """transformers' continuous batching on all ``prompts`` at once, greedy.

    The KV cache is sized for this workload (``num_blocks`` of ``block_size`` tokens): left
    to itself, transformers sizes it from the device's memory, which on CPU means most of
    the machine's RAM and tens of seconds of allocation.  Setup is not part of the measured
    span, which runs from the earliest request creation to the last finish.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    num_new = max(p.max_new_tokens for p in prompts)
    input_ids = [tokenizer(p.text)["input_ids"] for p in prompts]
    blocks_per_request = math.ceil((max(map(len, input_ids)) + num_new) / block_size)
    cb_config = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=len(prompts) * blocks_per_request + 1,
        max_batch_tokens=1024,
    )
    eos_ids = _eos_ids(model)
    generation_config = GenerationConfig(
        max_new_tokens=num_new,
        **_sampling_kwargs(prompts),
        eos_token_id=sorted(eos_ids) if eos_ids else None,
        pad_token_id=tokenizer.pad_token_id,
    )
    call_start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=input_ids,
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        record_timestamps=True,
        progress_bar=False,
        warmup=False,
    )
    call_end = time.perf_counter()
    results = list(outputs.values())
    if len(results) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} results")
    records = []
    for prompt, ids, result in zip(prompts, input_ids, results, strict=True):
        tokens = list(result.generated_tokens)
        num_tokens, ended_by_eos = _num_real_tokens(tokens, eos_ids)
        records.append(
            RequestRecord(
                prompt_id=prompt.prompt_id,
                start=float(result.created_time),
                end=float(result.lifespan[1]),
                token_times=tuple(float(t) for t in (result.timestamps or ())),
                num_generated_tokens=num_tokens,
                max_new_tokens=prompt.max_new_tokens,
                input_length=len(ids),
                finish_reason="eos_token" if ended_by_eos else "length",
                error=result.error,
            )
        )
    wall = max(r.end for r in records) - min(r.start for r in records)
    return RunResult(
        name=f"hf_generate_batch_n{len(prompts)}",
        system="hf_generate_batch",
        concurrency=len(prompts),
        records=tuple(records),
        wall_s=wall,
        notes=(f"setup outside the measured span: {call_end - call_start - wall:.1f}s",),
    )
