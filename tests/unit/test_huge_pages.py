"""Weights a CPU decode step streams are copied into one region advised for 2 MiB pages
(``genserve.model.huge_pages``): the copies equal the originals, sit 64-byte aligned in one
range, a tied embedding follows its head, and hosts where the advice cannot help keep their
tensors.  The CPU KV pool is allocated the same way (zeros_on_huge_pages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genserve.model import huge_pages
from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.huge_pages import HugePageRegion, huge_page_region, thp_mode
from tests.conftest import TinyModelFactory

madvise_only = pytest.mark.skipif(
    thp_mode() != "madvise",
    reason=f"transparent huge pages are {thp_mode() or 'absent'!r} here, not 'madvise'",
)


def test_place_copies_values_dtype_and_shape_at_cache_line_offsets() -> None:
    tensors = [
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.uint8),
        torch.randn(4, 2).to(torch.bfloat16),
        torch.randn(2, 2, 2).to(torch.float16),
    ]
    region = HugePageRegion(sum(t.nbytes for t in tensors) + 64 * len(tensors))
    placed = [region.place(t) for t in tensors]
    start = placed[0].data_ptr()
    assert start % (2 << 20) == 0  # the region starts on a huge page
    for original, copy in zip(tensors, placed, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original)
        assert copy.data_ptr() % 64 == 0
        assert copy.data_ptr() != original.data_ptr()
    assert len({t.data_ptr() for t in placed}) == len(placed)


def test_a_full_region_keeps_what_does_not_fit_where_it_is() -> None:
    region = HugePageRegion(1)  # rounded up to one 2 MiB page
    placed = region.place(torch.zeros(1 << 19))  # exactly 2 MiB of float32
    assert placed.data_ptr() % (2 << 20) == 0
    # Sized by an estimate, a region never fails a load: the tensor stays on small pages.
    extra = torch.ones(3)
    assert region.place(extra) is extra
    with pytest.raises(ValueError, match="full"):
        region.zeros(1)  # a slice asked for explicitly is refused


def test_placed_tensors_outlive_the_region_object() -> None:
    region = HugePageRegion(1 << 20)
    original = torch.randn(256, 256)
    copy = region.place(original)
    del region
    assert torch.equal(copy, original)  # the mapping lives as long as a view of it


def test_no_region_where_the_advice_cannot_help(monkeypatch: pytest.MonkeyPatch) -> None:
    for mode in ("always", "never", ""):
        monkeypatch.setattr(huge_pages, "thp_mode", lambda mode=mode: mode)
        with huge_page_region([1 << 20], torch.device("cpu")) as region:
            assert region is None
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    with huge_page_region([1 << 20], torch.device("meta")) as region:
        assert region is None
    with huge_page_region([], torch.device("cpu")) as region:
        assert region is None


@madvise_only
def test_zeros_on_huge_pages_is_a_writable_zero_tensor_on_an_aligned_region() -> None:
    shape = (2, 3, 40, 16, 64)  # a KV pool's [layers?, 2, heads, blocks, block, head_dim]
    pool = huge_pages.zeros_on_huge_pages(shape, torch.bfloat16)
    assert pool is not None
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert pool.data_ptr() % (2 << 20) == 0
    assert not pool.any()
    pool[1, 2, 39] = 1.5  # the last block, written through a view
    assert pool.sum().item() == 1.5 * 16 * 64


def test_zeros_stay_ordinary_where_the_advice_cannot_help(monkeypatch: pytest.MonkeyPatch) -> None:
    for mode in ("always", "never", ""):
        monkeypatch.setattr(huge_pages, "thp_mode", lambda mode=mode: mode)
        assert huge_pages.zeros_on_huge_pages((4, 4), torch.float32) is None


def test_the_cpu_kv_pool_takes_huge_pages_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    from genserve.worker.runner_setup import zeros as _zeros

    shape = (4, 2, 3, 50, 16, 64)  # [layers, 2, kv_heads, blocks, block_size, head_dim]
    if thp_mode() == "madvise":
        pool = _zeros(shape, torch.float32, torch.device("cpu"))
        assert pool.data_ptr() % (2 << 20) == 0 and not pool.any()
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    plain = _zeros(shape, torch.float32, torch.device("cpu"))  # calloc'd, as before
    assert plain.shape == shape and not plain.any()


def _fused_model(model_dir: Path, dtype: torch.dtype, quantize: str | None) -> DecoderForCausalLM:
    from genserve.model.config import load_model_config
    from genserve.model.quantize_model import quantize_model
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights
    from genserve.parallel import ParallelContext

    config = load_model_config(model_dir)
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), dtype, torch.device("cpu"))
        with SafetensorsWeights(model_dir) as weights:
            model.load_weights(weights)
        if quantize is not None:
            quantize_model(model, quantize)
        model.use_fused_cpu_ops(matvec_rows=4)
    return model


def _streamed(model: DecoderForCausalLM) -> list[torch.Tensor]:
    holders = [lin for layer in model._layers for lin in model._linears(layer)]
    holders.append(model.lm_head)
    return [t for holder in holders for t in holder.streamed_weights()]


@madvise_only
@pytest.mark.parametrize(("arch", "dtype", "quantize"), [
    ("llama", torch.float32, None),  # tied: the embedding reads the head's panels
    ("llama", torch.float32, "int4"),
    ("qwen2", torch.bfloat16, None),  # untied, plain bf16 weights
])  # fmt: skip
def test_streamed_weights_move_into_one_region(
    tiny_model_factory: TinyModelFactory,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    dtype: torch.dtype,
    quantize: str | None,
) -> None:
    from genserve.kernels import cpu as cpu_kernels

    if not cpu_kernels.load():
        pytest.skip("genserve's CPU kernels did not build here")
    model_dir = tiny_model_factory(arch)
    moved = _fused_model(model_dir, dtype, quantize)
    with monkeypatch.context() as patch:
        patch.setattr(huge_pages, "thp_mode", lambda: "never")
        kept = _fused_model(model_dir, dtype, quantize)

    streamed, originals = _streamed(moved), _streamed(kept)
    assert streamed and len(streamed) == len(originals)
    for copy, original in zip(streamed, originals, strict=True):
        assert torch.equal(copy, original)
    # One region: 2 MiB-aligned, the tensors back to back (64-byte alignment aside); the
    # unmoved model's tensors are torch's own.
    addresses = sorted(t.data_ptr() for t in streamed)
    assert addresses[0] % (2 << 20) == 0
    assert addresses[-1] - addresses[0] < sum(t.nbytes for t in streamed) + 64 * len(streamed)
    embed, head = moved.embed_tokens, moved.lm_head
    if moved.config.tie_word_embeddings:
        assert embed.panels is head.panels and embed.qpanels is head.qpanels
    ids = torch.tensor([5, 17, 300])
    with torch.inference_mode():
        got = moved.compute_logits(moved.embed_tokens.forward(ids))
        want = kept.compute_logits(kept.embed_tokens.forward(ids))
    assert torch.equal(got, want)


def _populate_supported() -> bool:
    """MADV_POPULATE_WRITE works here (Linux 5.14+)."""
    import mmap

    advice = huge_pages._MADV_POPULATE_WRITE
    if advice is None:
        return False
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(advice, 0, mmap.PAGESIZE)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _resident_bytes(address: int) -> int:
    """``Rss`` of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def _wait_for(condition: object, timeout_s: float = 10.0) -> None:
    import time

    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the commit thread did not get there"
        time.sleep(0.005)


@pytest.mark.skipif(not _populate_supported(), reason="no MADV_POPULATE_WRITE (Linux < 5.14)")
def test_commit_ahead_stays_a_window_ahead_and_hands_back_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mib = 1 << 20
    monkeypatch.setattr(huge_pages, "_AHEAD_WINDOW", 8 * mib)
    monkeypatch.setattr(huge_pages, "_AHEAD_CHUNK", 2 * mib)
    monkeypatch.setattr(huge_pages, "_AHEAD_FRACTION", 2)  # 16 MiB of 32, capped at 8
    region = HugePageRegion(32 * mib)
    base = region._buffer.data_ptr()
    region.commit_ahead()
    ahead = region._ahead
    assert ahead is not None
    _wait_for(lambda: ahead.committed == 8 * mib)  # nothing placed yet: one window
    assert _resident_bytes(base) >= 8 * mib
    original = torch.randint(0, 255, (6 * mib,), dtype=torch.uint8)
    copy = region.place(original)
    _wait_for(lambda: ahead.committed >= 14 * mib)  # a window past the placed tensor
    region.stop_commit_ahead()
    assert region._ahead is None and not ahead._thread.is_alive()
    assert torch.equal(copy, original)
    # Past the huge page that holds the tensor's end, the thread's pages are handed back.
    assert _resident_bytes(base) <= 8 * mib
    later = torch.ones(3 * mib, dtype=torch.uint8)
    assert torch.equal(region.place(later), later)  # the region goes on without the thread
