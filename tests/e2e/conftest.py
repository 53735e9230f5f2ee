"""Fixtures for end-to-end tests: real servers on real gRPC ports, tiny real models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from genserve.testing.tiny_model import make_tiny_model
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.utils.inproc_server import InProcessServer, inproc_server


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=1)


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[InProcessServer]:
    with inproc_server(tiny_llama, *PARITY_SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: InProcessServer) -> Iterator[pb_grpc.TextGenerationServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TextGenerationServiceStub(channel)
