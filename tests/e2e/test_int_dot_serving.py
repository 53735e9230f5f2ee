"""``--cpu-int-dot`` served over gRPC.

* The default (``auto``) serves a quantized GGUF on the integer kernels where the CPU has
  them, and says so (``Info.quantized_matmul`` / ``quantized_matmul_isa``, the
  ``cpu_int_dot`` log line); where it cannot (here: ``--disable-cpu-kernels``) it serves the
  float path and says that, rather than refusing to start.
* ``on`` with the kernels disabled cannot be honoured: the start is refused (exit 2, a line
  saying why), never silently served on the float path.
* The embedded default model (Q4_1 layers, a Q8_0 embedding) served with integer dot
  products against the same blocks on the float path: activations rounded to int8 per block
  of 32 change the logits a little, so the greedy tokens are compared for agreement (stated
  in docs/cpu/integer-kernels.md), not equality.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.model.loader import default_gguf_path
from genserve.testing.tiny_gguf import make_tiny_gguf
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.e2e.test_gguf_restart import fresh_cache
from tests.utils.live_server import LiveServer, free_port, genserve_command, start_server

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of each row of a matrix\n",
)
NEW_TOKENS = 24


def _info_and_reply(server: LiveServer) -> tuple[pb.InfoResponse, pb.GenerateResponse]:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        params = pb.GenerateParameters(max_new_tokens=4, details=True)
        reply = stub.Generate(pb.GenerateRequest(inputs=[PROMPTS[0]], parameters=params))
        return stub.Info(pb.InfoRequest()), reply


def _int_dot_log_line(server: LiveServer) -> dict[str, object]:
    lines = [json.loads(x) for x in server.logs().splitlines() if '"cpu_int_dot"' in x]
    assert len(lines) == 1, server.logs()
    line: dict[str, object] = lines[0]
    return line


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
@pytest.mark.skipif(not int_dot.available_isas(), reason="no integer kernel path (no AVX2)")
def test_a_quantized_gguf_takes_the_integer_path_by_default(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "tiny-Q4_0.gguf", "Q4_0", seed=2)
    cache = ("--genserve-cache", str(fresh_cache(tmp_path)))
    with start_server(model, *cache, "--json-output", "--prometheus-port", "0") as server:
        info, reply = _info_and_reply(server)
        line = _int_dot_log_line(server)
    best = int_dot.available_isas()[-1].name
    assert info.quantize == "gguf"
    assert (info.quantized_matmul, info.quantized_matmul_isa) == ("integer", best)
    assert (line["path"], line["isa"]) == ("integer", best), line
    assert "--cpu-int-dot auto" in str(line["reason"]), line
    assert reply.results[0].details.generated_tokens > 0


def test_auto_serves_the_float_path_where_there_is_no_integer_kernel(
    tiny_model_factory: TinyModelFactory,
) -> None:
    model = tiny_model_factory("llama", seed=2)
    flags = ("--disable-cpu-kernels", "--quantize", "int8", "--json-output")
    with start_server(model, *flags, "--prometheus-port", "0") as server:
        info, reply = _info_and_reply(server)
        line = _int_dot_log_line(server)
    assert info.quantize == "int8"
    assert (info.quantized_matmul, info.quantized_matmul_isa) == ("float", "")
    assert line["path"] == "float" and "no integer kernel" in str(line["reason"]), line
    assert reply.results[0].details.generated_tokens > 0


def test_on_without_the_kernels_is_refused_at_start() -> None:
    flags = ["--disable-cpu-kernels", "--quantize", "int8", "--cpu-int-dot", "on"]
    model = ["--model-id", str(default_gguf_path()), "--port", str(free_port())]
    proc = subprocess.run([*genserve_command(), *model, *flags], capture_output=True, timeout=300)
    assert proc.returncode == 2
    assert b"--cpu-int-dot on" in proc.stdout + proc.stderr


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
@pytest.mark.skipif(not int_dot.available_isas(), reason="no integer kernel path (no AVX2)")
def test_default_model_with_int_dot_agrees_with_the_float_path() -> None:
    params = pb.GenerateParameters(max_new_tokens=NEW_TOKENS, details=True)
    outputs: dict[str, list[list[int]]] = {}
    for mode in ("off", "on"):
        with (
            start_server(
                str(default_gguf_path()),
                "--dtype",
                "float32",
                "--max-batch-total-tokens",
                "4096",
                "--cpu-int-dot",
                mode,
            ) as server,  # fmt: skip
            grpc.insecure_channel(server.address) as channel,
        ):
            stub = pb_grpc.TextGenerationServiceStub(channel)
            assert stub.Info(pb.InfoRequest()).quantize == "gguf"
            outputs[mode] = [
                [
                    t.id
                    for t in stub.Generate(pb.GenerateRequest(inputs=[p], parameters=params))
                    .results[0]
                    .details.tokens
                ]
                for p in PROMPTS
            ]
    prefixes = [_agreeing_prefix(a, b) for a, b in zip(outputs["on"], outputs["off"], strict=True)]
    agreement = sum(prefixes) / (NEW_TOKENS * len(PROMPTS))
    print(f"int-dot vs float path: agreeing prefixes {prefixes} of {NEW_TOKENS}")
    # Not an equality: a near-tie between two tokens may flip, and the rest of that output
    # then differs.  Measured on an AVX512-VNNI CPU: prefixes [5, 24, 12, 24, 8, 5], 54% of
    # the tokens (docs/cpu/integer-kernels.md).  What must hold: every output starts the
    # same, and a fair share of the tokens agree before the first divergence.
    assert all(p >= 4 for p in prefixes)
    assert agreement >= 0.3
