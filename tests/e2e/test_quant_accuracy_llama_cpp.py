"""``genserve-bench quant-accuracy --llama-cpp`` on a tiny GGUF: full next-token
distributions from genserve (float32 reference, the Q8_0 blocks through the float path and
through the integer kernels) and from ``llama-server`` on the same file, compared (#28).

Needs llama.cpp's ``llama-server`` (``LLAMA_CPP_BIN``, default /work/llamacpp/build/bin):
skipped where it is not built, as on CI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from genserve.bench import quant_accuracy
from genserve.bench.server_compare import free_port
from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.testing.tiny_gguf import make_tiny_gguf

_BIN = Path(os.environ.get("LLAMA_CPP_BIN", "/work/llamacpp/build/bin"))


@pytest.mark.skipif(not (_BIN / "llama-server").is_file(), reason=f"no llama-server in {_BIN}")
@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
def test_distributions_beside_llama_cpp(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", "Q8_0", seed=3)
    configs = "float32,gguf" + (",gguf-int-dot" if int_dot.available_isas() else "")
    out = tmp_path / "accuracy.json"
    argv = ["--model-id", str(model), "--configs", configs, "--llama-cpp"]
    argv += ["--llama-cpp-bin", str(_BIN), "--dist-tokens", "12", "--max-new-tokens", "2"]
    argv += ["--port", str(free_port()), "--timeout", "300", "--out", str(out)]
    assert quant_accuracy.main(argv) == 0
    rows = {r["side"]: r for r in json.loads(out.read_text())["distribution_rows"]}
    assert set(rows) == {*configs.split(",")[1:], "llama.cpp"}
    for side, row in rows.items():
        # Q8_0 weights (and int8 activations) against their own dequantized float32: close.
        assert 0 <= row["mean_kl"] < 0.05, side
        assert row["top1_agreement"] >= 0.5, side
        assert 0.9 < row["ppl_ratio"] < 1.1, side
