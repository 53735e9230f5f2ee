"""The decode matmuls' work split (kernels/row_shares.h): each thread owns a contiguous share
of the weight rows and an idle thread takes the rest of the others' chunks, so which thread
computes a row varies from call to call.  A row's result must not: the K-quant and the block
integer kernels give bit-identical outputs at every thread count, including more threads than
cores (the oversubscribed threads are preempted mid-share, which is when the others help), at
one activation row (the one-stream decode step) and a few."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gguf import GGMLQuantizationType

from genserve.bench.int_dot_speed import q4_0
from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.kernels.int_dot import Isa
from genserve.model.int_dot_panels import IntDotPanels
from genserve.model.kquants import KQuantWeight, cat_kquant
from genserve.testing.tiny_gguf import random_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")

THREADS = (1, 2, 3, 7)  # 7: more threads than this kind of machine's cores


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _kquant(qtype: str, rows: int, cols: int, seed: int) -> KQuantWeight:
    raw = random_blocks(GGMLQuantizationType[qtype], rows, cols, seed=seed)
    return KQuantWeight.from_blocks(raw, qtype)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.usefixtures("restore_threads")
def test_k_quant_rows_do_not_depend_on_the_thread_count(rows: int) -> None:
    if not int_dot.available_isas():
        pytest.skip("no integer path on this CPU")
    # ~30 chunks of 232 Q4_K rows (K = 256), the segment boundaries inside chunks, and a
    # row count that is not a multiple of the one-row path's 4-row pass
    weight = cat_kquant(
        [_kquant("Q4_K", 4001, 256, 1), _kquant("Q6_K", 1203, 256, 2), _kquant("Q5_K", 777, 256, 3)]
    ).serving(int(Isa.AUTO))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(4))
    results = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        results += [weight.linear(x, None) for _ in range(3)]
    for got in results[1:]:
        assert torch.equal(got, results[0])


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.usefixtures("restore_threads")
def test_block_integer_rows_do_not_depend_on_the_thread_count(rows: int) -> None:
    if Isa.AVX2 not in int_dot.available_isas():
        pytest.skip("no integer path on this CPU")
    gen = torch.Generator().manual_seed(5)
    panels = IntDotPanels.pack(q4_0(torch.randn(3000, 1024, generator=gen)))  # ~24 chunks
    x = torch.randn(rows, 1024, generator=gen)
    results = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        results += [panels.linear(x, None) for _ in range(3)]
    for got in results[1:]:
        assert torch.equal(got, results[0])
