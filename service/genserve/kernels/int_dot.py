"""Whether quantized CPU matmuls run on integer dot products (``--cpu-int-dot``), and on which
instruction set (``kernels/int_dot_cpu.cpp``).

The float path (``genserve::qpanel_linear``) rebuilds every weight as a float32 and multiplies
it by the float32 activation; its result differs from a float32 matmul on the dequantized
matrix only in the order of sums.  The integer path also rounds each activation to int8 per
block of 32 (llama.cpp's Q8_0 activations), so its logits move by about that rounding: a
choice, not a detail (docs/cpu/integer-kernels.md has the measured cost and speed).  GGUF
K-quant matrices (``kernels/kquant_cpu.cpp``) follow the same mode and instruction-set codes,
with activations rounded per 256 inputs (llama.cpp's Q8_K).

Modes: ``off`` (the default: the float path, whose greedy output equals transformers' on the
dequantized weights); ``on`` (the integer path on the best instruction set the CPU has,
AVX2 included; refused at start where it has none); ``auto`` (the integer path wherever
the CPU has one: VNNI and the plain AVX2 path both measured faster than the float path at 1,
8 and 32 rows; the float path elsewhere).  Set once per process by the launcher
(:func:`configure`) before the model is built; the layers read :func:`active` when they pack
their weights.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

import torch

from genserve.kernels import cpu as cpu_kernels

IntDotMode = Literal["auto", "on", "off"]
INT_DOT_MODES: tuple[IntDotMode, ...] = ("auto", "on", "off")


class Isa(enum.IntEnum):
    """The kernel's instruction-set paths (its ``isa`` argument; int_dot.h)."""

    AUTO = 0
    AVX2 = 1
    AVX_VNNI = 2
    AVX512_VNNI = 3
    # The AVX-VNNI code with AVX512-VNNI's 256-bit instruction: for tests, never chosen.
    VNNI256_EVEX = 4


class IntDotUnavailableError(ValueError):
    """``--cpu-int-dot on`` on a machine where the integer kernels cannot run."""


@dataclass(slots=True)
class _Settings:
    mode: IntDotMode = "off"


_settings = _Settings()


def configure(mode: IntDotMode) -> None:
    """The ``--cpu-int-dot`` mode of this process (before the model is built)."""
    if mode not in INT_DOT_MODES:
        raise ValueError(f"--cpu-int-dot: {mode!r} is not one of {', '.join(INT_DOT_MODES)}")
    _settings.mode = mode


def mode() -> IntDotMode:
    return _settings.mode


def available_isas() -> list[Isa]:
    """The paths this CPU runs, best last (empty without the kernels or without AVX2)."""
    if not cpu_kernels.load():
        return []
    return [Isa(i) for i in torch.ops.genserve.int_dot_isas()]


@dataclass(frozen=True, slots=True)
class IntDotChoice:
    enabled: bool
    isa: Isa | None  # the path the kernel takes (None: the float path)
    reason: str  # one line for the log


def choose(requested: IntDotMode | None = None) -> IntDotChoice:
    """Whether quantized weights use the integer kernels here, for ``requested`` (None: the
    configured mode).  Raises :class:`IntDotUnavailableError` for ``on`` where they cannot."""
    requested = _settings.mode if requested is None else requested
    if requested == "off":
        return IntDotChoice(False, None, "--cpu-int-dot off: float dequantize path")
    isas = available_isas()
    if not isas:
        if requested == "on":
            raise IntDotUnavailableError(
                "--cpu-int-dot on: the integer kernels need genserve's CPU kernels (not "
                "disabled, built) and an x86-64 CPU with AVX2; use --cpu-int-dot auto or off"
            )
        return IntDotChoice(False, None, "auto: no integer kernel path on this CPU")
    best = isas[-1]
    return IntDotChoice(True, best, f"--cpu-int-dot {requested}: {best.name}")


def active() -> bool:
    """Whether quantized weights packed now use the integer kernels (the configured mode on
    this CPU; never raises: the launcher has already refused an impossible ``on``)."""
    try:
        return choose().enabled
    except IntDotUnavailableError:
        return False
