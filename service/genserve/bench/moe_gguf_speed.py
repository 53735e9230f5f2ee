"""``python -m genserve.bench.moe_gguf_speed FILE.gguf``: op-level timing of one decode row
through ``genserve::moe_experts_gguf`` (kernels/moe_quant_cpu.cpp) on a GGUF file's own routed
expert tensors (copied onto 2 MiB pages as the server places them, unless ``--small-pages``),
one layer at a time, each call on freshly drawn random experts (top-k of E), so the experts'
blocks come from memory as in a decode step rather than from cache.

Prints per layer the median ms per call and the GB/s of expert rows it reads (the chosen
experts' gate, up and down bytes).  Not a test: numbers depend on the machine and on what else
runs on it (docs/models/moe.md records a run).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.huge_pages import huge_page_region

# GGML type codes the op takes for K-quant and block-of-32 experts.
_CODES = {"Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _experts(path: str) -> list[dict[str, tuple[torch.Tensor, int]]]:
    """Each layer's (blocks [E, N, row bytes], type code) per projection, memory-mapped."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    layers: list[dict[str, tuple[torch.Tensor, int]]] = []
    for layer in range(10_000):
        if f"blk.{layer}.ffn_gate_exps.weight" not in by_name:
            break
        parts: dict[str, tuple[torch.Tensor, int]] = {}
        for proj in ("gate", "up", "down"):
            t = by_name[f"blk.{layer}.ffn_{proj}_exps.weight"]
            experts, rows = int(t.shape[2]), int(t.shape[1])
            with warnings.catch_warnings():  # read-only map: the op only reads the blocks
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(np.asarray(t.data)).view(experts, rows, -1)
            parts[proj] = (blocks, _CODES[t.tensor_type.name])
        layers.append(parts)
    return layers


def _on_huge_pages(
    layers: list[dict[str, tuple[torch.Tensor, int]]],
) -> list[dict[str, tuple[torch.Tensor, int]]]:
    """The blocks copied onto 2 MiB pages, as the server places the experts it streams
    (model/huge_pages.py); the layers as they are where THP is not in madvise mode.  On the
    file's 4 KiB mapping every expert row read also walks the page tables."""
    sizes = [blocks.numel() for parts in layers for blocks, _ in parts.values()]
    with huge_page_region(sizes, torch.device("cpu")) as region:
        if region is None:
            return layers
        return [
            {proj: (region.place(blocks), code) for proj, (blocks, code) in parts.items()}
            for parts in layers
        ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--calls", type=int, default=80)
    parser.add_argument("--isa", type=int, default=0, help="int_dot.h code (0: auto, -1: float)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--small-pages", action="store_true", help="read the file's mapping, not 2 MiB pages"
    )
    args = parser.parse_args(argv)
    if not cpu_kernels.load():
        print("genserve CPU kernels unavailable")
        return 1
    torch.set_num_threads(args.threads)
    layers = _experts(args.gguf)
    if not args.small_pages:
        layers = _on_huge_pages(layers)
    if not layers:
        print("no routed expert tensors (blk.N.ffn_gate_exps.weight) in", args.gguf)
        return 1
    gen = torch.Generator().manual_seed(0)
    experts, hidden = layers[0]["gate"][0].shape[0], layers[0]["down"][0].shape[1]
    x = torch.randn(1, hidden, generator=gen)
    times: list[list[float]] = [[] for _ in layers]
    for call in range(args.calls + 5):  # the first 5 rounds warm up
        for layer, parts in enumerate(layers):
            ids = torch.randperm(experts, generator=gen)[: args.top_k].view(1, -1)
            weights = torch.softmax(torch.randn(1, args.top_k, generator=gen), -1)
            start = time.perf_counter()
            torch.ops.genserve.moe_experts_gguf(
                x, ids, weights, parts["gate"][0], parts["up"][0], parts["down"][0],
                [parts["gate"][1], parts["up"][1], parts["down"][1]], args.isa,
            )  # fmt: skip
            if call >= 5:
                times[layer].append(time.perf_counter() - start)
    print("| layer | types (gate, up, down) | ms a call | MB read | GB/s |")
    print("|---|---|---|---|---|")
    for layer, parts in enumerate(layers):
        read = args.top_k * sum(parts[p][0][0].numel() for p in ("gate", "up", "down"))
        med = statistics.median(times[layer])
        types = ", ".join(str(parts[p][1]) for p in ("gate", "up", "down"))
        gbs = read / med / 1e9
        print(f"| {layer} | {types} | {med * 1e3:.3f} | {read / 1e6:.1f} | {gbs:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
