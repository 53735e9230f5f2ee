"""genserve.metrics: a private registry with TGI's families renamed, the lock-free per-token
histogram, scheduler figures read at scrape time on the scheduler's own loop, the HTTP
endpoint."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scheduler_fakes import Harness  # type: ignore[import-not-found]  # pytest puts tests/unit on sys.path

from genserve.engine.request import Request, StoppingCriteria
from genserve.engine.scheduler import Scheduler, SchedulerStats
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.metrics import (
    FAILURE_REASONS,
    LoopHistogram,
    Metrics,
    start_metrics_server,
)
from genserve.step import SamplingParams

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(metrics: Metrics) -> Samples:
    return samples(generate_latest(metrics.registry).decode())


def test_registry_is_private_and_has_the_tgi_families() -> None:
    metrics = Metrics()
    got = scrape(metrics)
    names = {name for name, _ in got}
    for tgi in ("request_count", "request_success"):
        assert f"genserve_{tgi}_total" in names
    for tgi in (
        "request_duration",
        "request_validation_duration",
        "request_queue_duration",
        "request_inference_duration",
        "request_mean_time_per_token_duration",
        "request_input_length",
        "request_generated_tokens",
        "request_max_new_tokens",
        "request_time_to_first_token_duration",
        "request_inter_token_duration",
    ):
        assert f"genserve_{tgi}_count" in names, tgi
        assert f"genserve_{tgi}_bucket" in names, tgi
    # Every failure reason is exported from the start (rate() needs a first sample).
    for reason in FAILURE_REASONS:
        assert got[("genserve_request_failure_total", (("err", reason),))] == 0
    # Scheduler figures appear only once an engine is bound.
    assert "genserve_batch_current_size" not in names
    # Nothing leaks into prometheus_client's process-wide registry.
    global_names = {name for name, _ in samples(generate_latest(REGISTRY).decode())}
    assert not any(name.startswith("genserve_") for name in global_names)
    Metrics()  # a second server in the same process does not collide


def test_loop_histogram_counts_sum_and_buckets() -> None:
    metrics = Metrics()
    hist = metrics.inter_token
    values = [0.0005, 0.004, 0.004, 0.03, 7.0]
    for v in values:
        hist.observe(v)
    got = scrape(metrics)
    name = "genserve_request_inter_token_duration"
    assert got[(f"{name}_count", ())] == len(values) == hist.count
    assert got[(f"{name}_sum", ())] == pytest.approx(sum(values))
    assert got[(f"{name}_bucket", (("le", "0.001"),))] == 1
    assert got[(f"{name}_bucket", (("le", "0.005"),))] == 3
    assert got[(f"{name}_bucket", (("le", "0.03"),))] == 4  # le is inclusive
    assert got[(f"{name}_bucket", (("le", "2.5"),))] == 4
    assert got[(f"{name}_bucket", (("le", "+Inf"),))] == 5


def test_loop_histogram_alone() -> None:
    hist = LoopHistogram("x_seconds", "doc", [1.0, 2.0])
    hist.observe(1.5)
    (family,) = list(hist.collect())
    by_name = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert by_name[("x_seconds_bucket", "1.0")] == 0
    assert by_name[("x_seconds_bucket", "2.0")] == 1
    assert by_name[("x_seconds_count", None)] == 1


def _request(req_id: str, num_prompt: int) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(range(1, num_prompt + 1)),
        sampling=SamplingParams(),
        stopping=StoppingCriteria(max_new_tokens=4),
    )


def _busy_scheduler() -> Scheduler:
    """Two running requests (10 and 5 prompt tokens, blocks of 4) and one waiting."""
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_num_running=2))
    for i, n in enumerate((10, 5, 3)):
        sched.add_request(_request(f"r{i}", n))
    step = sched.schedule()
    assert len(step.chunks) == 2
    return sched


def test_scheduler_figures_at_scrape_time() -> None:
    metrics = Metrics()
    sched = _busy_scheduler()
    metrics.scheduler.bind(sched.stats)
    got = scrape(metrics)
    assert got[("genserve_batch_current_size", ())] == 2
    assert got[("genserve_queue_size", ())] == 1
    assert got[("genserve_kv_cache_blocks_total", ())] == 16
    assert got[("genserve_kv_cache_blocks_used", ())] == 3 + 2  # ceil(10/4) + ceil(5/4)
    assert got[("genserve_kv_cache_usage_ratio", ())] == pytest.approx(5 / 16)
    assert got[("genserve_preemptions_total", ())] == 0
    stats = sched.stats()
    assert got[("genserve_prefix_cache_queries_total", ())] == stats.prefix_cache_queries
    assert got[("genserve_prefix_cache_hits_total", ())] == stats.prefix_cache_hits


@pytest.fixture
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_scheduler_is_read_on_its_own_loop(loop_thread: asyncio.AbstractEventLoop) -> None:
    """The scrape thread never touches the scheduler: the read hops onto the engine's loop."""
    metrics = Metrics()
    sched = _busy_scheduler()
    readers: list[int] = []

    def read() -> SchedulerStats:
        readers.append(threading.get_ident())
        return sched.stats()

    metrics.scheduler.bind(read, loop_thread)
    got = scrape(metrics)
    assert got[("genserve_batch_current_size", ())] == 2
    loop_ident = asyncio.run_coroutine_threadsafe(_ident(), loop_thread).result(5)
    assert readers == [loop_ident] != [threading.get_ident()]


async def _ident() -> int:
    return threading.get_ident()


def test_prefix_hit_ratio_follows_the_scheduler() -> None:
    metrics = Metrics()
    harness = Harness(SchedulerConfig(num_blocks=16, block_size=4))
    metrics.scheduler.bind(harness.sched.stats)
    prompt = list(range(1, 10))  # 9 tokens: two full blocks can be reused
    harness.add("a", prompt, max_new_tokens=2)
    harness.run()
    assert scrape(metrics)[("genserve_prefix_cache_hits_total", ())] == 0
    harness.add("b", prompt, max_new_tokens=2)
    harness.run()
    got = scrape(metrics)
    stats = harness.sched.stats()
    assert stats.prefix_cache_hits == 8 == got[("genserve_prefix_cache_hits_total", ())]
    assert got[("genserve_prefix_cache_queries_total", ())] == stats.prefix_cache_queries
    assert got[("genserve_prefix_cache_hit_ratio", ())] == pytest.approx(
        stats.prefix_cache_hits / stats.prefix_cache_queries
    )


def test_http_endpoint_serves_the_registry() -> None:
    metrics = Metrics()
    metrics.request_count.inc(3)
    metrics.set_info(model_id="m", dtype="float32", device="cpu", version="0")
    server = start_metrics_server(metrics, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert r.status == 200
            got = samples(r.read().decode())
    finally:
        server.stop()
    assert got[("genserve_request_count_total", ())] == 3
    info = (("device", "cpu"), ("dtype", "float32"), ("model_id", "m"), ("version", "0"))
    assert got[("genserve_info", info)] == 1
