"""``genserve-bench cpu --model``: the decode-rate window and the argument checks (the servers
themselves run in the benchmark, not in the suite: a real-size model takes minutes), and the
llama.cpp client against a stand-in for llama-server's way of closing streamed connections."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from genserve.bench import cpu_compare, dist_compare, llama_cpp_repack
from genserve.bench.server_compare import (
    add_arguments,
    decode_rate,
    genserve_args,
    random_prompts,
    request_failure,
    slots,
)
from genserve.bench.stream_clients import llama_client
from genserve.config import load_config
from genserve.limits import kv_requests


def test_decode_rate_counts_only_the_window_all_streams_generate_in() -> None:
    # Stream a starts early (its lone early token is another stream's prefill time), b ends
    # late; the window is [1.0, 2.0]: a's tokens at 1.5 and 2.0, b's at 1.5 and 2.0.
    a = [0.2, 1.5, 2.0]
    b = [1.0, 1.5, 2.0, 3.0]
    assert decode_rate([a, b]) == pytest.approx(4 / 1.0)
    assert decode_rate([[0.0, 0.5, 1.0]]) == pytest.approx(2 / 1.0)
    with pytest.raises(ValueError, match="never generated at the same time"):
        decode_rate([[0.0, 1.0], [2.0, 3.0]])


def test_prompts_are_repeatable_and_sized() -> None:
    first = random_prompts(3, 40, seed=1)
    assert first == random_prompts(3, 40, seed=1) and first != random_prompts(3, 40, seed=2)
    assert [len(p) for p in first] == [40, 40, 40]


def test_model_files_must_exist(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        cpu_compare.main(["--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # server flags only make sense with --model
        cpu_compare.main(["--out", str(tmp_path), "--", "--cpu-int-dot", "on"])
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    with pytest.raises(SystemExit):  # a typo is refused, not run as llama-server
        cpu_compare.main(
            ["--model", str(model), "--servers", "genserve,llama", "--out", str(tmp_path)]
        )


def test_both_servers_get_a_slot_and_a_full_length_kv_for_every_stream(tmp_path: Path) -> None:
    # 32 streams once ran as waves of 8 (llama-server's -np 8, genserve's CPU KV default of 8
    # full-length requests): the window in which all generate was empty and the run failed.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])  # the server options; cpu_compare adds the run's own
    args.prompt_len, args.new_tokens, args.server_args = 40, 64, []
    model = tmp_path / "m.gguf"
    for streams, expected in (([1, 32], 32), ([1, 8], 8)):  # 32: `genserve-bench cpu`'s default
        args.streams = streams
        assert slots(args) == expected
        config = load_config(genserve_args(model, args), {})
        assert config.max_concurrent_requests == expected
        assert kv_requests(config, on_cuda=False) == expected


# ------------------------------------------------------------- llama-server's connections
def _event(tokens: list[int]) -> bytes:
    data = b"data: " + json.dumps({"tokens": tokens, "content": "x"}).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _fake_llama_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """What llama-server does on a streamed ``/completion``: a chunked reply that says
    Keep-Alive, then the socket is dropped.  Here it is dropped only once the client has sent
    its next request on it, which makes the client's side of that race deterministic."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            assert length is not None
            await reader.readexactly(int(length.group(1)))
            close = re.search(rb"(?i)\r\nconnection: *close", head) is not None
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                + (b"Connection: close\r\n" if close else b"Keep-Alive: timeout=5, max=100\r\n")
                + b"Transfer-Encoding: chunked\r\n\r\n"
                + _event([7])
                + _event([8, 9])
                + b"0\r\n\r\n"
            )
            await writer.drain()
            if close:
                break
            await reader.readuntil(b"\r\n\r\n")  # the next request: never answered
            break
    except asyncio.IncompleteReadError:
        pass
    writer.close()


def test_llama_client_survives_llama_servers_dropped_keep_alive_connections() -> None:
    async def run() -> tuple[list[int], type[BaseException] | None]:
        server = await asyncio.start_server(_fake_llama_server, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        async with server:
            one = llama_client(url)
            counts = [len(await one([1, 2, 3], 3)) for _ in range(3)]
            # The same requests on a pooled connection: the failure the benchmark met.
            failure: type[BaseException] | None = None
            async with httpx.AsyncClient() as pooled:
                try:
                    for _ in range(2):
                        reply = await pooled.post(f"{url}/completion", json={"stream": True})
                        reply.raise_for_status()
                except httpx.RemoteProtocolError as error:
                    failure = type(error)
        return counts, failure

    counts, failure = asyncio.run(run())
    assert counts == [3, 3, 3]  # one token, then two, per request
    assert failure is httpx.RemoteProtocolError


def test_request_failure_says_whether_the_server_was_running(tmp_path: Path) -> None:
    import subprocess
    import sys

    error = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert "was still running" in request_failure(error, alive, tmp_path / "log")
    finally:
        alive.kill()
        alive.wait()
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait()
    message = request_failure(error, gone, tmp_path / "log")
    assert "had exited by itself (code 3)" in message and "RemoteProtocolError" in message


# ------------------------------------------------------------------ --alternate's schedule
def test_alternated_runs_pair_each_repeat_and_flip_the_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_alternated`` starts every server first, then runs each (repeat, streams) on each
    server back to back with the order flipped every repeat, never two servers at once; the
    table's paired ratios are the per-repeat ratios.  The servers here are stand-ins whose
    clients emit tokens at a fixed rate (the real servers run in the benchmark)."""
    import argparse
    from contextlib import asynccontextmanager

    from genserve.bench import server_compare as sc

    events: list[tuple[str, str]] = []
    busy: list[str] = []

    def fake(name: str, rate: float):  # type: ignore[no-untyped-def]
        @asynccontextmanager
        async def start(model: Path, args: argparse.Namespace, log_dir: Path):  # type: ignore[no-untyped-def]
            events.append(("start", name))

            async def one(ids: list[int], new_tokens: int) -> list[float]:
                assert busy in ([], [name]), "two servers worked at once"
                busy.append(name)
                await asyncio.sleep(0)
                busy.remove(name)
                events.append(("run", name))
                return [i / rate for i in range(new_tokens)]

            yield sc.Running(sc.ServerResult(name, 1.0, 10.0), one, pid=0)

        return start

    monkeypatch.setattr(
        sc,
        "_STARTS",
        {"genserve": fake("genserve", 50.0), "llama-server": fake("llama-server", 40.0)},
    )
    monkeypatch.setattr(sc, "_SETTLE_S", 0.0)
    args = argparse.Namespace(
        servers="genserve,llama-server",
        repeats=3,
        streams=[1],
        prompt_len=4,
        new_tokens=8,
        prefill=[],
    )
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    results = asyncio.run(sc.run_alternated(model, args, tmp_path))
    runs = [name for kind, name in events if kind == "run"]
    assert events[:2] == [("start", "genserve"), ("start", "llama-server")]
    # warm-ups, then repeat 0 in order, repeat 1 flipped, repeat 2 in order
    assert runs == ["genserve", "llama-server"] * 2 + ["llama-server", "genserve"] + [
        "genserve",
        "llama-server",
    ]
    g, ll = results
    assert g.decode_tok_s[1] == pytest.approx(50.0) and ll.decode_tok_s[1] == pytest.approx(40.0)
    assert sc.paired_ratios(g, ll, 1) == pytest.approx([1.25] * 3)
    table = sc.format_table(model, results, {}, alternated=True)
    assert "| decode, 1 stream: alternated pairs | | | 1.25x [1.25-1.25] |" in table


def test_llama_cpp_repack_follows_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    # llama.cpp 0.3.36's AMX layouts segfault at start-up in KVM guests: on AMX CPUs the bench
    # turns them off for llama-server and llama-bench alike; unset, llama.cpp's default stays.
    assert llama_cpp_repack.server_flags(None) == []
    assert llama_cpp_repack.server_flags(False) == ["--no-repack"]
    assert llama_cpp_repack.bench_flags(False) == ["--repack", "0"]
    assert llama_cpp_repack.server_flags(True) == ["--repack"]
    assert llama_cpp_repack.bench_flags(True) == ["--repack", "1"]
    # quant-accuracy's llama-server (one slot) follows the CPU's default
    monkeypatch.setattr(llama_cpp_repack, "default_on", lambda: False)
    command = dist_compare.llama_server_command(Path("bin"), Path("m.gguf"), 8080, 2, 64)
    assert command[-1] == "--no-repack"
