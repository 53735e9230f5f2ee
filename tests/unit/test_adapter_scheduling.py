"""LoRA bookkeeping without a model: the scheduler's --max-loras-per-batch (fair, no
starvation), the adapter manager's slots (LRU eviction of idle adapters only, waiting when
every slot is pinned), and the per-adapter metrics families."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from scheduler_fakes import Harness

from genserve.adapter_metrics import AdapterCollector
from genserve.engine.adapter_manager import AdapterManager, parse_lora_adapters
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.model.adapter_errors import AdapterNotFoundError
from genserve.model.config import ModelConfig, load_model_config
from genserve.step import AdapterRef
from tests.conftest import TinyModelFactory


def test_max_loras_per_batch_admits_in_order_without_starving() -> None:
    h = Harness(
        SchedulerConfig(
            num_blocks=64, block_size=4, max_batch_prefill_tokens=64, max_loras_per_batch=2
        )
    )
    order = ["a", "b", "c", "a", "b"]
    for i, name in enumerate(order):
        req = h.add(f"r{i}-{name}", [i + 1, i + 2], max_new_tokens=3, cache_salt=name)
        req.adapter = AdapterRef(ord(name) - ord("a"), name, f"/adapters/{name}")
    h.step()
    running = {r.req_id for r in h.sched._running}
    # "c" may not join a step with a and b; the later "a"/"b" requests queue behind it
    # (head of line) instead of jumping ahead forever.
    assert running == {"r0-a", "r1-b"}
    h.run()
    adapter_of = {f"r{i}-{n}": n for i, n in enumerate(order)}
    for step in h.steps:
        assert len({adapter_of[c.req_id] for c in step.chunks}) <= 2
    assert set(h.ends) == set(adapter_of)  # everyone finished, "c" included


def _cycling_order(cycle_time_s: float) -> list[str]:
    """Order in which requests first run: six of adapter "a" queued before one of "b",
    one adapter per step, two requests at a time; the clock passes 3 s after step one."""
    h = Harness(
        SchedulerConfig(
            num_blocks=64,
            block_size=4,
            max_batch_prefill_tokens=64,
            max_num_running=2,
            max_loras_per_batch=1,
            adapter_cycle_time_s=cycle_time_s,
        )
    )
    now = [0.0]
    h.sched.clock = lambda: now[0]
    names = [*(f"a{i}" for i in range(6)), "b0"]
    for i, name in enumerate(names):
        req = h.add(name, [i + 1, i + 2], max_new_tokens=4, cache_salt=name[0])
        req.adapter = AdapterRef(0 if name[0] == "a" else 1, name[0], f"/adapters/{name[0]}")
    started: list[str] = []
    while h.sched.has_unfinished_requests():
        step = h.step()
        started += [n.req_id for n in step.new_requests if n.req_id not in started]
        assert len({c.req_id[0] for c in step.chunks}) <= 1  # one adapter per step
        now[0] += 3.0
    assert set(h.ends) == set(names)
    return started


def test_adapter_cycle_time_lets_a_waiting_adapter_in() -> None:
    # A long cycle time: FIFO, "b" waits behind every queued "a" request.
    assert _cycling_order(1000.0) == ["a0", "a1", "a2", "a3", "a4", "a5", "b0"]
    # 2 s (LoRAX's default): after its turn "a" takes no new request while "b" waits; its
    # running requests finish, "b" runs, then "a" resumes.
    order = _cycling_order(2.0)
    assert order[:3] == ["a0", "a1", "b0"], order
    assert sorted(order) == sorted(["a0", "a1", "a2", "a3", "a4", "a5", "b0"])


def test_parse_lora_adapters() -> None:
    assert parse_lora_adapters("a=/x/a, b=/x/b,org/c") == {
        "a": "/x/a",
        "b": "/x/b",
        "org/c": "org/c",
    }
    assert parse_lora_adapters(None) == {}


@pytest.fixture(scope="module")
def adapters(
    tiny_model_factory: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelConfig, dict[str, str]]:
    pytest.importorskip("peft")
    from genserve.testing.tiny_lora import make_lora_adapter

    base = tiny_model_factory("llama")
    dirs = {
        name: str(make_lora_adapter(base, tmp_path_factory.mktemp(name), rank=2, seed=i))
        for i, name in enumerate(("a", "b", "c"))
    }
    return load_model_config(base), dirs


def test_manager_evicts_the_least_recently_used_idle_adapter(
    adapters: tuple[ModelConfig, dict[str, str]],
) -> None:
    config, dirs = adapters

    async def scenario() -> None:
        m = AdapterManager(config, known=dirs, max_active=2)
        ra = await m.acquire("a")
        rb = await m.acquire("b")
        assert {ra.slot, rb.slot} == {0, 1}
        m.release(ra, 5)
        m.release(rb, 7)
        ra2 = await m.acquire("a")  # a is now the most recently used
        rc = await m.acquire("c")  # evicts b (idle, least recently used), takes its slot
        assert rc.slot == rb.slot and ra2.slot == ra.slot
        assert m.loaded == ["c", "a"]
        assert m.stats["b"].evictions == 1
        # Every slot pinned: the next adapter waits until one is released.
        waiter = asyncio.ensure_future(m.acquire("b"))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        m.release(rc, 1)
        rb2 = await asyncio.wait_for(waiter, 5)
        assert rb2.slot == rc.slot
        with pytest.raises(AdapterNotFoundError):
            await m.acquire("/no/such/dir")

        registry = CollectorRegistry()
        registry.register(AdapterCollector(m))
        text = generate_latest(registry).decode()
        assert 'genserve_lora_requests_total{adapter_id="a"} 2.0' in text
        assert 'genserve_lora_generated_tokens_total{adapter_id="b"} 7.0' in text
        assert 'genserve_lora_evictions_total{adapter_id="c"} 1.0' in text
        assert "genserve_lora_active_adapters 2.0" in text

    asyncio.run(scenario())


def test_manager_rejects_a_missing_known_path(
    adapters: tuple[ModelConfig, dict[str, str]], tmp_path: Path
) -> None:
    config, _ = adapters
    m = AdapterManager(config, known={"x": str(tmp_path / "missing")})
    with pytest.raises(AdapterNotFoundError, match="'x'"):
        asyncio.run(m.preload())
