"""What a newcomer meets in the first hour (issue #30), on real genserve processes: every
``--dtype`` serves on CPU, ``--json-output`` is JSON line by line (during a GGUF's conversion
too), the model cache converts a GGUF once whatever its file is called and cleans up after a
killed conversion, a second signal ends the drain at once, and start-up and request messages
name the real cause."""

from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from genserve.model import model_cache
from genserve.testing.tiny_gguf import make_tiny_gguf
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.e2e.test_gguf_restart import fresh_cache
from tests.utils.live_server import (
    LiveServer,
    ServerExited,
    free_port,
    genserve_command,
    start_server,
)

QUIET = ("--prometheus-port", "0")


def _generate(address: str, request: pb.GenerateRequest) -> pb.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        reply: pb.GenerateResponse = pb_grpc.TextGenerationServiceStub(channel).Generate(
            request, timeout=120
        )
        return reply


@pytest.mark.parametrize("source", ["plain-weights", "quantized-panels", "gguf-q4_1"])
def test_float16_serves_on_cpu(
    tiny_model_factory: TinyModelFactory, tmp_path: Path, source: str
) -> None:
    """float16 weights (matvec) and float16 activations into quantized panels or GGUF blocks
    (the default model is a Q4_1 GGUF) used to stop warm-up ("matvec: float32 or bfloat16
    weight", "qpanel_linear: float32 or bfloat16 x")."""
    model: Path = tiny_model_factory("llama", seed=2)
    extra: tuple[str, ...] = ()
    if source == "quantized-panels":
        extra = ("--quantize", "int8")
    elif source == "gguf-q4_1":
        model = make_tiny_gguf(tmp_path / "tiny-q4_1.gguf", "Q4_1", seed=2)
        extra = ("--genserve-cache", str(fresh_cache(tmp_path)))
    with start_server(model, "--dtype", "float16", *extra, *QUIET) as server:
        params = pb.GenerateParameters(max_new_tokens=8, details=True, ignore_eos=True)
        reply = _generate(server.address, pb.GenerateRequest(inputs=["Hello"], parameters=params))
        tokens = reply.results[0].details.tokens
        assert len(tokens) == 8
        assert all(-100.0 < t.logprob <= 0.0 for t in tokens)
        with grpc.insecure_channel(server.address) as channel:
            info = pb_grpc.TextGenerationServiceStub(channel).Info(pb.InfoRequest(), timeout=30)
        assert info.model_dtype == "float16"


def test_json_output_lines_all_parse(tiny_model_factory: TinyModelFactory) -> None:
    model = tiny_model_factory("llama", seed=2)
    with start_server(model, "--json-output", *QUIET) as server:
        params = pb.GenerateParameters(max_new_tokens=4)
        _generate(server.address, pb.GenerateRequest(inputs=["Hello"], parameters=params))
        assert server.stop(signal.SIGTERM) == 0
        lines = server.logs().splitlines()
    assert len(lines) > 5
    for line in lines:
        assert isinstance(json.loads(line), dict), line


# A conversion killed half-way: model_cache.build_once, the function every GGUF start converts
# through, with a build that writes part of a file and then hangs until SIGKILL.
_KILLED_CONVERSION = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from genserve.model import model_cache

    def build(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half a file")
        print("building", flush=True)
        time.sleep(600)

    model_cache.build_once(Path(sys.argv[1]), build, "killed.gguf")
    """
)


def _leave_a_killed_conversion(models: Path) -> list[Path]:
    """Run a conversion into ``models`` and SIGKILL it mid-build; return what it left."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CONVERSION, str(models / "gguf-0123456789abcdef")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout is not None
        assert any(line.strip() == "building" for line in proc.stdout), proc.wait()
    finally:
        proc.kill()
        proc.wait()
    left = [*(models / ".tmp").iterdir(), *(models / ".locks").iterdir()]
    assert {p.parent.name for p in left} == {".tmp", ".locks"}
    return left


@contextmanager
def _on_a_terminal(model: Path, tmp_path: Path, *args: str) -> Iterator[LiveServer]:
    """A genserve whose stdout and stderr are a terminal (a pty), as in an operator's shell,
    where progress bars are drawn; what the terminal shows is copied to a file, one line per
    newline (a redrawn bar stays one line with carriage returns in it)."""
    master, slave = pty.openpty()
    log_path = tmp_path / "terminal.log"
    port = free_port()
    cmd = [*genserve_command(), "--model-id", str(model), "--hostname", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    os.close(slave)

    def copy() -> None:
        with log_path.open("ab") as out:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the process closed the terminal
                    return
                if not data:
                    return
                out.write(data.replace(b"\r\n", b"\n"))
                out.flush()

    copier = threading.Thread(target=copy, daemon=True)
    copier.start()
    server = LiveServer(proc, port, log_path)
    try:
        server.wait_for(want_serving=True)
        yield server
    finally:
        server.stop()
        copier.join(10)
        os.close(master)


def _greedy_ids(address: str) -> list[int]:
    params = pb.GenerateParameters(max_new_tokens=6, details=True)
    reply = _generate(address, pb.GenerateRequest(inputs=["Hello there"], parameters=params))
    return [t.id for t in reply.results[0].details.tokens]


def test_gguf_first_start_json_lines_one_entry_and_cleanup(tmp_path: Path) -> None:
    """A GGUF's first start under --json-output, on a terminal (where bars would be drawn):
    the conversion's progress comes as JSON events (every line parses), the leftovers of a
    conversion killed earlier are removed, and the same file under another name then starts
    from that one entry without converting."""
    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", seed=5)
    cache = fresh_cache(tmp_path)
    models = cache / "models"
    leftovers = _leave_a_killed_conversion(models)
    cache_args = ("--genserve-cache", str(cache), *QUIET)
    with _on_a_terminal(gguf, tmp_path, "--json-output", *cache_args) as server:
        first = _greedy_ids(server.address)
        assert server.stop(signal.SIGTERM) == 0
        lines = server.logs().split("\n")
    events = [json.loads(line) for line in lines if line]
    assert all(isinstance(e, dict) for e in events)
    names = {e.get("event") for e in events}
    assert {"model_conversion_started", "model_conversion_done"} <= names, names
    assert "model_cache_cleaned" in names
    assert not [p for p in leftovers if p.exists()]

    renamed = tmp_path / "the-same-model-renamed.gguf"
    shutil.copyfile(gguf, renamed)
    with start_server(renamed, *cache_args) as server:
        assert _greedy_ids(server.address) == first
        assert "model_conversion_started" not in server.logs()
    (entry,) = model_cache.list_entries(models)
    assert set(entry.sources) == {str(gguf.resolve()), str(renamed.resolve())}


def test_second_signal_ends_the_drain_at_once(tiny_model_factory: TinyModelFactory) -> None:
    model = tiny_model_factory("llama", seed=2)
    with start_server(model, "--shutdown-timeout", "60", *QUIET) as server:
        started = threading.Event()
        outcome: list[grpc.StatusCode | None] = []

        def stream() -> None:
            params = pb.GenerateParameters(max_new_tokens=4000, ignore_eos=True)
            request = pb.GenerateStreamRequest(inputs="Hello", parameters=params)
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.TextGenerationServiceStub(channel)
                try:
                    for _ in stub.GenerateStream(request, timeout=120):
                        started.set()
                    outcome.append(None)
                except grpc.RpcError as exc:
                    outcome.append(exc.code())
                finally:
                    started.set()

        worker = threading.Thread(target=stream)
        worker.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None, "the first signal should drain, not exit"
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(60)
        elapsed = time.monotonic() - sent
        worker.join(60)
        logs = server.logs()
    # The stream was aborted, not drained: it would otherwise run its 4000 tokens (or the
    # 60 s --shutdown-timeout).  The exit itself (abort, 1 s gRPC grace, stop) takes about a
    # second idle and several on a loaded 2-core machine; 15 s is still far below the drain.
    assert outcome == [grpc.StatusCode.UNAVAILABLE]
    assert elapsed < 15.0, f"exited {elapsed:.2f}s after the second signal"
    assert "shutdown_drain_ended" in logs


def test_missing_tokenizer_fails_before_the_weights(
    tiny_model_factory: TinyModelFactory, tmp_path: Path
) -> None:
    source = tiny_model_factory("llama", seed=2)
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, model / name)
    with pytest.raises(ServerExited) as failed, start_server(model, *QUIET):
        pass
    message = str(failed.value)
    assert "has no tokenizer" in message and "tokenizer.json" in message
    assert "model_loaded" not in message


def test_lowered_limits_are_logged_and_cited(tiny_model_factory: TinyModelFactory) -> None:
    """--max-batch-total-tokens 10 (16 with the block rounding) lowers max_total_tokens to 16
    and max_input_tokens to 15: a warning names the flag, refusals cite it, and a prompt of
    exactly max_input_tokens is accepted while one more is told "at most"."""
    model = tiny_model_factory("llama", seed=2)
    with start_server(model, "--max-batch-total-tokens", "10", *QUIET) as server:
        assert "limits_lowered" in server.logs()
        assert "--max-batch-total-tokens=10" in server.logs()
        params = pb.GenerateParameters(max_new_tokens=1)
        fits = pb.GenerateRequest(input_ids=[pb.TokenIds(ids=[5] * 15)], parameters=params)
        assert len(_generate(server.address, fits).results) == 1
        too_long = pb.GenerateRequest(input_ids=[pb.TokenIds(ids=[5] * 16)], parameters=params)
        with pytest.raises(grpc.RpcError) as refused:
            _generate(server.address, too_long)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = str(refused.value.details())
    assert "at most 15 tokens" in details and "--max-batch-total-tokens=10" in details
    assert "--max-total-tokens" not in details


def test_max_total_tokens_of_one_blames_the_flag(tiny_model_factory: TinyModelFactory) -> None:
    model = tiny_model_factory("llama", seed=2)
    with (
        pytest.raises(ServerExited) as failed,
        start_server(model, "--max-total-tokens", "1", *QUIET),
    ):
        pass
    message = str(failed.value)
    assert "--max-total-tokens (1) leaves no room for a prompt" in message
    assert "KV cache" not in message


def test_a_directory_with_two_ggufs_names_them(tmp_path: Path) -> None:
    """It used to say the directory "holds no model weights this server can read"."""
    model = tmp_path / "two-ggufs"
    model.mkdir()
    for name, preset in (("tiny.Q4_0.gguf", "Q4_0"), ("tiny.Q8_0.gguf", "Q8_0")):
        make_tiny_gguf(model / name, preset, seed=2)
    cache_args = ("--genserve-cache", str(fresh_cache(tmp_path)))
    with pytest.raises(ServerExited) as failed, start_server(model, *cache_args, *QUIET):
        pass
    message = str(failed.value)
    assert "tiny.Q4_0.gguf, tiny.Q8_0.gguf" in message and "which one?" in message
    assert "no model weights" not in message
