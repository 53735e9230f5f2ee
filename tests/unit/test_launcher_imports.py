"""The launcher imports no torch (nor numpy, safetensors, transformers) at import time:
`genserve --help` and a bad flag answer in well under a second, and a server opens its port
(health NOT_SERVING) before the ~2-3 s torch import, which the model load then pays."""

from __future__ import annotations

import subprocess
import sys

_HEAVY = ("torch", "numpy", "safetensors", "transformers")


def test_importing_the_launcher_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import genserve.cli\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {_HEAVY!r})\n"
        "assert not heavy, heavy[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_and_a_bad_flag_never_import_torch() -> None:
    # Blocks the imports outright: if --help or the argument error reached one, the process
    # would fail with ImportError instead of printing usage.
    code = (
        "import sys\n"
        f"for name in {_HEAVY!r}:\n"
        "    sys.modules[name] = None\n"
        "from genserve.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    usage = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True)
    assert usage.returncode == 0, usage.stderr
    assert "--max-total-tokens" in usage.stdout
    bad = subprocess.run(
        [sys.executable, "-c", code, "--max-total-tokens", "x"], capture_output=True, text=True
    )
    assert bad.returncode == 2, bad.stderr
    assert "--max-total-tokens" in bad.stderr and "ImportError" not in bad.stderr
