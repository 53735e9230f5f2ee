"""The dequantized-row cache of a quantized embedding (model/embedding_rows.py)."""

from __future__ import annotations

import torch

from genserve.model.embedding_rows import DequantizedRowCache
from genserve.model.quantization import quantize_int8
from genserve.model.weight_panels import QuantizedPanels
from genserve.parallel import ParallelContext


def _panels(seed: int) -> QuantizedPanels:
    gen = torch.Generator().manual_seed(seed)
    return QuantizedPanels.pack(quantize_int8(torch.randn(70, 96, generator=gen)))


def test_cached_rows_are_the_dequantized_rows_and_fresh_tensors() -> None:
    panels, cache = _panels(0), DequantizedRowCache()
    for token in (5, 69, 5, 0, 5):
        ids = torch.tensor([token])
        row = cache.lookup(panels, ids, torch.float32, panels.dequantize_rows)
        assert torch.equal(row, panels.dequantize_rows(ids, torch.float32))
        row.add_(1.0)  # the caller's to write: the cache keeps its own copy
    assert len(cache) == 3


def test_batches_bypass_and_a_new_table_or_dtype_forgets() -> None:
    a, b, cache = _panels(0), _panels(1), DequantizedRowCache()
    ids = torch.tensor([3, 4])
    assert torch.equal(
        cache.lookup(a, ids, torch.float32, a.dequantize_rows),
        a.dequantize_rows(ids, torch.float32),
    )
    assert len(cache) == 0
    one = torch.tensor([3])
    cache.lookup(a, one, torch.float32, a.dequantize_rows)
    got = cache.lookup(b, one, torch.float32, b.dequantize_rows)
    assert torch.equal(got, b.dequantize_rows(one, torch.float32)) and len(cache) == 1
    got = cache.lookup(b, one, torch.bfloat16, b.dequantize_rows)
    assert got.dtype == torch.bfloat16 and torch.equal(got, b.dequantize_rows(one, torch.bfloat16))


def test_budget_bounds_the_rows_kept() -> None:
    panels = _panels(0)
    cache = DequantizedRowCache(budget_bytes=2 * 96 * 4)  # two float32 rows
    for token in range(5):
        ids = torch.tensor([token])
        row = cache.lookup(panels, ids, torch.float32, panels.dequantize_rows)
        assert torch.equal(row, panels.dequantize_rows(ids, torch.float32))
    assert len(cache) == 2


def test_tied_embedding_lookup_matches_the_head_rows() -> None:
    from genserve.model.layers import VocabParallelEmbedding

    embed = VocabParallelEmbedding(70, 96, ParallelContext(), torch.float32, torch.device("cpu"))
    embed.qpanels = _panels(2)
    for token in (7, 7, 12):
        ids = torch.tensor([token])
        assert torch.equal(embed(ids), embed.qpanels.dequantize_rows(ids, torch.float32))
    ids = torch.tensor([7, 12, 7])
    assert torch.equal(embed(ids), embed.qpanels.dequantize_rows(ids, torch.float32))
