"""``genserve-bench cpu --model FILE.gguf``: genserve against llama.cpp's ``llama-server`` on
the same GGUF file, both as servers on this machine (issue #28's real-size comparison).

    genserve-bench cpu --model model.Q4_0.gguf --streams 1,8 --new-tokens 64 \\
        --prefill 512,2048 --llama-cpp-bin /work/llamacpp/build/bin -- --cpu-int-dot on

For each server in turn (never both at once: they share the cores), or with ``--alternate``
both started (each while the other idles) and their runs alternated, one server at a time:

* start it on the file (genserve: ``genserve --model-id FILE`` plus the arguments after
  ``--``; llama.cpp: ``llama-server -m FILE -t THREADS -np PARALLEL``, continuous batching),
  and record the seconds until it answers its health check and its peak resident size
  (``VmHWM``) after start-up and after the run;
* decode: ``streams`` requests at once, each the same random token-id prompt
  (``--prompt-len``) per stream for both servers, greedy, exactly ``--new-tokens`` tokens
  (end-of-sequence ignored); the figure is the tokens all streams received per second over the
  window in which every stream was generating (from the last stream's first token to the
  first stream's last token), so neither prefill nor a straggler counts; the median over
  ``--repeats``;
* prefill: one request of ``--prefill`` prompt tokens and one new token; prompt tokens per
  second of time to first token (the prompt cache is off: nothing is reused).

``llama-bench -p N -n 0`` (llama.cpp's own prefill benchmark, no server) is reported beside.

Why ``--alternate``: on the 2-vCPU KVM guests this project measures on, the read bandwidth
switched between ~36 and ~64 GB/s from one minute to the next (docs/benchmarks/cpu.md, session
14), and a one-stream decode step is ~90% weight streaming, so a server measured for a minute
before the other could gain or lose ~20% on the minute alone.  Alternated, each genserve run
has a llama-server run seconds beside it (the order flips every repeat), and the table adds
the median and range of the ratios of those pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from genserve.bench import llama_cpp_repack
from genserve.bench.launch import LaunchedServer
from genserve.bench.stream_clients import Client, genserve_client, llama_client

_HOST = "127.0.0.1"
# Token ids drawn for prompts stay clear of special tokens at either end of a vocabulary.
_ID_RANGE = (1000, 30000)
# Between alternated runs: lets the last run's worker threads stop spinning (OpenMP's and
# llama.cpp's thread pools spin a while after their work) before the other server starts.
_SETTLE_S = 0.5

_T = TypeVar("_T")


@dataclass(slots=True)
class ServerResult:
    """One server's figures on one file."""

    server: str
    startup_s: float
    peak_rss_after_start_mib: float
    peak_rss_mib: float = 0.0
    decode_tok_s: dict[int, float] = field(default_factory=dict)  # streams -> median
    decode_runs: dict[int, list[float]] = field(default_factory=dict)
    prefill_tok_s: dict[int, float] = field(default_factory=dict)  # prompt tokens -> rate


@dataclass(slots=True)
class Running:
    """A started server: its figures so far, its client, its process id, and what to say when
    a request to it fails (None: let the error through)."""

    result: ServerResult
    one: Client
    pid: int
    failure: Callable[[Exception], str] | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


def vm_hwm_mib(pid: int) -> float:
    """Peak resident size of process ``pid`` in MiB (0 where /proc cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def decode_rate(token_times: Sequence[Sequence[float]]) -> float:
    """Tokens per second all streams received while every one of them was generating:
    from the last stream's first token to the first stream's last token."""
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    if end <= start:  # one token each, or streams that never overlapped
        raise ValueError("the streams never generated at the same time")
    inside = sum(1 for times in token_times for t in times if start < t <= end)
    return inside / (end - start)


def random_prompts(streams: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*_ID_RANGE) for _ in range(length)] for _ in range(streams)]


async def _wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {process.returncode}")
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise TimeoutError(f"llama-server not healthy after {timeout_s} s")


# ---------------------------------------------------------------------------- the runs
async def _guarded(server: Running, run: Awaitable[_T]) -> _T:
    try:
        return await run
    except httpx.HTTPError as error:
        if server.failure is None:
            raise
        raise RuntimeError(server.failure(error)) from error


async def _decode_run(server: Running, streams: int, rep: int, args: argparse.Namespace) -> None:
    prompts = random_prompts(streams, args.prompt_len, seed=rep)
    runs = await _guarded(
        server, asyncio.gather(*(server.one(p, args.new_tokens) for p in prompts))
    )
    rate = decode_rate(runs)
    result = server.result
    result.decode_runs.setdefault(streams, []).append(rate)
    print(f"  {result.server} x{streams} repeat {rep}: {rate:.1f} tok/s", flush=True)


async def _warm_up(server: Running) -> None:
    await _guarded(server, server.one(random_prompts(1, 8, seed=99)[0], 4))


async def _prefill_and_finish(server: Running, args: argparse.Namespace) -> None:
    result = server.result
    for streams, rates in result.decode_runs.items():
        result.decode_tok_s[streams] = statistics.median(rates)
    for length in args.prefill:
        prompt = random_prompts(1, length, seed=length)[0]
        start = time.perf_counter()
        times = await _guarded(server, server.one(prompt, 1))
        result.prefill_tok_s[length] = length / (times[0] - start)
        print(f"  {result.server} prefill {length}: {result.prefill_tok_s[length]:.1f} tok/s")
    result.peak_rss_mib = vm_hwm_mib(server.pid)


async def _measure(server: Running, args: argparse.Namespace) -> None:
    await _warm_up(server)
    for rep in range(args.repeats):
        for streams in args.streams:
            await _decode_run(server, streams, rep, args)
    await _prefill_and_finish(server, args)


async def run_alternated(
    model: Path, args: argparse.Namespace, log_dir: Path
) -> list[ServerResult]:
    """Every server of ``--servers`` started in turn (each start-up while the others idle),
    then each (repeat, streams) run on each server back to back, the order flipped every
    repeat, one server working at a time; prefill last, one server after the other."""
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(_STARTS[name](model, args, log_dir))
            for name in args.servers.split(",")
        ]
        for server in servers:
            await _warm_up(server)
        for rep in range(args.repeats):
            order = servers if rep % 2 == 0 else servers[::-1]
            for streams in args.streams:
                for server in order:
                    await asyncio.sleep(_SETTLE_S)
                    await _decode_run(server, streams, rep, args)
        for server in servers:
            await asyncio.sleep(_SETTLE_S)
            await _prefill_and_finish(server, args)
        return [server.result for server in servers]


def paired_ratios(a: ServerResult, b: ServerResult, streams: int) -> list[float]:
    """a's rate over b's for each repeat both ran (alternated runs: seconds apart)."""
    return [
        x / y
        for x, y in zip(
            a.decode_runs.get(streams, []), b.decode_runs.get(streams, []), strict=False
        )
        if y > 0
    ]


def _context_tokens(args: argparse.Namespace) -> int:
    lengths: list[int] = [args.prompt_len + args.new_tokens, *(n + 2 for n in args.prefill)]
    return max(lengths)


def slots(args: argparse.Namespace) -> int:
    """Requests each server must run at once, all at full length: ``--parallel`` or the most
    streams asked for.  With fewer, the extra streams of a 32-stream run waited for others to
    finish (llama-server's 8 default slots; genserve's default CPU KV cache, sized for 8
    full-length requests), and never generated together."""
    return int(max(args.parallel, *args.streams))


def genserve_args(model: Path, args: argparse.Namespace) -> list[str]:
    """genserve's command line arguments: the context, ``slots`` requests at once with a KV
    cache for all of them at full length (``--max-batch-size``), and the arguments after
    ``--``."""
    total = _context_tokens(args)
    return [
        "--model-id",
        str(model),
        "--max-total-tokens",
        str(total),
        "--max-input-tokens",
        str(total - 1),
        "--max-concurrent-requests",
        str(slots(args)),
        "--max-batch-size",
        str(slots(args)),
        *args.server_args,
    ]


@asynccontextmanager
async def started_genserve(
    model: Path, args: argparse.Namespace, log_dir: Path
) -> AsyncIterator[Running]:
    port = free_port()
    launched = LaunchedServer(
        genserve_args(model, args), _HOST, port, args.threads, log_dir / "genserve.log"
    )
    started = time.perf_counter()
    with launched:
        await launched.wait_healthy(args.startup_timeout)
        pid = launched.pid
        assert pid is not None
        result = ServerResult("genserve", time.perf_counter() - started, vm_hwm_mib(pid))
        yield Running(result, genserve_client(f"{_HOST}:{port}"), pid)


async def run_genserve(model: Path, args: argparse.Namespace, log_dir: Path) -> ServerResult:
    async with started_genserve(model, args, log_dir) as server:
        await _measure(server, args)
    return server.result


@asynccontextmanager
async def started_llama_server(
    model: Path, args: argparse.Namespace, log_dir: Path
) -> AsyncIterator[Running]:
    port = free_port()
    exe = args.llama_cpp_bin / "llama-server"
    command = [
        str(exe),
        "-m",
        str(model),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-np",
        str(slots(args)),
        "-c",
        str(slots(args) * _context_tokens(args)),
        "--cont-batching",
        *llama_cpp_repack.server_flags(getattr(args, "llamacpp_extra_bufts", None)),
        "--host",
        _HOST,
        "--port",
        str(port),
    ]
    started = time.perf_counter()
    log_path = log_dir / "llama-server.log"
    process = _spawn(command, log_path)
    try:
        url = f"http://{_HOST}:{port}"
        await _wait_http(url, process, args.startup_timeout)
        result = ServerResult(
            "llama-server", time.perf_counter() - started, vm_hwm_mib(process.pid)
        )
        yield Running(
            result,
            llama_client(url),
            process.pid,
            lambda error: request_failure(error, process, log_path),
        )
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


async def run_llama_server(model: Path, args: argparse.Namespace, log_dir: Path) -> ServerResult:
    async with started_llama_server(model, args, log_dir) as server:
        await _measure(server, args)
    return server.result


_STARTS = {"genserve": started_genserve, "llama-server": started_llama_server}


def request_failure(error: Exception, process: subprocess.Popen[bytes], log_path: Path) -> str:
    """What to say when a request to a spawned server failed: whether the server was still
    running at that moment (then the harness stops it, and a log ending in its shutdown
    message is the harness's doing, not the server's) or had exited by itself, and how."""
    code = process.poll()
    state = "was still running" if code is None else f"had exited by itself (code {code})"
    return f"request failed ({type(error).__name__}: {error}); the server {state}; log: {log_path}"


def _spawn(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` with its output in ``log_path`` (the child keeps the file open)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def llama_bench_prefill(model: Path, args: argparse.Namespace) -> dict[int, float]:
    """``llama-bench -p N -n 0``'s prompt tokens per second for each ``--prefill`` N."""
    if not args.prefill:
        return {}
    command = [
        str(args.llama_cpp_bin / "llama-bench"),
        "-m",
        str(model),
        "-t",
        str(args.threads),
        "-p",
        ",".join(str(n) for n in args.prefill),
        "-n",
        "0",
        "-r",
        "1",
        "-o",
        "json",
        *llama_cpp_repack.bench_flags(getattr(args, "llamacpp_extra_bufts", None)),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return {int(row["n_prompt"]): float(row["avg_ts"]) for row in json.loads(out)}


def format_table(
    model: Path,
    results: list[ServerResult],
    bench_pp: dict[int, float],
    alternated: bool = False,
) -> str:
    by = {r.server: r for r in results}
    g, ll = by.get("genserve"), by.get("llama-server")
    lines = [f"### {model.name} ({model.stat().st_size / 2**20:.0f} MiB)", ""]
    lines += ["| | genserve | llama-server | genserve / llama.cpp |", "|---|---|---|---|"]

    def row(label: str, a: float | None, b: float | None, fmt: str = "{:.1f}") -> None:
        ratio = f"{a / b:.2f}x" if a and b else ""
        cells = [fmt.format(v) if v is not None else "" for v in (a, b)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")

    streams = sorted({s for r in results for s in r.decode_tok_s})
    for s in streams:
        row(
            f"decode tok/s, {s} stream{'s' if s > 1 else ''}",
            g.decode_tok_s.get(s) if g else None,
            ll.decode_tok_s.get(s) if ll else None,
        )
    if alternated and g and ll:
        for s in streams:
            pairs = paired_ratios(g, ll, s)
            if pairs:
                spread = f"{statistics.median(pairs):.2f}x [{min(pairs):.2f}-{max(pairs):.2f}]"
                lines.append(
                    f"| decode, {s} stream{'s' if s > 1 else ''}: alternated pairs | | | {spread} |"
                )
    for n in sorted({n for r in results for n in r.prefill_tok_s}):
        row(
            f"prefill tok/s, {n}-token prompt (TTFT)",
            g.prefill_tok_s.get(n) if g else None,
            ll.prefill_tok_s.get(n) if ll else None,
        )
        if n in bench_pp:
            row(f"prefill tok/s, {n} (`llama-bench -p`)", None, bench_pp[n])
    for label, attr, fmt in (
        ("start-up s (to healthy)", "startup_s", "{:.1f}"),
        ("peak RSS MiB (start-up)", "peak_rss_after_start_mib", "{:.0f}"),
        ("peak RSS MiB (end)", "peak_rss_mib", "{:.0f}"),
    ):
        a = None if g is None else float(getattr(g, attr))
        b = None if ll is None else float(getattr(ll, attr))
        row(label, a, b, fmt)
    return "\n".join(lines)


def _server_list(text: str) -> str:
    names = text.split(",")
    unknown = [n for n in names if n not in _STARTS]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"servers are genserve and llama-server, once each: {text!r}"
        )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parallel",
        type=int,
        default=8,
        help="requests each server runs at once (llama-server -np; genserve --max-batch-size), "
        "at least the most --streams",
    )
    parser.add_argument(
        "--prefill",
        type=lambda t: [int(x) for x in t.split(",") if x.strip()],
        default=[512, 2048],
        help="prompt lengths for the prefill figures (empty: none)",
    )
    parser.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=Path(os.environ.get("LLAMA_CPP_BIN", "/work/llamacpp/build/bin")),
        help="directory with llama-server and llama-bench (env LLAMA_CPP_BIN)",
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--servers",
        default="genserve,llama-server",
        type=_server_list,
        help="which servers to run, in order (genserve, llama-server)",
    )
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="start every server, then alternate their decode runs (a machine whose speed "
        "drifts by the minute meets both alike; both models are in memory at once)",
    )


def run_servers(args: argparse.Namespace) -> dict[str, object]:
    """Every ``--model`` file through every server in ``--servers``; the JSON record."""
    out: dict[str, object] = {"load_average_before": os.getloadavg(), "files": []}
    out["llama_cpp_repack"] = getattr(args, "llamacpp_extra_bufts", None)
    tables = []
    for model in args.model:
        log_dir = args.out.parent / f"logs-{model.stem}"
        results = []
        if args.alternate:
            results = asyncio.run(run_alternated(model, args, log_dir))
        for server in [] if args.alternate else args.servers.split(","):
            run = run_genserve if server == "genserve" else run_llama_server
            results.append(asyncio.run(run(model, args, log_dir)))
        bench_pp = llama_bench_prefill(model, args) if "llama-server" in args.servers else {}
        tables.append(format_table(model, results, bench_pp, args.alternate))
        files = out["files"]
        assert isinstance(files, list)
        files.append(
            {
                "model": str(model),
                "bytes": model.stat().st_size,
                "results": [asdict(r) for r in results],
                "llama_bench_prefill_tok_s": bench_pp,
                "alternated": args.alternate,
                "load_average": os.getloadavg(),
            }
        )
        print(tables[-1], flush=True)
    out["load_average_after"] = os.getloadavg()
    out["tables"] = tables
    return out
