"""Whether the benches' llama.cpp runs use llama.cpp's repacked weight layouts (its "extra
buffer types": AMX tiles, interleaved Q4_0 / Q4_K rows), and the flags that say so.

llama.cpp 0.3.36 (llama-cpp-python's vendored copy) segfaulted with its AMX layouts in KVM
guests on Intel Xeons with AMX: llama-cpp-python in ``llama_decode``, ``llama-server`` and
``llama-bench`` while loading a model (docs/benchmarks/cpu.md, session 17), though the guest
runs AMX tiles (torch's oneDNN does).  So the benches turn them off on AMX CPUs unless asked
(``--llamacpp-extra-bufts``); elsewhere llama.cpp's default (on) stands.  A llama.cpp built
without its AMX kernels repacks fine there and is the stronger peer: pass it with the flag.
"""

from __future__ import annotations

from pathlib import Path


def default_on() -> bool:
    """llama.cpp's own default (on), except on CPUs the kernel reports AMX tiles for."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.is_file() else []
    return "amx_tile" not in flags


def choice_flags(on: bool | None, *flags: str) -> list[str]:
    """The "on" half of ``flags`` or the "off" half as ``on`` says; None: neither (llama.cpp's
    default).  ``llama-server``: ``--repack``, ``--no-repack``; ``llama-bench``: ``--repack``,
    ``1``, ``--repack``, ``0``."""
    if on is None:
        return []
    half = len(flags) // 2
    return list(flags[:half] if on else flags[half:])


def server_flags(on: bool | None) -> list[str]:
    return choice_flags(on, "--repack", "--no-repack")


def bench_flags(on: bool | None) -> list[str]:
    return choice_flags(on, "--repack", "1", "--repack", "0")
