"""What the model runner needs before its first step: loading (and quantizing) the weights, and
memory — zeroed tensors that cost nothing until touched, the RAM the OS can give, glibc's
habit of returning freed blocks to the OS.  Functions only; no runner state.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.huge_pages import zeros_on_huge_pages
from genserve.model.loader import ResolvedModel
from genserve.model.quantize_model import QuantizeSummary, quantize_model
from genserve.model.weight_files import has_weights
from genserve.model.weights import SafetensorsWeights


def load_weights(model: DecoderForCausalLM, resolved: ResolvedModel) -> QuantizeSummary | None:
    """Load ``model``'s weights and apply ``--quantize``; the summary when quantized.

    A GGUF model is read from the file itself (model/gguf_weights.py): with ``--quantize
    gguf`` its Q8_0/Q4 matrices (and a mixture of experts' stacked experts) are handed to
    the layers first, one module at a time, so those layers never hold (or read) a float
    copy; everything else is dequantized tensor by tensor.  Other checkpoints load their
    safetensors, then quantize (int8 / int4)."""
    from genserve.model.quantization import QuantizationError

    method = resolved.quantize
    if method == "gguf" and resolved.gguf_file is None:
        raise QuantizationError(
            "--quantize gguf keeps a GGUF file's quantization, but the model was not "
            "loaded from a .gguf file (use --quantize int8 or int4 for other checkpoints)"
        )
    if resolved.gguf_file is not None and not has_weights(resolved.local_dir):
        from genserve.model.gguf_weights import GGUFWeights

        config = model.config
        with GGUFWeights(resolved.gguf_file, config.num_heads, config.num_kv_heads) as gguf:
            summary = None
            if method == "gguf":
                summary = quantize_model(model, method, gguf.quantized_view(), gguf)
            with torch.inference_mode():
                model.load_weights(gguf)
        if method is not None and method != "gguf":
            summary = quantize_model(model, method)
        return summary
    with torch.inference_mode(), SafetensorsWeights(resolved.local_dir) as weights:
        model.load_weights(weights)
    if method is None:
        return None
    tensors = None
    if method == "gguf":
        from genserve.model.gguf_weights import read_gguf_quantized

        assert resolved.gguf_file is not None
        config = model.config
        tensors = read_gguf_quantized(resolved.gguf_file, config.num_heads, config.num_kv_heads)
    return quantize_model(model, method, tensors)


def keep_freed_memory() -> None:
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


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


def available_ram_bytes() -> int:
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil comes with accelerate, but /proc is enough on Linux
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("cannot determine available memory") from None
