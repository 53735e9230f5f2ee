"""``python -m genserve.bench.moe_gguf_speed FILE.gguf``: op-level timing of one decode row
through ``genserve::moe_experts_gguf`` (kernels/moe_quant_cpu.cpp) on a GGUF file's own routed
expert tensors in the layout the server runs them (``QuantizedExperts.serving``: Q8_0 repacked
in groups of 16 rows on the AVX512-VNNI path) and where it places them (2 MiB pages, unless
``--small-pages``), one layer at a time, each call on freshly drawn random experts (top-k of
E), so the experts' blocks come from memory as in a decode step rather than from cache.

Prints per layer the median ms per call and the GB/s of expert rows it reads (the chosen
experts' gate, up and down bytes), and with ``--dense`` the same for the dense kernels on a
dense MLP of equal bytes (gate and up fused ``[2·top_k·L, H]``, down ``[H, top_k·L]``: the
equal-active dense model's MLP) in the experts' formats, rotating over copies so that its
weights come from memory too.  Not a test: numbers depend on the machine and on what else
runs on it (docs/models/moe.md records runs).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.huge_pages import huge_page_region
from genserve.model.moe_gguf import PACKED_Q8_0, QuantizedExperts


def _experts(path: str, isa: int, count: int) -> list[QuantizedExperts]:
    """The first ``count`` (0: all) layers' routed experts, memory-mapped, in the layout path
    ``isa`` serves them (Q8_0 repacked: a copy)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    layers: list[QuantizedExperts] = []
    for layer in range(count or 10_000):
        if f"blk.{layer}.ffn_gate_exps.weight" not in by_name:
            break
        blocks: list[torch.Tensor] = []
        types: list[str] = []
        for proj in ("gate", "up", "down"):
            t = by_name[f"blk.{layer}.ffn_{proj}_exps.weight"]
            experts, rows = int(t.shape[2]), int(t.shape[1])
            with warnings.catch_warnings():  # read-only map: the op only reads the blocks
                warnings.simplefilter("ignore", UserWarning)
                blocks.append(torch.from_numpy(np.asarray(t.data)).view(experts, rows, -1))
            types.append(t.tensor_type.name)
        gate, up, down = blocks
        stored = QuantizedExperts(gate, up, down, (types[0], types[1], types[2]))
        layers.append(stored.serving(isa))
    return layers


def _on_huge_pages(layers: list[QuantizedExperts]) -> list[QuantizedExperts]:
    """The blocks copied onto 2 MiB pages, as the server places the experts it streams
    (model/huge_pages.py); the layers as they are where THP is not in madvise mode.  On the
    file's 4 KiB mapping every expert row read also walks the page tables."""
    sizes = [int(b.nbytes) for e in layers for b in (e.gate, e.up, e.down)]
    with huge_page_region(sizes, torch.device("cpu")) as region:
        if region is None:
            return layers
        return [experts.placed(region) for experts in layers]


def _dense_mlp(
    experts: QuantizedExperts, top_k: int, isa: int, cold_bytes: int, small_pages: bool
) -> Callable[[torch.Tensor], object]:
    """One row through the dense kernels' MLP of the bytes ``top_k`` of these experts hold
    (gate|up ``[2·top_k·L, H]`` one matrix, down ``[H, top_k·L]``), in the experts' formats
    (Q8_0 as ``IntDotPanels``, K-quants as ``KQuantWeight``), random values, on 2 MiB pages
    as the experts (unless ``small_pages``); each call takes the next of enough copies to add
    up to ``cold_bytes``, so that it reads from memory as a decode step does."""
    from gguf import GGMLQuantizationType

    from genserve.bench.int_dot_speed import q8_0
    from genserve.kernels.int_dot import Isa
    from genserve.model.int_dot_panels import IntDotPanels
    from genserve.model.kquants import KQuantWeight
    from genserve.testing.tiny_gguf import random_blocks

    width, hidden = top_k * experts.gate.shape[1], experts.down.shape[1]
    Matrix = IntDotPanels | KQuantWeight

    def matrix(qtype: str, n: int, k: int) -> Matrix:
        if qtype in ("Q8_0", PACKED_Q8_0):
            return IntDotPanels.pack(q8_0(torch.randn(n, k) * 0.02))
        raw = random_blocks(GGMLQuantizationType[qtype], n, k, seed=0)
        return KQuantWeight.from_blocks(raw, qtype).serving(isa)

    per_copy = experts.nbytes // experts.gate.shape[0] * top_k
    copies = max(1, -(-cold_bytes // per_copy))
    mlps = [
        (matrix(experts.types[0], 2 * width, hidden), matrix(experts.types[2], hidden, width))
        for _ in range(copies)
    ]
    if not small_pages:
        sizes = [int(m.data.nbytes) for pair in mlps for m in pair]
        sizes += [int(m.scales.nbytes) for p in mlps for m in p if isinstance(m, IntDotPanels)]
        with huge_page_region(sizes, torch.device("cpu")) as region:
            if region is not None:

                def placed(m: Matrix) -> Matrix:
                    if isinstance(m, IntDotPanels):
                        return replace(m, data=region.place(m.data), scales=region.place(m.scales))
                    return replace(m, data=region.place(m.data))

                mlps = [(placed(g), placed(d)) for g, d in mlps]

    def linear(m: Matrix, x: torch.Tensor) -> torch.Tensor:
        return m.linear(x, None, Isa(isa)) if isinstance(m, IntDotPanels) else m.linear(x, None)

    state = [0]

    def run(x: torch.Tensor) -> object:
        state[0] = (state[0] + 1) % len(mlps)
        gate_up, down = mlps[state[0]]
        gu = linear(gate_up, x)
        act = torch.nn.functional.silu(gu[:, :width]) * gu[:, width:]
        return linear(down, act)

    return run


def _median_ms(fn: Callable[[], object], calls: int) -> float:
    """The median wall time of ``calls`` calls after 5 warm-up calls, in ms."""
    times: list[float] = []
    for call in range(calls + 5):
        start = time.perf_counter()
        fn()
        if call >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


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
    parser.add_argument(
        "--dense",
        action="store_true",
        help="also time the dense kernels' MLP of equal bytes (random values, same formats)",
    )
    parser.add_argument("--layers", type=int, default=0, help="only the first N layers (0: all)")
    args = parser.parse_args(argv)
    if not cpu_kernels.load():
        print("genserve CPU kernels unavailable")
        return 1
    torch.set_num_threads(args.threads)
    layers = _experts(args.gguf, args.isa, args.layers)
    if not args.small_pages:
        layers = _on_huge_pages(layers)
    if not layers:
        print("no routed expert tensors (blk.N.ffn_gate_exps.weight) in", args.gguf)
        return 1
    gen = torch.Generator().manual_seed(0)
    experts, hidden = layers[0].gate.shape[0], layers[0].down.shape[1]
    x = torch.randn(1, hidden, generator=gen)
    times: list[list[float]] = [[] for _ in layers]
    for call in range(args.calls + 5):  # the first 5 rounds warm up
        for layer, quantized in enumerate(layers):
            ids = torch.randperm(experts, generator=gen)[: args.top_k].view(1, -1)
            weights = torch.softmax(torch.randn(1, args.top_k, generator=gen), -1)
            start = time.perf_counter()
            quantized.forward(x, ids, weights)
            if call >= 5:
                times[layer].append(time.perf_counter() - start)
    print("| layer | types (gate, up, down) | ms a call | MB read | GB/s |")
    print("|---|---|---|---|---|")
    for layer, quantized in enumerate(layers):
        read = quantized.nbytes // experts * args.top_k
        med = statistics.median(times[layer])
        types = ", ".join(quantized.types)
        gbs = read / med / 1e9
        print(f"| {layer} | {types} | {med * 1e3:.3f} | {read / 1e6:.1f} | {gbs:.1f} |")
    if args.dense:
        seen: set[tuple[str, str, str]] = set()
        for layer, quantized in enumerate(layers):
            if quantized.types in seen:
                continue
            seen.add(quantized.types)
            mlp = _dense_mlp(quantized, args.top_k, args.isa, 256 << 20, args.small_pages)
            ms = _median_ms(partial(mlp, x), args.calls)
            read = quantized.nbytes // experts * args.top_k
            print(
                f"| dense MLP (as layer {layer}) | {', '.join(quantized.types)} | {ms:.3f} "
                f"| {read / 1e6:.1f} | {read / ms / 1e6:.1f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
