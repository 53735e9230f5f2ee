"""A GGUF model loads as it is stored: no float32 copy of its quantized matrices at any
moment.  Measured as the peak resident size (``VmHWM``) of a process that loads a ~100 MB
Q8_0 file, and a ~45 MB Q4_K_M mix (K-quant super-blocks kept as stored), over what it held
before loading (torch, genserve and the tokenizer imported, and the model's config read:
transformers' configuration modules are ~100 MB of Python whatever the file's size): a
float32 intermediate would add ~4x (Q8_0) or ~6.5x (Q4_K_M) the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from genserve.kernels import cpu as cpu_kernels
from genserve.model.loader import resolve_model
from genserve.testing.kquant_gguf import write_q4_k_m_gguf
from genserve.testing.tiny_gguf import write_random_q8_0_gguf

_MEASURE = textwrap.dedent(
    """
    import dataclasses, json, sys
    from pathlib import Path
    import torch
    from genserve.model.loader import resolve_model
    from genserve.model.serving_path import choose_serving_path
    from genserve.worker.model_runner import ModelRunner

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    resolved = resolve_model(sys.argv[1], cache_dir=Path(sys.argv[2]))
    resolved = dataclasses.replace(resolved, quantize=sys.argv[3])
    choose_serving_path(resolved.local_dir)  # imports what reading any config imports
    before = status("VmRSS")
    runner = ModelRunner(resolved, torch.float32, torch.device("cpu"))
    print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"),
                      "weights": runner.weight_bytes()}))
    """
)

MiB = 1 << 20


def _q4_k_m(path: Path) -> Path:
    """A real-size-like Q4_K_M mix (``kquant_gguf``'s small shape, ~45 MB, K-quants only)."""
    return write_q4_k_m_gguf(path, "small-kquant-shape")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.skipif(not cpu_kernels.load(), reason="no CPU kernels: GGUF blocks are dequantized")
@pytest.mark.parametrize(
    ("fmt", "write", "bits"), [("q8_0", write_random_q8_0_gguf, 8.5), ("q4_k_m", _q4_k_m, 4.9)]
)
def test_gguf_loads_without_a_float_copy(
    tmp_path: Path, fmt: str, write: Callable[[Path], Path], bits: float
) -> None:
    gguf = write(tmp_path / f"model-{fmt}.gguf")
    size = gguf.stat().st_size
    cache = tmp_path / "models"
    resolved = resolve_model(str(gguf), cache_dir=cache)  # config + tokenizer, once
    # Nothing of the weights is cached: the entry is the config and the tokenizer.
    kept = sum(f.stat().st_size for f in resolved.local_dir.rglob("*") if f.is_file())
    assert kept < 16 * MiB and not list(resolved.local_dir.glob("*.safetensors"))
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(gguf), str(cache), "gguf"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    grew = got["peak"] - got["before"]
    float_copy = size * 32 / bits  # the same matrices in float32
    print(f"file {size / MiB:.1f} MiB, load peak +{grew / MiB:.1f} MiB, {got}")
    assert got["weights"] < size * 1.1
    # 1.3x the file plus a margin for the model skeleton (norms, buffers, kernel library).
    assert grew < size * 1.3 + 48 * MiB, (
        f"peak grew {grew / MiB:.0f} MiB for a {size / MiB:.0f} MiB file"
    )
    assert grew < float_copy / 2
