"""What a newcomer meets in the first hour (issue #30), on real genserve processes: every
``--dtype`` serves on CPU, ``--json-output`` is JSON line by line, a second signal ends the
drain at once, and start-up and request messages name the real cause."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.utils.live_server import ServerExited, start_server

QUIET = ("--prometheus-port", "0")


def _generate(address: str, request: pb.GenerateRequest) -> pb.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        reply: pb.GenerateResponse = pb_grpc.TextGenerationServiceStub(channel).Generate(
            request, timeout=120
        )
        return reply


@pytest.mark.parametrize(
    "extra", [(), ("--quantize", "int8")], ids=["plain-weights", "quantized-panels"]
)
def test_float16_serves_on_cpu(
    tiny_model_factory: TinyModelFactory, extra: tuple[str, ...]
) -> None:
    """float16 weights (matvec) and float16 activations into quantized panels used to stop
    warm-up ("matvec: float32 or bfloat16 weight", "qpanel_linear: float32 or bfloat16 x")."""
    model = tiny_model_factory("llama", seed=2)
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
        server.proc.wait(10)
        elapsed = time.monotonic() - sent
        worker.join(10)
        logs = server.logs()
    assert elapsed < 1.0, f"exited {elapsed:.2f}s after the second signal"
    assert outcome == [grpc.StatusCode.UNAVAILABLE]
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
