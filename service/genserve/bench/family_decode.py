"""Decode speed of each native family against Llama at the same shape and precision.

    python -m genserve.bench.family_decode --families llama,qwen3,gemma --dtype float32

Each family is a random-weight checkpoint of the same small shape (``--hidden``, ``--layers``,
heads, vocabulary) with the family's own features on (the tiny test configs,
``genserve.testing.tiny_model.FAMILY_CONFIGS``), served by the model runner's pieces with the
CPU kernels: one stream, a short prefill, then ``--steps`` decode steps timed.  Families are
interleaved over ``--repeats`` and the median tokens/s reported with its ratio to Llama's (the
machines are shared: compare within one run only).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.config import load_model_config
from genserve.model.registry import build_model
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from genserve.testing.tiny_model import make_tiny_model

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="llama,qwen3,gemma,gemma2,granite,olmo2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    families = args.families.split(",")
    shape = {
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": args.hidden // 128,
        "head_dim": 64,
        "initializer_range": 0.02,
    }
    rates: dict[str, list[float]] = {f: [] for f in families}
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for family in families:
            fields = dict(shape)
            if family in ("gpt_neox", "phi"):  # multi-head attention only
                fields["num_key_value_heads"] = fields["num_attention_heads"]
            if family == "smollm3":
                fields["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(args.layers)]
            if family in ("gemma2", "gemma3"):
                fields["layer_types"] = ["sliding_attention", "full_attention"] * (args.layers // 2)
            models[family] = _load(make_tiny_model(Path(tmp) / family, family, **fields), dtype)
        for _ in range(args.repeats):
            for family in families:
                rates[family].append(decode_rate(models[family], args.steps))
    base = statistics.median(rates[families[0]])
    print(f"decode tok/s, 1 stream, {args.dtype}, hidden {args.hidden}, {args.layers} layers")
    for family in families:
        rate = statistics.median(rates[family])
        print(f"{family:12s} {rate:8.1f} tok/s  {rate / base:5.2f}x {families[0]}")


if __name__ == "__main__":
    main()
