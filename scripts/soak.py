"""Soak test (not a CI test): N minutes of mixed load against one genserve — normal unary and
streaming calls, clients that cancel mid-stream, calls with deadlines too short to finish, and
bursts above --max-concurrent-requests — then compares the server process's RSS, threads, open
file descriptors and KV blocks at the start (after a warm-up) and at the end.  Exits 1 on
growth beyond the tolerances, 0 otherwise.

    bash scripts/soak.sh --minutes 10                 # tiny random model (fast, default)
    bash scripts/soak.sh --minutes 10 --model-id ""   # the embedded SmolLM2-135M"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from genserve.v1 import generate_pb2 as pb  # noqa: E402
from genserve.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402
from tests.utils.live_server import free_port, start_server  # noqa: E402

MAX_CONCURRENT = 8
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Hello " * 30]


def sample(pid: int, metrics_port: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = {line.split(":")[0]: line.split(":")[1].split() for line in status}
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        metrics = {
            line.split()[0]: float(line.split()[1])
            for line in r.read().decode().splitlines()
            if line.startswith("genserve_kv_cache_blocks_")
        }
    return {
        "rss_mib": int(fields["VmRSS"][0]) / 1024,
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "kv_blocks_used": metrics["genserve_kv_cache_blocks_used"],
        "kv_blocks_total": metrics["genserve_kv_cache_blocks_total"],
    }


def worker(address: str, stop_at: float, rng: random.Random, outcomes: collections.Counter[str],
           lock: threading.Lock) -> None:  # fmt: skip
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        while time.monotonic() < stop_at:
            kind = rng.choice(["unary", "stream", "cancel", "deadline", "stream"])
            params = pb.GenerateParameters(max_new_tokens=rng.randint(1, 48))
            prompt = rng.choice(PROMPTS)
            try:
                if kind == "unary":
                    stub.Generate(
                        pb.GenerateRequest(inputs=[prompt], parameters=params), timeout=120
                    )
                elif kind == "stream":
                    request = pb.GenerateStreamRequest(inputs=prompt, parameters=params)
                    for _ in stub.GenerateStream(request, timeout=120):
                        pass
                elif kind == "cancel":
                    request = pb.GenerateStreamRequest(inputs=prompt, parameters=params)
                    call = stub.GenerateStream(request, timeout=120)
                    for _, _msg in zip(range(rng.randint(1, 4)), call, strict=False):
                        pass
                    call.cancel()
                else:
                    request = pb.GenerateStreamRequest(inputs=prompt, parameters=params)
                    for _ in stub.GenerateStream(request, timeout=rng.uniform(0.01, 0.5)):
                        pass
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                outcomes[f"{kind}:{code}"] += 1
            if code == "RESOURCE_EXHAUSTED":
                time.sleep(rng.uniform(0.05, 0.3))  # back off, as a client library would


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=12, help="above --max-concurrent-requests 8")
    parser.add_argument("--model-id", default=None, help='"" for the embedded default model')
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    parser.add_argument("--max-thread-growth", type=int, default=4)
    parser.add_argument("--max-fd-growth", type=int, default=8)
    args = parser.parse_args()
    if args.model_id is None:
        from genserve.testing.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="soak-")), arch="llama", seed=1))
    elif args.model_id == "":
        from genserve.model.loader import default_gguf_path

        model = str(default_gguf_path())
    else:
        model = args.model_id
    metrics_port = free_port()
    server_args = ["--prometheus-port", str(metrics_port),
                   "--max-concurrent-requests", str(MAX_CONCURRENT)]  # fmt: skip
    with start_server(model, *server_args) as server:
        pid = server.proc.pid
        warm = time.monotonic() + min(30.0, args.minutes * 6)  # 10 % of the run, at most 30 s
        outcomes: collections.Counter[str] = collections.Counter()
        lock = threading.Lock()
        stop_at = time.monotonic() + args.minutes * 60
        threads = [
            threading.Thread(target=worker, args=(server.address, stop_at, random.Random(i),
                                                  outcomes, lock), daemon=True)
            for i in range(args.clients)
        ]  # fmt: skip
        for t in threads:
            t.start()
        time.sleep(max(0.0, warm - time.monotonic()))
        start = sample(pid, metrics_port)
        for t in threads:
            t.join(args.minutes * 60 + 300)
        time.sleep(2)  # let the last cancellations land
        end = sample(pid, metrics_port)
    print(f"soak: {args.minutes} min, {args.clients} clients, {sum(outcomes.values())} calls")
    for key, count in sorted(outcomes.items()):
        print(f"  {key:32s} {count}")
    print(f"  {'':14s} {'start':>10s} {'end':>10s}")
    for key in start:
        print(f"  {key:14s} {start[key]:10.1f} {end[key]:10.1f}")
    failures = []
    if end["rss_mib"] - start["rss_mib"] > args.max_rss_growth_mib:
        failures.append(f"RSS grew {end['rss_mib'] - start['rss_mib']:.1f} MiB")
    if end["threads"] - start["threads"] > args.max_thread_growth:
        failures.append(f"threads grew {end['threads'] - start['threads']:.0f}")
    if end["fds"] - start["fds"] > args.max_fd_growth:
        failures.append(f"fds grew {end['fds'] - start['fds']:.0f}")
    if end["kv_blocks_used"] != 0:
        failures.append(f"{end['kv_blocks_used']:.0f} KV blocks still used")
    bad = {
        k: v
        for k, v in outcomes.items()
        if k.split(":")[1] in ("UNKNOWN", "INTERNAL", "UNAVAILABLE")
    }
    if bad:
        failures.append(f"unexpected statuses {bad}")
    print("soak: FAIL: " + "; ".join(failures) if failures else "soak: PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
