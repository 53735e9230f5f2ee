"""Fixtures for end-to-end tests: real servers on real gRPC ports, tiny real models, and one
``genserve`` process serving the embedded default model for the modules that compare it
with transformers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from genserve.model.loader import default_gguf_path
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.e2e.tp_utils import shard_args
from tests.utils.inproc_server import InProcessServer, inproc_server
from tests.utils.live_server import LiveServer, free_port, start_server


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: TinyModelFactory) -> Path:
    """The tiny Llama (seed 1) the client and deployment tests serve too: built once."""
    return tiny_model_factory("llama", seed=1)


@pytest.fixture(scope="session")
def two_shard_server(tiny_llama: Path) -> Iterator[LiveServer]:
    """A ``genserve --num-shard 2`` process (``PARITY_SERVER_ARGS``) on ``tiny_llama`` for the
    tests that only send it requests (test_tensor_parallel, test_sampling_params): a
    sharded start costs ~10 s of CPU.  Tests that signal or kill ranks start their own."""
    with start_server(tiny_llama, *PARITY_SERVER_ARGS, *shard_args(2)) as srv:
        yield srv


@pytest.fixture(scope="session")
def server(tiny_llama: Path) -> Iterator[InProcessServer]:
    """One in-process server (``PARITY_SERVER_ARGS``) for every module that uses ``stub`` or
    ``server`` without its own: a start costs seconds, and these modules only send requests
    (each test leaves no request running, which ``wait_all_blocks_free`` checks where it
    matters)."""
    with inproc_server(tiny_llama, *PARITY_SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: InProcessServer) -> Iterator[pb_grpc.TextGenerationServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TextGenerationServiceStub(channel)


# The default model's float32 server: its prompts and batches need more than the 4096
# tokens the launcher derives from the model's context.  Its Q4_1 blocks on the float path
# (--cpu-int-dot off; the integer kernels, the default, round activations to int8): the tests
# on it pin greedy output against transformers on the dequantized weights.
DEFAULT_MODEL_ARGS = (
    "--dtype",
    "float32",
    "--cpu-int-dot",
    "off",
    "--max-batch-total-tokens",
    "16384",
)


@dataclass(frozen=True)
class DefaultModelServer:
    """A ``genserve`` process on the embedded default model (``DEFAULT_MODEL_ARGS``) with
    Prometheus metrics on ``metrics_port``."""

    server: LiveServer
    metrics_port: int


def _default_model_server(*extra: str) -> Iterator[DefaultModelServer]:
    port = free_port()
    with start_server(
        str(default_gguf_path()), *DEFAULT_MODEL_ARGS, "--prometheus-port", str(port), *extra
    ) as srv:
        yield DefaultModelServer(srv, port)


@pytest.fixture(scope="session")
def default_model_server() -> Iterator[DefaultModelServer]:
    """Shared by test_chat_default_model, test_default_model (without speculation) and
    test_structured_output: starting the 135M model costs ~20 s of CPU.  Tests on it read
    counters as differences (other modules' requests count too)."""
    yield from _default_model_server()


@pytest.fixture(scope="session")
def default_model_speculate_server() -> Iterator[DefaultModelServer]:
    """The same with ``--speculate 4``: test_default_model and test_structured_output's
    speculation test.  Its draft counters only grow, whichever module runs first."""
    yield from _default_model_server("--speculate", "4")
