"""--engine-process (issue #29): the engine loop in a spawned child process, real gRPC.

- The same tokens and texts with the flag on as off: greedy and seeded sampling, stop
  strings, top tokens and prompt logprobs, streaming, Chat with n=2, a JSON-schema and a
  regex request, a LoRA request (--lora-adapters), and all of them in one batch.
- A stream cancelled mid-generation (a constrained one among them) is aborted in the
  engine: no KV block stays in use and the scheduler's invariants hold (asked of the child
  over the pipe).
- Errors are answered by the front as without the flag: a bad schema INVALID_ARGUMENT, an
  unknown adapter NOT_FOUND; Info says grammars are supported and lists the adapters.
- Tensor parallelism: tests/e2e/test_engine_process_tensor_parallel.py.
- kill -9 of the engine process: every in-flight call ends UNAVAILABLE, health turns
  NOT_SERVING, the server exits non-zero; kill -9 of the server: the child exits too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from genserve.engine.process_engine import ProcessEngine
from genserve.kernels import cpu as cpu_kernels
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.e2e.tp_utils import engine_children
from tests.utils.inproc_server import InProcessServer, inproc_server
from tests.utils.live_server import start_server

PROMPTS = ("The engine process streams", "a b c d e f", "东京 café")
NOT_SERVING = 2
# Batch-invariant kernels where they build: the two servers batch the same requests
# differently (arrival timing), and a seeded sample of the tiny random model flips on the
# last bits of a float32 logit that a different batch shape moves.
DETERMINISTIC = ("--deterministic",) if cpu_kernels.load() else ()
ARGS = (*PARITY_SERVER_ARGS, *DETERMINISTIC)
HAS_PEFT = importlib.util.find_spec("peft") is not None
ADAPTER = "qv4"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [a-z ]{1,40}\."


@pytest.fixture(scope="module")
def served_args(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """The flags both servers get: with peft, one PEFT adapter preloaded."""
    if not HAS_PEFT:
        return ARGS
    from genserve.testing.tiny_lora import make_lora_adapter

    adapter = make_lora_adapter(tiny_llama, tmp_path_factory.mktemp(ADAPTER), rank=4, seed=3)
    return (*ARGS, "--lora-adapters", f"{ADAPTER}={adapter}")


@pytest.fixture(scope="module")
def proc_server(tiny_llama: Path, served_args: tuple[str, ...]) -> Iterator[InProcessServer]:
    with inproc_server(tiny_llama, *served_args, "--engine-process") as srv:
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
    out.extend(_constrained_calls(stub))
    return out


def _json_params(max_new: int = 40) -> pb.GenerateParameters:
    params = pb.GenerateParameters(max_new_tokens=max_new, details=True, top_n_tokens=2)
    params.grammar.json_schema = json.dumps(SCHEMA)
    return params


def _regex_params(seed: int | None = None) -> pb.GenerateParameters:
    params = pb.GenerateParameters(max_new_tokens=30, details=True)
    if seed is not None:
        params.do_sample, params.seed, params.temperature = True, seed, 1.2
    params.grammar.regex = REGEX
    return params


def _lora_params(regex: bool = False) -> pb.GenerateParameters:
    params = _regex_params() if regex else pb.GenerateParameters(max_new_tokens=20, details=True)
    params.adapter_id = ADAPTER
    return params


def _constrained_calls(stub: pb_grpc.TextGenerationServiceStub) -> list[Any]:
    """Grammars and the adapter, alone and then all in flight at once (one batch)."""
    jobs = [(PROMPTS[0], _json_params()), (PROMPTS[1], _regex_params())]
    jobs.append((PROMPTS[2], _regex_params(seed=7)))
    if HAS_PEFT:
        jobs += [(PROMPTS[0], _lora_params()), (PROMPTS[1], _lora_params(regex=True))]
    jobs.append((PROMPTS[2], pb.GenerateParameters(max_new_tokens=20, details=True)))

    def run(job: tuple[str, pb.GenerateParameters]) -> str:
        reply = stub.Generate(pb.GenerateRequest(inputs=[job[0]], parameters=job[1]))
        return str(reply)

    alone = [run(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    stream = stub.GenerateStream(
        pb.GenerateStreamRequest(inputs=PROMPTS[1], parameters=_json_params())
    )
    streamed = [(m.token.id, m.token.text, m.generated_text) for m in stream]
    return [alone, together, streamed]


@pytest.mark.skipif(not DETERMINISTIC, reason="CPU kernels did not build (no --deterministic)")
def test_outputs_match_the_in_process_engine(
    tiny_llama: Path, served_args: tuple[str, ...], proc_server: InProcessServer
) -> None:
    with (
        inproc_server(tiny_llama, *served_args) as server,
        grpc.insecure_channel(server.address) as ch,
    ):
        expected = _calls(pb_grpc.TextGenerationServiceStub(ch))
    with grpc.insecure_channel(proc_server.address) as channel:
        got = _calls(pb_grpc.TextGenerationServiceStub(channel))
    assert got == expected
    assert _engine(proc_server).num_steps > 0
    with grpc.insecure_channel(proc_server.address) as channel:  # a complete one parses
        stub = pb_grpc.TextGenerationServiceStub(channel)
        reply = stub.Generate(pb.GenerateRequest(inputs=[PROMPTS[0]], parameters=_json_params()))
    result = reply.results[0]
    if result.details.finish_reason == pb.FINISH_REASON_EOS_TOKEN:
        assert set(json.loads(result.generated_text)) == {"name", "n", "ok"}
    else:
        assert result.generated_text.startswith('{"name"')


@pytest.mark.skipif(not DETERMINISTIC, reason="CPU kernels did not build (no --deterministic)")
def test_grammars_with_speculation_and_overlap_match(
    tiny_llama: Path, served_args: tuple[str, ...]
) -> None:
    """With --speculate (constrained rows get no drafts, others do) and overlapped scheduling
    (a constrained row's next step is scheduled after its token is applied), the engine
    process answers as one process does."""
    extra = ("--speculate", "3", "--overlap-scheduling")
    repetitive = pb.GenerateRequest(
        inputs=["one two three one two three one two three one two"],
        parameters=pb.GenerateParameters(max_new_tokens=24, details=True),
    )
    replies = []
    for flags in ((), ("--engine-process",)):
        with (
            inproc_server(tiny_llama, *served_args, *extra, *flags) as server,
            grpc.insecure_channel(server.address) as channel,
        ):
            stub = pb_grpc.TextGenerationServiceStub(channel)
            replies.append([_constrained_calls(stub), str(stub.Generate(repetitive))])
    assert replies[0] == replies[1]


def test_cancelled_stream_frees_everything(proc_server: InProcessServer) -> None:
    engine = _engine(proc_server)
    params = pb.GenerateParameters(max_new_tokens=400, ignore_eos=True)
    constrained = pb.GenerateParameters(max_new_tokens=400, ignore_eos=True)
    constrained.grammar.regex = "[a-z ]{1,1000}"  # still open after 400 tokens
    with grpc.insecure_channel(proc_server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        streams = [
            stub.GenerateStream(pb.GenerateStreamRequest(inputs=p, parameters=params))
            for p in PROMPTS
        ]
        streams.append(
            stub.GenerateStream(pb.GenerateStreamRequest(inputs=PROMPTS[0], parameters=constrained))
        )
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


def test_errors_are_answered_as_without_the_flag(proc_server: InProcessServer) -> None:
    with grpc.insecure_channel(proc_server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        bad = pb.GenerateParameters(max_new_tokens=4)
        bad.grammar.json_schema = '{"type": "object", "properties": {"a": {"type": 7}}}'
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(pb.GenerateRequest(inputs=["x"], parameters=bad))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        not_json = pb.GenerateParameters(max_new_tokens=4)
        not_json.grammar.json_schema = "{not json"
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(pb.GenerateRequest(inputs=["x"], parameters=not_json))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not valid JSON" in str(exc.value.details())
        adapter = pb.GenerateParameters(max_new_tokens=4, adapter_id="no-such-adapter")
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(pb.GenerateRequest(inputs=["x"], parameters=adapter))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        info = stub.Info(pb.InfoRequest())
        assert info.grammar_support
        if HAS_PEFT:  # the adapter is applied (its greedy tokens differ) and listed
            base = pb.GenerateParameters(max_new_tokens=20)
            plain = stub.Generate(pb.GenerateRequest(inputs=[PROMPTS[0]], parameters=base))
            lora = stub.Generate(pb.GenerateRequest(inputs=[PROMPTS[0]], parameters=_lora_params()))
            assert lora.results[0].generated_text != plain.results[0].generated_text
            assert ADAPTER in stub.Info(pb.InfoRequest()).loaded_adapters
        # The server still serves after all of them.
        ok = stub.Generate(pb.GenerateRequest(inputs=["x"], parameters=_regex_params()))
        result = ok.results[0]
        if result.details.finish_reason == pb.FINISH_REASON_EOS_TOKEN:
            assert re.fullmatch(REGEX, result.generated_text)
        else:  # cut by max_new_tokens: a prefix of a match
            assert re.match(r"(yes|no)", result.generated_text)
    assert _engine(proc_server).num_in_flight == 0


def test_disabled_grammar_support_is_refused_as_without_the_flag(tiny_llama: Path) -> None:
    with (
        inproc_server(tiny_llama, *ARGS, "--engine-process", "--disable-grammar-support") as srv,
        grpc.insecure_channel(srv.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        assert not stub.Info(pb.InfoRequest()).grammar_support
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(pb.GenerateRequest(inputs=["x"], parameters=_regex_params()))
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "--disable-grammar-support" in str(exc.value.details())


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
        (child,) = engine_children(server.proc.pid)
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
        (child,) = engine_children(server.proc.pid)
        server.proc.kill()
        server.proc.wait(timeout=10)
        assert _gone(child, timeout_s=10), "the engine process outlived the server"
