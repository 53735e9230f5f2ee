"""Prometheus metrics: TGI's request and batch families renamed ``genserve_*``, plus time to
first token, inter-token latency, KV-cache and prefix-cache figures, preemptions and
cancellations.

Everything lives in a :class:`Metrics` object with a registry of its own (never the process-wide
default registry), so several servers in one process (tests) do not collide.  Who records what:

* per gRPC call (``server.interceptors``): request count, success, failure by ``err``, duration;
* per sequence (``server.observe``): validation, queue, inference, time per token, TTFT,
  input length, generated tokens, max new tokens, cancellations;
* per engine step (``server.observe``): inter-token latency, step count and duration;
* at scrape time (:class:`SchedulerCollector`): batch size, queue size, KV blocks, prefix
  cache, preemptions — read on the engine's event loop, the only thread that owns the
  scheduler.

Threading: everything except :class:`LoopHistogram` may be updated from any thread.  A
LoopHistogram has a single writer (the event loop) and takes no lock, which is why it is used
for the one per-token figure, inter-token latency."""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

# Failure reasons (label ``err`` of genserve_request_failure, as TGI's tgi_request_failure).
FAILURE_REASONS: tuple[str, ...] = (
    "validation",
    "overloaded",
    "cancelled",
    "deadline",
    "internal",
    "unavailable",
)
CANCEL_REASONS: tuple[str, ...] = ("cancelled", "deadline")
STEP_KINDS: tuple[str, ...] = ("prefill", "decode", "mixed")

_REQUEST_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
_VALIDATION_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_TTFT_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 60)
_PER_TOKEN_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
_STEP_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10)
_TOKENS = tuple(float(2**i) for i in range(18))  # 1 .. 131072


class LoopHistogram:
    """A Prometheus histogram with one writer thread and no lock.

    :meth:`observe` must only be called from one thread (the engine's event loop); scrapes
    may read concurrently.  ``_count`` is derived from the bucket counts at scrape time, so
    count and buckets always agree; ``_sum`` may lag by the observation in progress."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self._bounds) + 1)  # the last slot is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def collect(self) -> Iterator[Metric]:
        counts = list(self._counts)  # one snapshot; the writer may go on meanwhile
        total = 0
        buckets: list[tuple[str, float]] = []
        for bound, num in zip((*self._bounds, float("inf")), counts, strict=True):
            total += num
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
        family = HistogramMetricFamily(self.name, self.documentation, unit="")
        family.add_metric([], buckets, sum_value=self._sum)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation)


class _StatsLike(Protocol):
    """What :class:`SchedulerCollector` reads (``genserve.engine.scheduler.SchedulerStats``)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def spec_draft_tokens(self) -> int: ...
    @property
    def spec_accepted_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _StatsSource:
    read: Callable[[], _StatsLike]
    loop: asyncio.AbstractEventLoop | None


class SchedulerCollector:
    """Batch, queue, KV-cache and prefix-cache figures, read from the scheduler at scrape time.

    Nothing is exported before :meth:`bind` (the model is still loading).  The read runs on
    the event loop that owns the scheduler (a scrape waits at most ``timeout_s`` for it); if
    the loop does not answer in time the read happens on the scraping thread instead, which
    may see a step half-applied but never blocks the scrape."""

    def __init__(self, timeout_s: float = 1.0) -> None:
        self._source: _StatsSource | None = None
        self._timeout_s = timeout_s

    def bind(
        self, read: Callable[[], _StatsLike], loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """``read`` returns the scheduler's stats; ``loop`` is the loop that owns it."""
        self._source = _StatsSource(read, loop)

    def _read(self, source: _StatsSource) -> _StatsLike:
        loop = source.loop
        if loop is None or loop.is_closed() or _runs_loop(loop):
            return source.read()
        future: concurrent.futures.Future[_StatsLike] = concurrent.futures.Future()

        def read_on_loop() -> None:
            try:
                future.set_result(source.read())
            except BaseException as exc:
                future.set_exception(exc)

        loop.call_soon_threadsafe(read_on_loop)
        try:
            return future.result(self._timeout_s)
        except concurrent.futures.TimeoutError:
            return source.read()

    def collect(self) -> Iterator[Metric]:
        source = self._source
        if source is None:
            return
        stats = self._read(source)
        yield _gauge(
            "genserve_batch_current_size", "Requests in the running batch", stats.num_running
        )
        yield _gauge("genserve_queue_size", "Requests waiting to be scheduled", stats.num_waiting)
        yield _gauge(
            "genserve_kv_cache_blocks_used",
            "KV-cache blocks held by requests",
            stats.num_used_blocks,
        )
        yield _gauge(
            "genserve_kv_cache_blocks_total", "KV-cache blocks in the pool", stats.num_total_blocks
        )
        yield _gauge(
            "genserve_kv_cache_usage_ratio", "Used / total KV-cache blocks", stats.kv_usage
        )
        yield _counter(
            "genserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            stats.prefix_cache_queries,
        )
        yield _counter(
            "genserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV was not recomputed)",
            stats.prefix_cache_hits,
        )
        queries = stats.prefix_cache_queries
        yield _gauge(
            "genserve_prefix_cache_hit_ratio",
            "Prefix-cache hits / queries (tokens) since start; 0 before the first query",
            stats.prefix_cache_hits / queries if queries else 0.0,
        )
        yield _counter(
            "genserve_preemptions",
            "Requests preempted (KV blocks taken back, recomputed later) since start",
            stats.num_preemptions,
        )
        yield _counter(
            "genserve_speculative_draft_tokens",
            "N-gram draft tokens verified (--speculate) since start",
            stats.spec_draft_tokens,
        )
        yield _counter(
            "genserve_speculative_accepted_tokens",
            "Draft tokens accepted: tokens generated beyond one per decode step",
            stats.spec_accepted_tokens,
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())  # values depend on bind(); describing nothing skips the check


def _runs_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class Metrics:
    """Every genserve metric, in :attr:`registry`.  See the module docstring for who records
    what; README.md ("Observability") maps each family to its TGI equivalent."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        # Per call (Generate / GenerateStream): TGI's request families.
        self.request_count = Counter(
            "genserve_request_count", "Generation calls received", registry=reg
        )
        self.request_success = Counter(
            "genserve_request_success", "Generation calls answered OK", registry=reg
        )
        self.request_failure = Counter(
            "genserve_request_failure",
            "Generation calls that failed, by reason",
            ["err"],
            registry=reg,
        )
        for reason in FAILURE_REASONS:
            self.request_failure.labels(reason)  # export zeros: rate() needs a first sample
        self.request_duration = Histogram(
            "genserve_request_duration",
            "End-to-end time of successful generation calls (seconds)",
            buckets=_REQUEST_S,
            registry=reg,
        )
        # Per sequence (one per prompt: a Generate call with n inputs has n sequences).
        self.validation_duration = Histogram(
            "genserve_request_validation_duration",
            "Validation and tokenization time per sequence (seconds)",
            buckets=_VALIDATION_S,
            registry=reg,
        )
        self.queue_duration = Histogram(
            "genserve_request_queue_duration",
            "Time from arrival at the engine to the first scheduled step (seconds)",
            buckets=_REQUEST_S,
            registry=reg,
        )
        self.inference_duration = Histogram(
            "genserve_request_inference_duration",
            "Time from the first scheduled step to the last token (seconds)",
            buckets=_REQUEST_S,
            registry=reg,
        )
        self.mean_time_per_token = Histogram(
            "genserve_request_mean_time_per_token_duration",
            "Inference duration / generated tokens, per sequence (seconds)",
            buckets=_PER_TOKEN_S,
            registry=reg,
        )
        self.time_to_first_token = Histogram(
            "genserve_request_time_to_first_token_duration",
            "Time from arrival at the engine to the first generated token (seconds)",
            buckets=_TTFT_S,
            registry=reg,
        )
        self.inter_token = LoopHistogram(
            "genserve_request_inter_token_duration",
            "Time between consecutive tokens of a sequence (seconds)",
            _PER_TOKEN_S,
        )
        reg.register(self.inter_token)
        self.input_length = Histogram(
            "genserve_request_input_length",
            "Prompt tokens per sequence",
            buckets=_TOKENS,
            registry=reg,
        )
        self.generated_tokens = Histogram(
            "genserve_request_generated_tokens",
            "Generated tokens per successful sequence",
            buckets=_TOKENS,
            registry=reg,
        )
        self.max_new_tokens = Histogram(
            "genserve_request_max_new_tokens",
            "max_new_tokens asked for per sequence",
            buckets=_TOKENS,
            registry=reg,
        )
        self.cancellations = Counter(
            "genserve_request_cancellations",
            "Sequences the engine aborted because the caller went away or its deadline passed",
            ["reason"],
            registry=reg,
        )
        for reason in CANCEL_REASONS:
            self.cancellations.labels(reason)
        # Per engine step.
        self.step_count = Counter(
            "genserve_batch_inference_count",
            "Engine steps (one forward pass each), by kind of step",
            ["method"],
            registry=reg,
        )
        self.step_duration = Histogram(
            "genserve_batch_inference_duration",
            "Engine step duration: forward, sampling and output processing (seconds)",
            ["method"],
            buckets=_STEP_S,
            registry=reg,
        )
        for kind in STEP_KINDS:
            self.step_count.labels(kind)
            self.step_duration.labels(kind)
        # At scrape time, once the engine exists.
        self.scheduler = SchedulerCollector()
        reg.register(self.scheduler)
        self._info: dict[str, str] = {}

    def set_info(self, **labels: str) -> None:
        """``genserve_info{model_id=..., ...} 1``: what this server runs (set once loaded)."""
        if self._info:
            return
        self._info = dict(labels)
        info = _InfoCollector(self._info)
        self.registry.register(info)


class _InfoCollector:
    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "genserve_info", "Model and server of this process", labels=list(self._labels)
        )
        family.add_metric(list(self._labels.values()), 1.0)
        yield family


class MetricsServer:
    """prometheus_client's HTTP server for ``/metrics`` in a daemon thread."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(metrics: Metrics, hostname: str, port: int) -> MetricsServer:
    """Serve ``metrics.registry`` at ``http://hostname:port/metrics``.  Raises OSError when
    the port is taken."""
    try:
        server, thread = start_http_server(port, addr=hostname, registry=metrics.registry)
    except OSError as exc:
        raise OSError(
            f"cannot serve metrics on {hostname}:{port} ({exc.strerror or exc}): choose another "
            "--prometheus-port, or 0 to turn the endpoint off"
        ) from exc
    return MetricsServer(server, thread)
