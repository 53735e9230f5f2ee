"""Fixtures for end-to-end tests: real servers on real gRPC ports, tiny real models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.utils.inproc_server import InProcessServer, inproc_server


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: TinyModelFactory) -> Path:
    """The tiny Llama (seed 1) the client and deployment tests serve too: built once."""
    return tiny_model_factory("llama", seed=1)


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
