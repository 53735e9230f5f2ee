"""--engine-process (issue #29): the engine loop in a spawned child process, real gRPC.

- The same tokens and texts with the flag on as off: greedy and seeded sampling, stop
  strings, top tokens and prompt logprobs, streaming, Chat with n=2.
- A stream cancelled mid-generation is aborted in the engine: no KV block stays in use and
  the scheduler's invariants hold (asked of the child over the pipe).
- What is not carried across is refused: a grammar (UNIMPLEMENTED), a LoRA adapter
  (NOT_FOUND), --lora-adapters at launch (a ValueError naming both flags).
- kill -9 of the engine process: every in-flight call ends UNAVAILABLE, health turns
  NOT_SERVING, the server exits non-zero; kill -9 of the server: the child exits too.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from genserve.cli import check_engine_process
from genserve.config import load_config
from genserve.engine.process_engine import ProcessEngine
from genserve.kernels import cpu as cpu_kernels
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.utils.inproc_server import InProcessServer, inproc_server
from tests.utils.live_server import start_server

PROMPTS = ("The engine process streams", "a b c d e f", "东京 café")
NOT_SERVING = 2
# Batch-invariant kernels where they build: the two servers batch the same requests
# differently (arrival timing), and a seeded sample of the tiny random model flips on the
# last bits of a float32 logit that a different batch shape moves.
DETERMINISTIC = ("--deterministic",) if cpu_kernels.load() else ()
ARGS = (*PARITY_SERVER_ARGS, *DETERMINISTIC)


@pytest.fixture(scope="module")
def proc_server(tiny_llama: Path) -> Iterator[InProcessServer]:
    with inproc_server(tiny_llama, *ARGS, "--engine-process") as srv:
        yield srv


def _engine(server: InProcessServer) -> ProcessEngine:
    engine = server.service.engine
    assert isinstance(engine, ProcessEngine)
    return engine


def _calls(stub: pb_grpc.TextGenerationServiceStub) -> list[Any]:
    """Every kind of call the comparison makes, answers as comparable values."""
    out: list[Any] = []
    greedy = pb.GenerateParameters(max_new_tokens=24, details=True, top_n_tokens=2)
    seeded = pb.GenerateParameters(
        max_new_tokens=24, do_sample=True, temperature=1.3, seed=11, details=True
    )
    stopped = pb.GenerateParameters(max_new_tokens=40, stop=["e", "中"], details=True)
    logprobs = pb.GenerateParameters(max_new_tokens=6, decoder_input_details=True, details=True)
    for params in (greedy, seeded, stopped, logprobs):
        reply = stub.Generate(pb.GenerateRequest(inputs=list(PROMPTS), parameters=params))
        out.append(str(reply))
        stream = stub.GenerateStream(pb.GenerateStreamRequest(inputs=PROMPTS[0], parameters=params))
        out.append([(m.index, m.token.id, m.token.text, m.generated_text) for m in stream])
    chat = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="Say something")],
        parameters=pb.GenerateParameters(max_new_tokens=12, seed=5, temperature=0.9),
        n=2,
    )
    reply = stub.Chat(chat)
    out.append([(c.message.content, c.finish_reason) for c in reply.choices])
    return out


@pytest.mark.skipif(not DETERMINISTIC, reason="CPU kernels did not build (no --deterministic)")
def test_outputs_match_the_in_process_engine(
    tiny_llama: Path, proc_server: InProcessServer
) -> None:
    with inproc_server(tiny_llama, *ARGS) as server, grpc.insecure_channel(server.address) as ch:
        expected = _calls(pb_grpc.TextGenerationServiceStub(ch))
    with grpc.insecure_channel(proc_server.address) as channel:
        got = _calls(pb_grpc.TextGenerationServiceStub(channel))
    assert got == expected
    assert _engine(proc_server).num_steps > 0


def test_cancelled_stream_frees_everything(proc_server: InProcessServer) -> None:
    engine = _engine(proc_server)
    params = pb.GenerateParameters(max_new_tokens=400, ignore_eos=True)
    with grpc.insecure_channel(proc_server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        streams = [
            stub.GenerateStream(pb.GenerateStreamRequest(inputs=p, parameters=params))
            for p in PROMPTS
        ]
        for stream in streams:
            next(stream)
            next(stream)
        for stream in streams:
            stream.cancel()
    deadline = time.monotonic() + 10
    while True:
        stats = proc_server.run(engine.query("stats"))
        if (stats.num_used_blocks, stats.num_running) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
    proc_server.run(engine.query("check_invariants"))  # raises on a leak
    assert engine.num_in_flight == 0
    # What the Prometheus scrape reads (the stats the child sends) shows the freed blocks too.
    while proc_server.call(engine.scheduler_stats).num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc_server.call(engine.scheduler_stats).num_used_blocks == 0


def test_unsupported_features_are_refused(proc_server: InProcessServer) -> None:
    with grpc.insecure_channel(proc_server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        grammar = pb.GenerateParameters(max_new_tokens=4)
        grammar.grammar.json_object = True
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(pb.GenerateRequest(inputs=["x"], parameters=grammar))
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "--engine-process" in str(exc.value.details())
        adapter = pb.GenerateParameters(max_new_tokens=4, adapter_id="some-adapter")
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(pb.GenerateRequest(inputs=["x"], parameters=adapter))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        assert not stub.Info(pb.InfoRequest()).grammar_support


def test_launch_refuses_what_is_not_carried_across() -> None:
    config = load_config(["--engine-process", "--lora-adapters", "a=/x"])
    with pytest.raises(ValueError, match=r"--engine-process .*--lora-adapters"):
        check_engine_process(config)
    check_engine_process(load_config(["--engine-process"]))  # alone: fine


def _engine_children(pid: int) -> list[int]:
    """The server's spawned engine process (not multiprocessing's resource tracker)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                found.append(int(child))
    return found


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.split(")")[-1].split()[0] == "Z":  # exited, not yet reaped
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


def test_engine_process_killed_mid_generation(tiny_llama: Path) -> None:
    with start_server(tiny_llama, *PARITY_SERVER_ARGS, "--engine-process") as server:
        (child,) = _engine_children(server.proc.pid)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            params = pb.GenerateParameters(max_new_tokens=1000, ignore_eos=True)
            codes: list[grpc.StatusCode] = []
            started = threading.Barrier(len(PROMPTS) + 1)

            def stream(prompt: str) -> None:
                request = pb.GenerateStreamRequest(inputs=prompt, parameters=params)
                call = stub.GenerateStream(request)
                try:
                    next(call)
                    started.wait(30)
                    for _ in call:
                        pass
                except grpc.RpcError as exc:
                    codes.append(exc.code())

            threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS]
            for t in threads:
                t.start()
            started.wait(60)
            os.kill(child, signal.SIGKILL)
            for t in threads:
                t.join(15)
            assert codes == [grpc.StatusCode.UNAVAILABLE] * len(PROMPTS)
            assert server.health_status() == NOT_SERVING
        assert server.proc.wait(timeout=30) != 0
        assert "engine process exited" in server.logs()


def test_child_exits_with_the_server(tiny_llama: Path) -> None:
    with start_server(tiny_llama, *PARITY_SERVER_ARGS, "--engine-process") as server:
        (child,) = _engine_children(server.proc.pid)
        server.proc.kill()
        server.proc.wait(timeout=10)
        assert _gone(child, timeout_s=10), "the engine process outlived the server"
