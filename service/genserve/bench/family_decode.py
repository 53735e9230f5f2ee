"""Decode speed of each native family against Llama at the same shape and precision.

    python -m genserve.bench.family_decode [--families qwen3,gemma2] [--dtypes float32,bfloat16]

Each family is a random-weight checkpoint of the same shape (``--hidden``, ``--layers``,
heads, ``--vocab``: a small vocabulary so that the LM head does not hide the layers) with the
family's own features on (the tiny test configs, ``genserve.testing.tiny_model.FAMILY_CONFIGS``),
served by the model runner's pieces with the CPU kernels: one stream, a short prefill, then
``--steps`` decode steps timed.  One family at a time is loaded beside Llama (a real-ish shape
in float32 is GBs per model), and its rounds interleaved with Llama's: the median tokens/s of
each and their ratio are printed, with whether the fused decode layer ran (the machines are
shared: compare within one line only).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.config import load_model_config
from genserve.model.registry import build_model
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from genserve.testing.tiny_model import NATIVE_FAMILIES, make_tiny_model

_BLOCK = 16


def _load(model_dir: Path, dtype: torch.dtype) -> DecoderForCausalLM:
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), dtype, cpu)
        with SafetensorsWeights(model_dir) as weights:
            model.load_weights(weights)
        if cpu_kernels.usable(cpu, dtype):
            model.use_fused_cpu_ops(matvec_rows=cpu_kernels.matvec_max_rows())
    return model


@torch.inference_mode()
def decode_rate(model: DecoderForCausalLM, steps: int, prompt_len: int = 32) -> float:
    """Tokens per second over ``steps`` single-stream decode steps after a prefill."""
    config = model.config
    backend = TorchPagedAttention(torch.device("cpu"), use_cpu_kernel=cpu_kernels.load())
    blocks = -(-(prompt_len + steps + 1) // _BLOCK)
    shape = backend.kv_cache_shape(blocks, _BLOCK, model.num_local_kv_heads, config.head_dim)
    caches = [torch.zeros(shape, dtype=model.dtype) for _ in range(config.num_layers)]
    table = tuple(range(blocks))
    ids = torch.randint(3, config.vocab_size, (prompt_len,))
    meta = backend.build([SeqSpec(prompt_len, 0, table)], 0, _BLOCK)
    hidden = model(ids, torch.arange(prompt_len), caches, meta)
    token = model.compute_logits(hidden[-1:]).argmax(-1)
    start = time.perf_counter()
    for pos in range(prompt_len, prompt_len + steps):
        meta = backend.build([SeqSpec(1, pos, table)], 1, _BLOCK)
        hidden = model(token, torch.tensor([pos]), caches, meta)
        token = model.compute_logits(hidden).argmax(-1)
    return steps / (time.perf_counter() - start)


def _family_fields(
    family: str, layers: int, head_dim: int, shape: dict[str, int]
) -> dict[str, Any]:
    """``shape`` plus what ``family`` needs at it (its tiny test config is sized for 2
    layers and head_dim 16)."""
    fields: dict[str, Any] = dict(shape)
    if family in ("gpt_neox", "phi"):  # multi-head attention only
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if family == "smollm3":
        fields["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(layers)]
    if family in ("gemma2", "gemma3"):
        fields["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    if family == "phi3":  # longrope factors for this head size (rotary 3/4 of the head)
        n = head_dim * 3 // 8
        fields["rope_parameters"] = {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + i / n for i in range(n)],
            "long_factor": [2.0 + i / n for i in range(n)],
        }  # fmt: skip
    return fields


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(NATIVE_FAMILIES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    families = args.families.split(",")
    shape = {
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": args.hidden // 128,
        "head_dim": 64,
        "vocab_size": args.vocab,
        "initializer_range": 0.02,
    }
    print(
        f"decode, 1 stream, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"{args.steps} steps x {args.repeats} rounds (family, Llama interleaved)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        llama_dir = make_tiny_model(Path(tmp) / "llama", "llama", **shape)
        llama = {dtype: _load(llama_dir, dtype) for dtype in dtypes}
        for family in families:
            fields = _family_fields(family, args.layers, 64, shape)
            family_dir = make_tiny_model(Path(tmp) / family, family, **fields)
            for dtype in dtypes:
                model = _load(family_dir, dtype)
                ours, base = [], []
                for _ in range(args.repeats):  # interleaved: load from other jobs hits both
                    ours.append(decode_rate(model, args.steps))
                    base.append(decode_rate(llama[dtype], args.steps))
                rate, ref = statistics.median(ours), statistics.median(base)
                fused = "fused" if model.decode_layers_fused else "per-op"
                print(
                    f"{family:12s} {str(dtype).removeprefix('torch.'):9s} {rate:7.1f} tok/s "
                    f"(Llama {ref:7.1f})  {rate / ref:5.2f}x  {fused}",
                    flush=True,
                )
                del model
            shutil.rmtree(family_dir)


if __name__ == "__main__":
    main()
