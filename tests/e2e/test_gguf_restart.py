"""A GGUF model starts again from its cache: every start after the first reads what the first
one left (converted config/tokenizer, caches), and nothing it left can stop a start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from genserve.config import environment_cache
from genserve.testing.tiny_gguf import make_tiny_gguf
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.utils.inproc_server import inproc_server

PROMPT = "The capital of France is"


def fresh_cache(root: Path) -> Path:
    """An empty genserve cache for models that shares the machine's compiled CPU kernels
    (compiling them again would cost a minute per test, and is not what is tested)."""
    cache = root / "cache"
    cache.mkdir()
    kernels = environment_cache() / "kernels"  # $GENSERVE_CACHE's, where the tests build
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return cache


def _greedy(model: Path, cache: Path) -> list[int]:
    with (
        inproc_server(model, *PARITY_SERVER_ARGS, "--genserve-cache", str(cache)) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        params = pb.GenerateParameters(max_new_tokens=8, details=True)
        result = stub.Generate(pb.GenerateRequest(inputs=[PROMPT], parameters=params))
        return [t.id for t in result.results[0].details.tokens]


@pytest.mark.parametrize("preset", ["F32", "F16"])
def test_same_gguf_starts_twice(tmp_path: Path, preset: str) -> None:
    # A file with no Q8_0/Q4 matrix once left an invalid block cache that the weight reader
    # then took for model weights: the second start exited 1.
    model = make_tiny_gguf(tmp_path / f"tiny-{preset}.gguf", preset, seed=3)
    cache = fresh_cache(tmp_path)
    first = _greedy(model, cache)
    second = _greedy(model, cache)
    assert len(first) == 8
    assert second == first


def test_damaged_cache_file_beside_the_weights_is_not_read(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", seed=4)
    cache = fresh_cache(tmp_path)
    first = _greedy(model, cache)
    # What the old writer left for an empty block cache, and junk under other names.
    for entry in (cache / "models").iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            for f in entry.glob("gguf-blocks-*.safetensors"):
                f.write_bytes(b'{},"__metadata__":{}}')
            (entry / "gguf-blocks-0000000000000000.safetensors").write_bytes(b"\x08\x00garbage")
            (entry / "other.safetensors").write_bytes(b"not safetensors")
    assert _greedy(model, cache) == first


_CONVERT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from genserve.logging import configure_logging
    from genserve.model.loader import resolve_model

    configure_logging(json_output=True)  # what genserve --json-output does first
    resolve_model(sys.argv[1], cache_dir=Path(sys.argv[2]) / "models")
    """
)


def test_json_output_is_all_json_during_a_gguf_conversion(tmp_path: Path) -> None:
    # The start-up step that converts a GGUF genserve has never seen, as genserve runs it
    # with --json-output (logging configured first), in a process of its own.
    model = make_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", seed=6)
    cache = fresh_cache(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(model), str(cache)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=600,
    )
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
    names = [e.get("event") for e in events]
    # The conversion happened in this start, and its progress came as events.
    assert "model_conversion_started" in names and "model_conversion_done" in names
