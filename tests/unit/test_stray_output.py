"""--json-output's capture of stdout/stderr: what bypasses the logger (a print, a progress bar
redrawn with carriage returns, a C-level write, a child process) comes out as JSON objects,
and JSON lines pass through unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from genserve.stray_output import as_json_line

_CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, warnings
    from genserve.stray_output import capture
    from genserve.logging import configure_logging
    stray = capture()
    configure_logging(True)
    print("plain print")
    os.write(2, b"bar  10%\\rbar  50%\\rbar 100%\\n\\x1b[Adone")
    warnings.warn("a library warning")
    subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
    import structlog
    structlog.get_logger("t").info("structured", n=1)
    stray.close()
    """
)


def test_every_line_is_a_json_object(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, check=True, timeout=120
    )
    lines = [*done.stdout.decode().splitlines(), *done.stderr.decode().splitlines()]
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) for r in records)
    texts = [r.get("text") for r in records if r.get("event") == "stray_output"]
    for expected in ("plain print", "bar  10%", "bar 100%", "done", "from a child"):
        assert expected in texts
    assert any("a library warning" in str(r.get("event")) for r in records)
    assert any(r.get("event") == "structured" and r.get("n") == 1 for r in records)
    # stdout stays stdout
    assert "plain print" in done.stdout.decode()


def test_a_crash_traceback_comes_out_as_json() -> None:
    child = "from genserve.stray_output import capture\ncapture()\nraise SystemError('boom')\n"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
    assert done.returncode != 0
    records = [json.loads(line) for line in done.stderr.decode().splitlines()]
    assert any("SystemError: boom" in r["text"] for r in records)


def test_json_lines_pass_through() -> None:
    line = b'{"event": "x", "level": "info"}'
    assert as_json_line(line, "stderr") == line + b"\n"
    wrapped = json.loads(as_json_line(b"{not json", "stdout"))
    assert wrapped["text"] == "{not json" and wrapped["stream"] == "stdout"
