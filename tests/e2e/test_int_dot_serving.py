"""``--cpu-int-dot`` served over gRPC.

* ``on`` with the kernels disabled cannot be honoured: the start is refused (exit 2, a line
  saying why), never silently served on the float path.
* The embedded default model (Q4_1 layers, a Q8_0 embedding) served with integer dot
  products against the same blocks on the float path: activations rounded to int8 per block
  of 32 change the logits a little, so the greedy tokens are compared for agreement (stated
  in docs/cpu/integer-kernels.md), not equality.
"""

from __future__ import annotations

import subprocess

import grpc
import pytest

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.model.loader import default_gguf_path
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.utils.live_server import free_port, genserve_command, start_server

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of each row of a matrix\n",
)
NEW_TOKENS = 24


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
