"""``GENSERVE_CPU_FEATURES_MASK`` / ``--cpu-features-mask`` (kernels/cpu_features.py): the CPU
features genserve's kernels treat as absent, so that an AVX-512 machine runs the paths of an
AVX2-only CPU or of an AVX-512 one without VNNI / bfloat16.

* the parser: levels, names, the AVX-512 extensions following their foundation, typos refused;
* the config reads the variable, the launcher refuses a bad value;
* with the kernels loaded: hiding features removes exactly the integer paths and the bfloat16
  GEMM that need them (never adds one), ``int_dot.choose`` follows, the kernel refuses an
  explicitly asked hidden path, and clearing the mask restores the CPU's own set.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gguf import GGMLQuantizationType

from genserve.config import load_config
from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.kernels.cpu_features import HIDEABLE, LEVELS, parse_mask
from genserve.kernels.int_dot import Isa
from genserve.model.kquants import KQuantWeight
from genserve.testing.tiny_gguf import random_blocks


def test_levels_and_names() -> None:
    assert parse_mask("") == ()
    assert parse_mask("avx2") == HIDEABLE
    assert parse_mask("AVX512") == ("avx512vnni", "avx512bf16", "avxvnni", "amx-tile",
                                    "amx-int8", "amx-bf16", "gfni")  # fmt: skip
    assert parse_mask(" avx512bf16 , amx-bf16") == ("avx512bf16", "amx-bf16")
    # no AVX-512 extension without the foundation
    assert set(parse_mask("avx512f")) == {f for f in HIDEABLE if f.startswith("avx512")}
    assert set(LEVELS["avx512"]) < set(LEVELS["avx2"])


def test_a_typo_is_refused() -> None:
    with pytest.raises(ValueError, match="avx512bf61"):
        parse_mask("avx512bf61")


def test_config_reads_the_environment() -> None:
    config = load_config([], {"GENSERVE_CPU_FEATURES_MASK": "avx2"})
    assert config.cpu_features_mask == "avx2"
    assert load_config([], {}).cpu_features_mask == ""
    assert load_config(["--cpu-features-mask", "avx512"], {}).cpu_features_mask == "avx512"


@pytest.fixture
def kernels() -> Iterator[None]:
    if not cpu_kernels.load():
        pytest.skip("CPU kernels did not build")
    saved = cpu_kernels.hidden_features()
    yield
    torch.ops.genserve.set_hidden_cpu_features(list(saved))
    cpu_kernels._settings.hidden_features = saved


def _hide(names: tuple[str, ...]) -> None:
    torch.ops.genserve.set_hidden_cpu_features(list(names))
    cpu_kernels._settings.hidden_features = names


def test_hiding_removes_paths_and_clearing_restores_them(kernels: None) -> None:
    _hide(())
    full = [Isa(i) for i in torch.ops.genserve.int_dot_isas()]
    full_bf16 = bool(torch.ops.genserve.bf16_gemm_native())
    if Isa.AVX2 not in full:
        pytest.skip("this CPU has no AVX2")
    _hide(parse_mask("avx2"))
    assert torch.ops.genserve.hidden_cpu_features() == list(HIDEABLE)
    assert [Isa(i) for i in torch.ops.genserve.int_dot_isas()] == [Isa.AVX2]
    assert not torch.ops.genserve.bf16_gemm_native()
    assert int_dot.choose("on").isa == Isa.AVX2
    _hide(parse_mask("avx512"))
    isas = [Isa(i) for i in torch.ops.genserve.int_dot_isas()]
    assert Isa.AVX512_VNNI not in isas and Isa.AVX_VNNI not in isas and Isa.AVX2 in isas
    assert not torch.ops.genserve.bf16_gemm_native()
    _hide(())
    assert [Isa(i) for i in torch.ops.genserve.int_dot_isas()] == full
    assert bool(torch.ops.genserve.bf16_gemm_native()) == full_bf16


def test_a_hidden_path_asked_for_by_name_is_refused(kernels: None) -> None:
    _hide(())
    if Isa.AVX512_VNNI not in [Isa(i) for i in torch.ops.genserve.int_dot_isas()]:
        pytest.skip("this CPU has no AVX512-VNNI")
    _hide(parse_mask("avx2"))
    w = KQuantWeight.from_blocks(random_blocks(GGMLQuantizationType.Q4_K, 8, 256, seed=0), "Q4_K")
    with pytest.raises(RuntimeError):
        w.serving(int(Isa.AVX512_VNNI)).linear(torch.randn(2, 256), None)
    assert w.serving(int(Isa.AVX2)).linear(torch.randn(2, 256), None).shape == (2, 8)
