"""``genserve-bench gguf-start``: start genserve (and ``llama-server``) on a real-shape Q4_K_M
GGUF and measure what a start costs: seconds to a healthy server, peak resident memory, and
the disk genserve's model cache gains (issue #28: "an 8B GGUF cannot load in 24 GB").

    genserve-bench gguf-start --shape llama-3.1-8b-shape --out DIR [-- GENSERVE ARGS]

The file is written straight from random K-quant blocks in llama.cpp's Q4_K_M mix
(:mod:`genserve.testing.kquant_gguf`: 4.9 GB for the 8B shape, a minute, no float model), or
``--file`` names an existing one.  Then, one server at a time:

* genserve, **first start**: a fresh model cache (``DIR/cache``, its ``kernels`` a link to
  the configured cache's, so the start is a model's first, not a compile's), so the start
  includes hashing the file and reading its config and tokenizer into the cache; **second
  start**: the same cache.  Each: seconds from spawn to a healthy ``Health``, ``VmHWM`` (peak
  resident) then, and after one greedy request of ``--new-tokens`` tokens (so every matrix has
  been read by a step); the KV cache the server took (``Info.kv_cache_bytes``);
* ``llama-server -m FILE -t THREADS -c CONTEXT -np 1``: the same two figures and request.

Both servers get the same context (``--max-total-tokens``) and one slot, so their KV caches
are alike (llama.cpp: f16, genserve: its dtype).  The figures go to ``DIR/gguf_start.json``
and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from genserve.bench.launch import LaunchedServer, split_server_args
from genserve.bench.server_compare import (
    _HOST,
    _spawn,
    _wait_http,
    free_port,
    random_prompts,
    vm_hwm_mib,
)
from genserve.bench.stream_clients import genserve_client, llama_client
from genserve.v1 import generate_pb2, generate_pb2_grpc

_MIB = 1 << 20


@dataclass(slots=True)
class StartResult:
    """One start of one server on the file."""

    server: str
    label: str  # "first start", "second start"
    startup_s: float
    peak_rss_start_mib: float
    peak_rss_after_request_mib: float
    request_s: float
    kv_cache_mib: float | None = None
    cache_added_mib: float | None = None


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            file = Path(root) / name
            if not file.is_symlink():
                total += file.stat().st_size
    return total


def fresh_cache(out: Path, configured: Path) -> Path:
    """An empty genserve cache under ``out`` whose ``kernels`` is ``configured``'s."""
    cache = out / "cache"
    if cache.exists():
        subprocess.run(["rm", "-rf", str(cache)], check=True)
    cache.mkdir(parents=True)
    (configured / "kernels").mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to((configured / "kernels").resolve())
    return cache


async def _kv_cache_mib(address: str) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        info = await stub.Info(generate_pb2.InfoRequest(), timeout=30)
    return int(info.kv_cache_bytes) / _MIB


async def start_genserve(
    model: Path, cache: Path, label: str, args: argparse.Namespace, log: Path
) -> StartResult:
    server_args = [
        "--model-id",
        str(model),
        "--genserve-cache",
        str(cache),
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--max-input-tokens",
        str(args.max_total_tokens - 1),
        "--max-concurrent-requests",
        "1",
        *args.server_args,
    ]
    before = dir_bytes(cache)
    launched = LaunchedServer(server_args, _HOST, free_port(), args.threads, log)
    started = time.perf_counter()
    with launched:
        await launched.wait_healthy(args.startup_timeout)
        startup = time.perf_counter() - started
        pid = launched.pid
        assert pid is not None
        rss_start = vm_hwm_mib(pid)
        kv = await _kv_cache_mib(launched.address)
        request_s = await _one_request(genserve_client(launched.address), args.new_tokens)
        rss_end = vm_hwm_mib(pid)
    added = (dir_bytes(cache) - before) / _MIB
    return StartResult("genserve", label, startup, rss_start, rss_end, request_s, kv, added)


async def start_llama_server(model: Path, label: str, args: argparse.Namespace) -> StartResult:
    port = free_port()
    command = [
        str(args.llama_cpp_bin / "llama-server"),
        "-m",
        str(model),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-c",
        str(args.max_total_tokens),
        "-np",
        "1",
        "--host",
        _HOST,
        "--port",
        str(port),
    ]
    started = time.perf_counter()
    process = _spawn(command, args.out / f"llama-server-{label.replace(' ', '-')}.log")
    try:
        url = f"http://{_HOST}:{port}"
        await _wait_http(url, process, args.startup_timeout)
        startup = time.perf_counter() - started
        rss_start = vm_hwm_mib(process.pid)
        request_s = await _one_request(llama_client(url), args.new_tokens)
        rss_end = vm_hwm_mib(process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    return StartResult("llama-server", label, startup, rss_start, rss_end, request_s)


async def _one_request(one: object, new_tokens: int) -> float:
    """Seconds for one greedy request of ``new_tokens`` tokens on a short random prompt."""
    assert callable(one)
    start = time.perf_counter()
    times = await one(random_prompts(1, 16, seed=7)[0], new_tokens)
    if len(times) < new_tokens:
        raise RuntimeError(f"the server streamed {len(times)} of {new_tokens} tokens")
    return time.perf_counter() - start


def format_table(model: Path, results: Sequence[StartResult]) -> str:
    size = model.stat().st_size / _MIB
    lines = [
        f"### {model.name} ({size:,.0f} MiB)",
        "",
        "| server | start | start-up s | peak RSS MiB at healthy | after a request | "
        "x file | KV cache MiB | model cache added MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        kv = "" if r.kv_cache_mib is None else f"{r.kv_cache_mib:,.0f}"
        added = "" if r.cache_added_mib is None else f"{r.cache_added_mib:,.1f}"
        lines.append(
            f"| {r.server} | {r.label} | {r.startup_s:.1f} | {r.peak_rss_start_mib:,.0f} | "
            f"{r.peak_rss_after_request_mib:,.0f} | {r.peak_rss_after_request_mib / size:.2f} | "
            f"{kv} | {added} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="genserve-bench gguf-start", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--shape", default="llama-3.1-8b-shape", help="kquant_gguf shape to write")
    p.add_argument("--file", type=Path, default=None, help="an existing GGUF instead")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (8B: Llama-3's 128256)")
    p.add_argument("--out", type=Path, required=True, help="results, logs, the fresh cache")
    p.add_argument("--servers", default="genserve,llama-server", help="which, in order")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-total-tokens", type=int, default=2048, help="context of both servers")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens of the one request")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument(
        "--genserve-cache",
        type=Path,
        default=Path(os.environ.get("GENSERVE_CACHE", Path.home() / ".cache" / "genserve")),
        help="the cache whose kernels the fresh one links to (env GENSERVE_CACHE)",
    )
    p.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=Path(os.environ.get("LLAMA_CPP_BIN", "/work/llamacpp/build/bin")),
        help="directory with llama-server (env LLAMA_CPP_BIN)",
    )
    return p


async def run(args: argparse.Namespace) -> dict[str, object]:
    """Every start in ``--servers`` on the file (written first unless ``--file``)."""
    from genserve.testing.kquant_gguf import write_q4_k_m_gguf

    args.out.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {"load_average_before": os.getloadavg()}
    model = args.file
    if model is None:
        model = args.out / f"{args.shape}.Q4_K_M.gguf"
        if not model.exists():
            started = time.perf_counter()
            write_q4_k_m_gguf(model, args.shape, args.vocab)
            record["write_s"] = time.perf_counter() - started
    results: list[StartResult] = []
    for server in args.servers.split(","):
        if server == "genserve":
            cache = fresh_cache(args.out, args.genserve_cache)
            for label in ("first start", "second start"):
                log = args.out / f"genserve-{label.replace(' ', '-')}.log"
                results.append(await start_genserve(model, cache, label, args, log))
                print(format_table(model, results[-1:]).splitlines()[-1], flush=True)
        elif server == "llama-server":
            for label in ("first start", "second start"):
                results.append(await start_llama_server(model, label, args))
                print(format_table(model, results[-1:]).splitlines()[-1], flush=True)
        else:
            raise ValueError(f"unknown server {server!r} (genserve, llama-server)")
    table = format_table(model, results)
    record |= {
        "model": str(model),
        "bytes": model.stat().st_size,
        "results": [asdict(r) for r in results],
        "load_average_after": os.getloadavg(),
        "table": table,
    }
    (args.out / "gguf_start.json").write_text(json.dumps(record, indent=2))
    return record


def main(argv: Sequence[str]) -> int:
    own, server_args = split_server_args(argv)
    args = build_parser().parse_args(own)
    args.server_args = server_args
    record = asyncio.run(run(args))
    print(record["table"])
    return 0
