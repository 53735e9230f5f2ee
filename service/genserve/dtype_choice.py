"""``--dtype auto``: the compute dtype this machine runs fastest without losing accuracy.

On CUDA that is bfloat16 (float16 on GPUs without bf16, before Ampere).  On CPU it is
bfloat16 only where the cores compute it natively (AVX512-BF16 or AMX): elsewhere torch
emulates bf16 matmuls by widening to float32 (measured on an AVX2 Zen 3: 19 GFLOP/s vs 110
for float32, so bf16 serving ran 3x slower), so float32 is both faster and exact.  Where bf16
is native it wins: single-stream decode streams bf16 weights through genserve's matvec kernel
(half the bytes of float32) and, with AMX, batched steps run on its tiles; measured on an AMX
Xeon with ``genserve-bench cpu``: 90 vs 48 tok/s at 1 stream, 890 vs 652 at 32.

Quantized GGUF files get the same choice.  Their integer kernels quantize the activations to
int8 from either dtype, so float32 activations save each projection's bf16 widening and
narrowing; measured against bfloat16 on an AVX512-BF16 Zen 4 (1B-shape Q8_0/Q4_0/Q4_K_M, a
MoE Q4_K_M, the 135M Q8_0) that saved 5-7% of a 135M step, at most 4% of a 1B step and
nothing end to end beyond the noise, while float32 doubles the KV cache, which made decode at
2,048 tokens of context 3-9% slower: docs/cpu/integer-kernels.md ("Activation dtype").
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    name: str  # "float32" | "bfloat16" | "float16"
    reason: str  # one line for the log: why this dtype


def cpu_has_native_bf16(hidden: Collection[str] = ()) -> bool:
    """Whether torch's CPU kernels run bf16 matmuls in hardware on this machine: the CPU has
    AVX512-BF16 or AMX, and torch runs its AVX-512 kernels.  Under ATEN_CPU_CAPABILITY=avx2
    (or lower) on such a CPU, torch's bf16 paths stop with "pack_vnni2 is only supported
    when avx512 is supported", so bf16 is not native there either.  ``hidden``: the features
    --cpu-features-mask hides (kernels/cpu_features.py names), which count as absent: an
    emulated CPU without bfloat16 is served as that CPU would be."""
    import torch  # here: the launcher imports this module, and --help must not pay torch

    probes = (
        ("_is_avx512_bf16_supported", ("avx512bf16",)),
        ("_is_amx_tile_supported", ("amx-tile", "amx-bf16")),
    )
    hardware = any(
        bool(getattr(torch.cpu, probe, lambda: False)()) and not set(names) & set(hidden)
        for probe, names in probes
    )
    return hardware and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def choose_dtype(
    requested: str | None, on_cuda: bool, hidden_features: Collection[str] = ()
) -> DtypeChoice:
    """``requested`` is the --dtype value (None or "auto": choose for this machine, as if the
    CPU lacked ``hidden_features``)."""
    if requested not in (None, "auto"):
        return DtypeChoice(str(requested), "--dtype")
    if on_cuda:
        import torch

        if torch.cuda.is_bf16_supported():
            return DtypeChoice("bfloat16", "auto: CUDA device with bfloat16")
        return DtypeChoice("float16", "auto: CUDA device without bfloat16")
    if cpu_has_native_bf16(hidden_features):
        return DtypeChoice("bfloat16", "auto: CPU computes bfloat16 natively (AVX512-BF16/AMX)")
    return DtypeChoice("float32", "auto: CPU without native bfloat16 (it would be emulated)")
