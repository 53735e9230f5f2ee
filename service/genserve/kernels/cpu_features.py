"""CPU features genserve's kernels treat as absent (``GENSERVE_CPU_FEATURES_MASK``): testing and
benchmarking only.

The kernels choose instruction sets at run time from cpuid; a mask hides some of what this CPU
has, so that one machine runs, tests and measures the paths of another, e.g. an AVX2-only AMD
Zen 3 or an AVX-512 Xeon without VNNI / bfloat16 on an AVX512-BF16 Zen 4
(docs/benchmarks/cpu-avx2.md).  A mask only removes paths, never adds one the CPU lacks.
Hiding ``avx512f`` also builds the kernel library at the AVX2 level (``-march=x86-64-v3``,
a library of its own name), so that no compiler-vectorised AVX-512 code runs either.

The value is a comma-separated list of GCC ``__builtin_cpu_supports`` names from
:data:`HIDEABLE`, or one of the levels in :data:`LEVELS`: ``avx2`` (an AVX2-only CPU: every
AVX-512, AVX-VNNI and AMX feature hidden) or ``avx512`` (AVX-512 F/BW/VL without VNNI,
bfloat16 or AMX: Skylake-SP).  torch's own kernels are restricted separately
(``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``; the documentation page says how).
"""

from __future__ import annotations

# cpu_features.h's kHideable, in its order.
HIDEABLE: tuple[str, ...] = (
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512vnni",
    "avx512bf16",
    "avxvnni",
    "amx-tile",
    "amx-int8",
    "amx-bf16",
    # no kernel chooses on GFNI since the AVX-512 K-quant path unpacks nibbles by a mask and a
    # shift (kquant_zmm_row.inc); kept so that masks written with it stay valid
    "gfni",
)
_AMX = ("amx-tile", "amx-int8", "amx-bf16")
LEVELS: dict[str, tuple[str, ...]] = {
    "avx2": HIDEABLE,
    # Skylake-SP: no GFNI either
    "avx512": ("avx512vnni", "avx512bf16", "avxvnni", *_AMX, "gfni"),
}


def parse_mask(value: str) -> tuple[str, ...]:
    """The features ``value`` hides, in :data:`HIDEABLE`'s order (empty: none).  Raises
    ValueError for a name that is neither a level nor a hideable feature: a typo must not
    measure the whole CPU under an emulation's label."""
    hidden: set[str] = set()
    for raw in value.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name in LEVELS:
            hidden.update(LEVELS[name])
        elif name in HIDEABLE:
            hidden.add(name)
        else:
            choices = ", ".join([*LEVELS, *HIDEABLE])
            raise ValueError(f"{name!r} is not one of {choices}")
    if "avx512f" in hidden:  # no AVX-512 extension runs without its foundation
        hidden.update(f for f in HIDEABLE if f.startswith("avx512"))
    return tuple(f for f in HIDEABLE if f in hidden)
