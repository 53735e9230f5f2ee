"""Which LoRA adapters are resident, in which runner slot, and who is using them.

Runs on the event loop.  A request naming an adapter ``acquire``s it before it reaches the
scheduler: the first use of an id resolves and validates it in a worker thread (the engine
loop and the running batch carry on meanwhile), then the adapter gets one of
``max_active`` slots: a free one, or the least recently used slot whose adapter has no
request in flight (LoRAX's eviction).  When every slot is pinned by running requests the
request waits here until one finishes.  The runner installs an adapter into its slot when
the first request carrying the slot's new id reaches it (:class:`genserve.step.AdapterRef`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from genserve.adapter_metrics import AdapterStats
from genserve.model.config import ModelConfig
from genserve.step import AdapterRef
from genserve.v1 import generate_pb2 as pb

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Resident:
    slot: int
    path: str
    in_flight: int = 0


def parse_lora_adapters(text: str | None) -> dict[str, str]:
    """``--lora-adapters id=path,id2=path2`` (a bare ``id`` is its own path / hub id)."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        adapter_id, _, path = item.partition("=")
        out[adapter_id.strip()] = path.strip() or adapter_id.strip()
    return out


class AdapterManager:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        known: Mapping[str, str] | None = None,
        default_id: str | None = None,
        source: str = "local",
        max_active: int = 8,
        base_model_id: str | None = None,
    ) -> None:
        self.model_config = model_config
        self.base_model_id = base_model_id
        self.known = dict(known or {})
        self.default_id = default_id or None
        self.source = source
        self.max_active = max_active
        self.stats: dict[str, AdapterStats] = {}
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # LRU first
        self._free_slots = list(range(max_active))
        self._validated: dict[str, str] = {}
        self._validating: dict[str, asyncio.Future[str]] = {}
        self._slot_freed = asyncio.Event()
        # Set when the served model cannot take adapters (the transformers fallback): every
        # adapter is refused with this reason (INVALID_ARGUMENT), before any step sees it.
        self.unsupported: str | None = None

    def effective_id(self, requested: str | None) -> str | None:
        """The adapter a request uses: its own, else the server default, else None (base)."""
        return requested or self.default_id

    @property
    def loaded(self) -> list[str]:
        """Resident adapter ids, most recently used first."""
        return list(reversed(self._resident))

    async def preload(self) -> None:
        """Validate every ``--lora-adapters`` entry and the default adapter now."""
        for adapter_id in [*self.known, *([self.default_id] if self.default_id else [])]:
            await self._validate(adapter_id)

    async def acquire(self, adapter_id: str) -> AdapterRef:
        """Resolve, validate and pin ``adapter_id`` into a slot.  Raises
        :class:`~genserve.model.adapter_errors.AdapterNotFoundError` or
        :class:`~genserve.model.adapter_errors.AdapterError`; waits while every slot is pinned."""
        path = await self._validate(adapter_id)
        self.stats.setdefault(adapter_id, AdapterStats()).requests += 1
        while True:
            resident = self._resident.get(adapter_id)
            if resident is None:
                slot = self._take_slot()
                if slot is not None:
                    resident = self._resident[adapter_id] = _Resident(slot, path)
            if resident is not None:
                resident.in_flight += 1
                self._resident.move_to_end(adapter_id)
                return AdapterRef(resident.slot, adapter_id, resident.path)
            self._slot_freed.clear()
            await self._slot_freed.wait()

    def release(self, ref: AdapterRef, num_generated: int = 0) -> None:
        """The request holding ``ref`` has finished (or failed) after ``num_generated``
        tokens."""
        self.stats.setdefault(ref.adapter_id, AdapterStats()).generated_tokens += num_generated
        resident = self._resident.get(ref.adapter_id)
        if resident is not None and resident.in_flight > 0:
            resident.in_flight -= 1
            if resident.in_flight == 0:
                self._slot_freed.set()

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop(0)
        for adapter_id, resident in self._resident.items():  # least recently used first
            if resident.in_flight == 0:
                del self._resident[adapter_id]
                self.stats.setdefault(adapter_id, AdapterStats()).evictions += 1
                log.info("adapter_evicted", adapter_id=adapter_id, slot=resident.slot)
                return resident.slot
        return None

    async def _validate(self, adapter_id: str) -> str:
        done = self._validated.get(adapter_id)
        if done is not None:
            return done
        pending = self._validating.get(adapter_id)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._read, adapter_id))
            self._validating[adapter_id] = pending
            try:
                path = await pending
            finally:
                self._validating.pop(adapter_id, None)
            self._validated[adapter_id] = path
            return path
        return await asyncio.shield(pending)

    def _read(self, adapter_id: str) -> str:
        """In a worker thread: find the adapter and check it fits the base model."""
        # Imported here: adapter_files needs torch, which the launcher imports only after
        # the port is open (and `genserve --help` never).
        from genserve.model.adapter_files import read_adapter, resolve_adapter_dir

        if self.unsupported is not None:
            from genserve.model.adapter_errors import AdapterError

            raise AdapterError(f"adapter {adapter_id!r}: {self.unsupported}")
        start = time.perf_counter()
        directory = resolve_adapter_dir(adapter_id, self.known.get(adapter_id), self.source)
        weights = read_adapter(adapter_id, directory, self.model_config)
        elapsed = time.perf_counter() - start
        stats = self.stats.setdefault(adapter_id, AdapterStats())
        stats.loads += 1
        stats.load_seconds += elapsed
        if weights.base_model and self.base_model_id and weights.base_model != self.base_model_id:
            # A warning, not an error: PEFT records whatever local path or mirror the adapter
            # was trained from, so names differ for fitting models; shapes decide (checked).
            log.warning(
                "adapter_base_model_differs",
                adapter_id=adapter_id,
                adapter_base=weights.base_model,
                served=self.base_model_id,
            )
        log.info("adapter_validated", adapter_id=adapter_id, path=str(directory), seconds=elapsed)
        return str(Path(directory).resolve())


async def acquire_requested(
    adapters: AdapterManager | None, requested: str | None
) -> AdapterRef | None:
    """The adapter a request runs with (its own or ``--adapter-id``), pinned into a runner
    slot; None for the base model.  Naming one where LoRA is off is NOT_FOUND.  Both engines
    (one process and ``--engine-process``'s front) acquire through here."""
    adapter_id = adapters.effective_id(requested) if adapters else requested
    if not adapter_id:
        return None
    if adapters is None:
        from genserve.model.adapter_errors import AdapterNotFoundError

        raise AdapterNotFoundError(f"adapter {adapter_id!r}: LoRA is not enabled")
    return await adapters.acquire(adapter_id)


@dataclass(frozen=True, slots=True)
class AdapterSettings:
    """The launcher's adapter flags, as the manager needs them (built by cli.py)."""

    lora_adapters: str | None = None  # --lora-adapters, see parse_lora_adapters
    default_id: str | None = None  # --adapter-id
    source: str = "local"  # --adapter-source
    max_active: int = 8  # --max-active-adapters


async def start_adapters(
    settings: AdapterSettings, model_config: ModelConfig, info: pb.InfoResponse
) -> AdapterManager:
    """The launcher's adapter manager, with ``--lora-adapters`` and ``--adapter-id``
    validated now: a bad preloaded adapter stops start-up instead of failing requests."""
    manager = AdapterManager(
        model_config,
        known=parse_lora_adapters(settings.lora_adapters),
        default_id=settings.default_id,
        source=settings.source,
        max_active=settings.max_active,
        base_model_id=info.model_id or None,
    )
    if info.implementation not in ("", "native"):
        manager.unsupported = (
            f"LoRA adapters are not supported by the transformers fallback that serves "
            f"{info.architecture}"
        )
    await manager.preload()
    return manager
