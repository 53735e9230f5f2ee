"""Per-adapter Prometheus families (LoRA), read from the adapter manager at scrape time.

The manager's counters live on the event loop and only grow; a scrape reads a snapshot (a
copy of plain ints and floats), so no lock is needed for a consistent-enough view.  The
counters' record (:class:`AdapterStats`) and what a collector reads
(:class:`AdapterStatsSource`) are defined here, so this module needs nothing from the
engine's adapter manager, which fills them in."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


@dataclass(slots=True)
class AdapterStats:
    """Per adapter id, for metrics and Info."""

    requests: int = 0
    generated_tokens: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    evictions: int = 0


class AdapterStatsSource(Protocol):
    """The adapter manager as the collector sees it."""

    @property
    def stats(self) -> Mapping[str, AdapterStats]: ...

    @property
    def loaded(self) -> Sequence[str]:
        """Resident adapter ids."""
        ...


class AdapterCollector:
    def __init__(self, manager: AdapterStatsSource) -> None:
        self._manager = manager

    def collect(self) -> Iterator[Metric]:
        stats: Mapping[str, AdapterStats] = dict(self._manager.stats)
        families: list[tuple[str, str, Callable[[AdapterStats], float]]] = [
            ("genserve_lora_requests", "Requests per LoRA adapter", lambda s: s.requests),
            (
                "genserve_lora_generated_tokens",
                "Tokens generated per LoRA adapter (finished requests)",
                lambda s: s.generated_tokens,
            ),
            ("genserve_lora_loads", "Adapter reads and validations", lambda s: s.loads),
            (
                "genserve_lora_load_seconds",
                "Seconds spent reading and validating the adapter",
                lambda s: s.load_seconds,
            ),
            (
                "genserve_lora_evictions",
                "Times the adapter lost its slot to another (--max-active-adapters)",
                lambda s: s.evictions,
            ),
        ]
        for name, documentation, value in families:
            family = CounterMetricFamily(name, documentation, labels=["adapter_id"])
            for adapter_id, s in sorted(stats.items()):
                family.add_metric([adapter_id], value(s))
            yield family
        yield GaugeMetricFamily(
            "genserve_lora_active_adapters",
            "Adapters resident in runner slots",
            value=len(self._manager.loaded),
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())
