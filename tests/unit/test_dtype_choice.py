"""--dtype auto: bfloat16 only where it is computed natively, float32 on other CPUs."""

from __future__ import annotations

import pytest
import torch

from genserve import dtype_choice
from genserve.config import load_config
from genserve.dtype_choice import choose_dtype


def test_explicit_dtype_is_kept() -> None:
    for name in ("float32", "bfloat16", "float16"):
        assert choose_dtype(name, on_cuda=False).name == name
        assert choose_dtype(name, on_cuda=True).name == name


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_cpu_follows_native_bf16(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(dtype_choice, "cpu_has_native_bf16", lambda hidden=(): native)
    for requested in (None, "auto"):
        choice = choose_dtype(requested, on_cuda=False)
        assert choice.name == ("bfloat16" if native else "float32")
        assert choice.reason.startswith("auto")


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_on_cuda(monkeypatch: pytest.MonkeyPatch, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert choose_dtype(None, on_cuda=True).name == ("bfloat16" if bf16 else "float16")


def test_native_bf16_probe_matches_torch() -> None:
    # Whatever this machine is, the probe agrees with torch's own CPU capability checks.
    expected = (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    ) and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert dtype_choice.cpu_has_native_bf16() == expected


def test_bf16_is_not_native_when_torch_runs_its_avx2_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An AMX CPU with ATEN_CPU_CAPABILITY=avx2: torch's bf16 kernels refuse to run there.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not dtype_choice.cpu_has_native_bf16()
    assert choose_dtype(None, on_cuda=False).name == "float32"


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "hidden", "native"),
    [
        (True, False, (), True),
        (True, False, ("avx512bf16", "amx-bf16", "amx-tile", "amx-int8"), False),  # Cascade Lake
        (True, True, ("avx512bf16",), True),  # AMX still computes bf16
        (False, True, ("amx-tile",), False),
        (False, True, ("amx-bf16",), False),
    ],
)
def test_the_features_mask_counts_as_absent(
    monkeypatch: pytest.MonkeyPatch,
    avx512_bf16: bool,
    amx: bool,
    hidden: tuple[str, ...],
    native: bool,
) -> None:
    # --cpu-features-mask emulates a CPU without bfloat16: --dtype auto must then choose what
    # that CPU would (float32), not bfloat16 computed on the paths the mask turned off.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert dtype_choice.cpu_has_native_bf16(hidden) is native
    expected = "bfloat16" if native else "float32"
    assert choose_dtype(None, on_cuda=False, hidden_features=hidden).name == expected


def test_flag_and_env_accept_auto() -> None:
    assert load_config(["--dtype", "auto"], environ={}).dtype == "auto"
    assert load_config([], environ={"DTYPE": "auto"}).dtype == "auto"
    assert load_config([], environ={}).dtype is None
