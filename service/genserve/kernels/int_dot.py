"""Whether quantized CPU matmuls run on integer dot products (``--cpu-int-dot``), and on which
instruction set (``kernels/int_dot_cpu.cpp``).

The float path (``genserve::qpanel_linear``) rebuilds every weight as a float32 and multiplies
it by the float32 activation; its result differs from a float32 matmul on the dequantized
matrix only in the order of sums.  The integer path also rounds each activation to int8 per
block of 32 (llama.cpp's Q8_0 activations), so its logits move by about that rounding: a
choice, not a detail (docs/cpu/integer-kernels.md has the measured cost and speed).  GGUF
K-quant matrices (``kernels/kquant_cpu.cpp``) follow the same mode and instruction-set codes,
with activations rounded per 256 inputs (llama.cpp's Q8_K).

Modes: ``auto`` (the server's default: the integer path wherever the CPU has one - VNNI or
the plain AVX2 path, both measured faster than the float path at 1, 8 and 32 rows -, the float
path elsewhere; what llama.cpp and vLLM's CPU backend always do with quantized weights);
``on`` (the integer path on the best instruction set the CPU has, AVX2 included; refused at
start where it has none); ``off`` (the float path, whose greedy output equals transformers' on
the dequantized weights).  Set once per process by the launcher (:func:`configure`) before the
model is built; the layers read :func:`active` when they pack their weights.  A process that
builds a model without the launcher (tests, op benchmarks) keeps the float path until it
configures a mode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

import torch

from genserve.kernels import cpu as cpu_kernels

IntDotMode = Literal["auto", "on", "off"]
INT_DOT_MODES: tuple[IntDotMode, ...] = ("auto", "on", "off")
# Activation dtypes the integer kernels take (int_dot_cpu.cpp, kquant_cpu.cpp, the fused
# decode layer and the MoE op check for these); float16 models keep the float path.
INT_DOT_DTYPES = ("float32", "bfloat16")


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
    # Not the server's default (config.py: auto): until the launcher (or a test) configures a
    # mode, models built in this process keep the float path's numerics.
    mode: IntDotMode = "off"
    dtype_name: str = "float32"  # the activations' dtype (--dtype as resolved)


_settings = _Settings()


def configure(mode: IntDotMode, dtype_name: str = "float32") -> None:
    """The ``--cpu-int-dot`` mode of this process and the dtype of its model's activations
    (before the model is built)."""
    if mode not in INT_DOT_MODES:
        raise ValueError(f"--cpu-int-dot: {mode!r} is not one of {', '.join(INT_DOT_MODES)}")
    _settings.mode = mode
    _settings.dtype_name = dtype_name


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

    @property
    def path(self) -> str:
        """``Info.quantized_matmul``: "integer" or "float"."""
        return "integer" if self.enabled else "float"


def choose(requested: IntDotMode | None = None) -> IntDotChoice:
    """Whether quantized weights use the integer kernels here, for ``requested`` (None: the
    configured mode).  Raises :class:`IntDotUnavailableError` for ``on`` where they cannot."""
    requested = _settings.mode if requested is None else requested
    if requested == "off":
        return IntDotChoice(False, None, "--cpu-int-dot off: float dequantize path")
    if _settings.dtype_name not in INT_DOT_DTYPES:
        dtype = _settings.dtype_name
        why = f"the integer kernels take float32 or bfloat16 activations, not {dtype}"
        if requested == "on":
            raise IntDotUnavailableError(f"--cpu-int-dot on: {why}; use --cpu-int-dot auto or off")
        return IntDotChoice(False, None, f"--cpu-int-dot auto: {why}: float dequantize path")
    isas = available_isas()
    if not isas:
        if requested == "on":
            raise IntDotUnavailableError(
                "--cpu-int-dot on: the integer kernels need genserve's CPU kernels (not "
                "disabled, built) and an x86-64 CPU with AVX2; use --cpu-int-dot auto or off"
            )
        return IntDotChoice(
            False,
            None,
            "--cpu-int-dot auto: no integer kernel on this CPU (needs AVX2 and "
            "genserve's CPU kernels): float dequantize path",
        )
    best = isas[-1]
    return IntDotChoice(
        True, best, f"--cpu-int-dot {requested}: integer dot products on {best.name}"
    )


def active() -> bool:
    """Whether quantized weights packed now use the integer kernels (the configured mode on
    this CPU; never raises: the launcher has already refused an impossible ``on``)."""
    try:
        return choose().enabled
    except IntDotUnavailableError:
        return False
