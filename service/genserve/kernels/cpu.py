"""genserve's CPU kernels (``paged_attention_cpu.cpp``, ``fused_cpu.cpp``), compiled on
first use.

The C++ source is built with torch's JIT extension builder (ninja + the system C++
compiler) into ``$GENSERVE_CACHE/kernels`` (default ``~/.cache/genserve/kernels``; the
launcher's ``--genserve-cache`` where given) and loaded as ``torch.ops.genserve.*``; later
processes load the cached library in milliseconds.  ``scripts/bootstrap.sh`` builds it once
(``python -m genserve.kernels.cpu``) so that neither a server start nor a test pays the
compile (82 s of CPU time measured on an AVX-512 machine, spread over the cores by ninja; a
start that compiles says so in the log, and one whose ``--genserve-cache`` points elsewhere
loads the build in the environment's cache).  The launcher points the cache at
``--genserve-cache`` and turns the kernels off with ``--disable-cpu-kernels`` through
:func:`configure` (before the model is built).

The build is tuned to the instruction set torch itself detected on this CPU (AVX-512,
AVX2, or the baseline), and that level is part of the library's name, so a cache directory
shared between machines never loads code the CPU cannot run.  When anything fails (no
compiler, a read-only cache, ``--disable-cpu-kernels``), :func:`load` returns False,
says why once in the log, and callers keep their portable torch path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from genserve.config import environment_cache

log = structlog.get_logger(__name__)

_SOURCES = [
    Path(__file__).with_name(n)
    for n in ("paged_attention_cpu.cpp", "fused_cpu.cpp", "matvec_cpu.cpp")
]
# bf16 x bf16 decode projections by VDPBF16PS where the CPU has AVX512-BF16 (matvec_cpu.cpp)
_SOURCES.append(Path(__file__).with_name("matvec_bf16dot_cpu.cpp"))
# the same for 5+ rows on AMX tiles where the CPU has them (matvec_cpu.cpp)
_SOURCES.append(Path(__file__).with_name("matvec_amx_cpu.cpp"))
_SOURCES.append(Path(__file__).with_name("lora_cpu.cpp"))  # multi-LoRA BGMV (model/lora.py)
# float32 and --quantize weights in column panels (model/weight_panels.py)
_SOURCES.append(Path(__file__).with_name("panel_gemm_cpu.cpp"))
_SOURCES.append(Path(__file__).with_name("decode_layer_cpu.cpp"))  # one op per decode layer
# --cpu-int-dot: integer dot products on 8-/4-bit blocks (kernels/int_dot.py)
_SOURCES.append(Path(__file__).with_name("int_dot_cpu.cpp"))
# GGUF K-quant super-blocks, float and integer paths (model/kquants.py)
_SOURCES.append(Path(__file__).with_name("kquant_cpu.cpp"))
# K-quant prompt chunks: blocks decoded to bfloat16 panels for oneDNN's GEMM (model/kquants.py)
_SOURCES.append(Path(__file__).with_name("prefill_gemm_cpu.cpp"))
# the routed experts of a mixture-of-experts layer, one op per layer (model/moe.py)
_SOURCES.append(Path(__file__).with_name("moe_cpu.cpp"))
# the same with the experts in a GGUF file's quantized blocks (model/moe_gguf.py)
_SOURCES.append(Path(__file__).with_name("moe_quant_cpu.cpp"))
# a MoE router's logits, scoring and top-k in one op (model/moe.py's route, decode_moe_layer)
_SOURCES.append(Path(__file__).with_name("moe_route_cpu.cpp"))
# K-quant prompt chunks without hardware bfloat16: a register-tiled integer GEMM (model/kquants.py)
_SOURCES.append(Path(__file__).with_name("prefill_int_gemm_cpu.cpp"))
# GENSERVE_CPU_FEATURES_MASK: features the kernels' run-time choices treat as absent
_SOURCES.append(Path(__file__).with_name("cpu_features_cpu.cpp"))
_HEADERS = [Path(__file__).with_name(n) for n in ("vec_math.h", "matvec_core.h", "genserve_ops.h")]
_HEADERS += [
    Path(__file__).with_name(n)
    for n in (
        "matvec_bf16dot.h",
        "matvec_amx.h",
        "cpu_features.h",
        "int_dot.h",
        "int_dot_tile.inc",
        "int_dot_ymm_vnni.inc",
        "kquant_decode.inc",
        "kquant_int_row.inc",
        "kquant_int_row_pairs.inc",
        "kquant_ymm_row.inc",
        "kquant_zmm_row.inc",
        "kquant_rows.h",
        "row_shares.h",
        "scratch_arrays.h",
        "moe_grouping.h",
        "moe_quant_row.inc",
        "moe_mxfp4_row.inc",
        "moe_q8_r16_row.inc",
    )
]
_OPS = (
    "paged_decode_attention",
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "rotary",
    "rotary_write_kv",
    "matvec",
    "matvec_fma",
    "panel_linear",
    "qpanel_linear",
    "decode_layer",
    "decode_attention",
    "decode_moe_layer",
    "moe_route",
    "greedy_stats",
    "int_dot_linear",
    "kquant_linear",
    "kquant_linear_bf16",
    "set_batch_invariant",
    "moe_experts",
    "moe_experts_gguf",
    "moe_pack_q8_0_r16",
    "set_hidden_cpu_features",
    "kquant_linear_int_gemm",
)
_LORA_OPS = ("lora_bgmv_",)  # multi-LoRA BGMV (model/lora.py, lora_cpu.cpp)


@dataclass(slots=True)
class _Settings:
    # $GENSERVE_CACHE/kernels as the launcher would take it, until it configures its own
    # (--genserve-cache): a test or tool that loads the kernels builds where servers look.
    cache_dir: Path = field(default_factory=lambda: environment_cache() / "kernels")
    enabled: bool = True
    # --deterministic: every op computes each row by one code path whatever the batch
    # (``genserve_ops.h``'s batch_invariant; the model and attention read it too).
    batch_invariant: bool = False
    # GENSERVE_CPU_FEATURES_MASK (kernels/cpu_features.py): features treated as absent.
    hidden_features: tuple[str, ...] = ()
    # The outcome of the one build-and-load attempt of this process (None: not tried yet).
    # A library registers the ``genserve`` op namespace, which a process can do only once:
    # a second library (another cache directory) would abort the process.
    loaded: bool | None = None


_settings = _Settings()
_BOOTSTRAP_HINT = "once per machine and torch version; python -m genserve.kernels.cpu does it ahead"

# Half-precision steps with at most this many rows run their projections through
# ``genserve::matvec`` (measured on the default model's matrices, 1 thread: bfloat16 storage
# 1.4x/1.3x/1.0x the speed of torch's best path at 1/8/32 rows on an AVX512-BF16 CPU).
MATVEC_MAX_ROWS = 32
# With AMX tiles the matvec runs 5+ rows on them (matvec_amx_cpu.cpp), ahead of oneDNN's bf16
# GEMM up to ~24 rows and level with it at 32 (1B-shape matrices, 2 threads, Intel Xeon with
# AMX, session 17: 1.2-1.4x at 12 rows, 1.05-1.4x at 24).  Before the tiles, VDPBF16PS alone
# lost to oneDNN past 8 rows there, which was this limit then.
MATVEC_MAX_ROWS_AMX = 24


def amx_bf16() -> bool:
    """Whether this CPU has AMX tiles with their bfloat16 product (torch's check), neither
    hidden by the features mask."""
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return amx and not {"amx-tile", "amx-bf16"} & set(_settings.hidden_features)


def matvec_max_rows() -> int:
    """The row count up to which half-precision projections use the matvec on this CPU."""
    return MATVEC_MAX_ROWS_AMX if amx_bf16() else MATVEC_MAX_ROWS


# Reassociating float sums lets the compiler reduce a dot product in a tree of vector adds
# instead of a chain of scalar ones (the order of a float sum is not part of the result's
# contract: torch's own kernels sum in blocks too).  No -ffast-math: NaN/inf stay honoured.
_OPT_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fassociative-math",
              "-fno-signed-zeros", "-fno-trapping-math"]  # fmt: skip
# at::parallel_for is header code over OpenMP: without -fopenmp it silently runs on one
# thread.  The library then needs libgomp.so.1, which the dynamic linker resolves to the copy
# torch has already loaded (same soname), so there is one OpenMP thread pool, torch's.
_LINK_FLAGS = ["-fopenmp"]

# Compiler flags per instruction-set level torch reports (torch.backends.cpu).
_ISA_FLAGS = {
    "AVX512": ["-march=x86-64-v4"],
    "AVX2": ["-march=x86-64-v3"],
}


def _isa_level() -> str:
    if platform.machine() not in ("x86_64", "AMD64"):
        return "default"
    capability = str(torch.backends.cpu.get_cpu_capability()).upper()
    if "AVX512" in capability or "AMX" in capability:  # AMX parts report a richer level
        # an emulated AVX2-only CPU: no compiler-vectorised AVX-512 either (cpu_features.py)
        return "AVX2" if "avx512f" in _settings.hidden_features else "AVX512"
    return capability if capability in _ISA_FLAGS else "default"


def configure(
    cache_dir: Path | None = None,
    enabled: bool = True,
    batch_invariant: bool = False,
    hidden_features: Sequence[str] = (),
) -> None:
    """Where builds are cached (None: leave it), whether to use the kernels at all, whether
    they run batch-invariant (``--deterministic``), and the CPU features they treat as absent
    (``GENSERVE_CPU_FEATURES_MASK``, parsed by ``cpu_features.parse_mask``: testing and
    benchmarking only); call before :func:`load` (the launcher does, from its config) and
    before the model is built.  Once a process has loaded the library, a new cache directory
    has no effect, nor does hiding ``avx512f`` on the build's level; the rest still does."""
    if cache_dir is not None:
        _settings.cache_dir = cache_dir
    _settings.enabled = enabled
    _settings.batch_invariant = batch_invariant
    _settings.hidden_features = tuple(hidden_features)
    if _settings.loaded:
        torch.ops.genserve.set_batch_invariant(batch_invariant)
        torch.ops.genserve.set_hidden_cpu_features(list(_settings.hidden_features))


def hidden_features() -> tuple[str, ...]:
    """The CPU features the kernels treat as absent (empty unless a mask is configured)."""
    return _settings.hidden_features


def batch_invariant() -> bool:
    """True when ``--deterministic`` asked for batch-invariant kernels and they are loaded:
    every row of a step then takes the same code path, in the same order of float sums,
    whatever else the step holds (projections by the matvec at any row count, attention
    by the paged kernel for prefill tokens too, no split of a context over threads)."""
    return _settings.batch_invariant and enabled_and_loaded()


def _content_hash() -> str:
    """Names the build after its inputs (sources, headers, flags, torch version): torch's JIT
    rebuilds when a source file changes but not when a header does or torch is upgraded, and
    an old library must never be loaded for new code."""
    digest = hashlib.sha256()
    for path in [*_SOURCES, *_HEADERS]:
        digest.update(path.read_bytes())
    digest.update(" ".join([*_OPT_FLAGS, *_LINK_FLAGS]).encode())
    # A library built against another torch would load against a different ABI.
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:10]


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; a server started as ``.venv/bin/genserve`` without the
    venv activated has the pip-installed one (a dependency) only in the venv."""
    if shutil.which("ninja") is None:
        import ninja  # type: ignore[import-untyped]

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def load() -> bool:
    """True when the CPU kernels are enabled and ``torch.ops.genserve`` has them: builds (if
    needed) and loads the library on the first call, answers from that outcome afterwards."""
    if not _settings.enabled:
        return False
    if _settings.loaded is None:
        _settings.loaded = _build_and_load()
    return _settings.loaded


def enabled_and_loaded() -> bool:
    """True when an earlier :func:`load` has loaded the kernels (never builds them): for
    callers, like the sampler, that use them where the model already does."""
    return _settings.enabled and _settings.loaded is True


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """True when the kernels serve a model on ``device`` in ``dtype``: CPU in float32,
    bfloat16 or float16 (widened to float32 in registers, as bfloat16 is), enabled, and
    loaded (see :func:`load`).  In float32 they differ from the torch
    ops only in the order of float32 sums (norm, attention) and the last bit of silu's exp,
    which keeps greedy output equal to transformers' (tests/e2e/test_hf_parity.py)."""
    return (
        device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16) and load()
    )


# Where ``python -m genserve.kernels.cpu`` (scripts/bootstrap.sh, an image's build step) builds
# by default, the environment's cache: a server whose --genserve-cache points elsewhere (a
# Kubernetes pod's writable volume, a test's fresh cache) loads a build found here instead of
# compiling.
_DEFAULT_CACHE_DIR = _settings.cache_dir


def _library(directory: Path, name: str) -> Path:
    return directory / f"{name}.so"


def _build_directory(name: str) -> Path:
    """The configured cache's directory for ``name``, unless only the default cache (the
    bootstrap's) holds a finished build of it."""
    configured = _settings.cache_dir / name
    prebuilt = _DEFAULT_CACHE_DIR / name
    if not _library(configured, name).is_file() and _library(prebuilt, name).is_file():
        return prebuilt
    return configured


def _load_finished(library: Path) -> bool:
    """Load a finished build as it is, without running ninja: its name hashes every source,
    header and flag and the torch version, so it is this code's build.  ninja would rebuild
    it whenever the paths it was compiled from differ (a second checkout of the same code,
    torch imported through another path to the same virtual environment), under a lock
    every server starting meanwhile waits on.  False when the file does not load (a link cut
    short by a kill): it is built again."""
    try:
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except OSError as exc:
        log.warning("cpu_kernels_rebuild", library=str(library), error=str(exc)[:300])
        return False
    return True


def _library_name(level: str) -> str:
    return f"genserve_cpu_kernels_{level.lower()}_{_content_hash()}"


def library_path() -> Path:
    """The library this process builds or loads: the configured level (a mask hiding
    ``avx512f`` makes it AVX2) and the cache directory that holds, or will hold, it."""
    name = _library_name(_isa_level())
    return _library(_build_directory(name), name)


def _build_and_load() -> bool:
    level = _isa_level()
    name = _library_name(level)
    directory = _build_directory(name)
    compiled = not _library(directory, name).is_file()
    started = time.monotonic()
    if compiled:
        log.info("cpu_kernels_compiling", directory=str(directory), hint=_BOOTSTRAP_HINT)
    try:
        if compiled or not _load_finished(_library(directory, name)):
            from torch.utils import cpp_extension

            _put_ninja_on_path()
            directory.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in _SOURCES],
                extra_cflags=[*_OPT_FLAGS, *_ISA_FLAGS.get(level, [])],
                extra_include_paths=[str(_SOURCES[0].parent)],
                extra_ldflags=_LINK_FLAGS,
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
        for op in (*_OPS, *_LORA_OPS):
            getattr(torch.ops.genserve, op)  # raises if the library did not register it
        torch.ops.genserve.set_batch_invariant(_settings.batch_invariant)
        torch.ops.genserve.set_hidden_cpu_features(list(_settings.hidden_features))
    except Exception as exc:  # any failure: keep the torch path, say why once
        log.warning(
            "cpu_kernels_unavailable",
            error=f"{type(exc).__name__}: {str(exc).strip()[:500]}",
            fallback="torch ops",
        )
        return False
    log.info(
        "cpu_kernels_loaded",
        isa=level,
        hidden_features=",".join(_settings.hidden_features) or None,
        directory=str(directory),
        compiled=compiled,
        seconds=round(time.monotonic() - started, 2),
    )
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Build the kernels now (bootstrap); exit status 0 either way, the server falls back.
    A mask (``--cpu-features-mask``, default ``$GENSERVE_CPU_FEATURES_MASK``) builds the
    library a server started with that mask loads: ``avx2`` builds the AVX2-level one."""
    from genserve.kernels.cpu_features import parse_mask

    parser = argparse.ArgumentParser(description="Build genserve's CPU kernels into the cache.")
    # Default $GENSERVE_CACHE/kernels (config.environment_cache): where a server started in the
    # same environment looks.
    parser.add_argument("--cache-dir", type=Path, default=_settings.cache_dir)
    parser.add_argument(
        "--cpu-features-mask",
        default=os.environ.get("GENSERVE_CPU_FEATURES_MASK", ""),
        help="CPU features the kernels treat as absent, as the server's --cpu-features-mask "
        "(kernels/cpu_features.py): avx2 builds the AVX2-level library",
    )
    args = parser.parse_args(argv)
    try:
        hidden = parse_mask(args.cpu_features_mask)
    except ValueError as exc:  # a typo must not build the full CPU's library under its label
        parser.error(f"--cpu-features-mask: {exc}")
    configure(args.cache_dir, hidden_features=hidden)
    ok = load()
    print(f"genserve CPU kernels: {'ready' if ok else 'unavailable (torch fallback)'}")
    print(f"level {_isa_level()}, library {library_path()}")
    if hidden:
        print(f"hidden CPU features: {','.join(hidden)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
