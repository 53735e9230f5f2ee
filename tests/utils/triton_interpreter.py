"""Triton's interpreter for the CPU tests of genserve's Triton kernels
(``tests/unit/test_triton_*.py``).

``TRITON_INTERPRET=1`` must be set before Triton is imported, and the test process has
imported it already (or must not: the model code would then pick the interpreted kernels),
so the interpreted checks run in another Python process.  Starting one (torch, transformers,
Triton, genserve) costs seconds of CPU, so one worker process serves every check of the
session: ``TritonInterpreter.run(code, *args)`` executes ``code`` there as ``python -c code
args...`` would (``sys.argv[1:]`` are the arguments) and fails the calling test with the
check's traceback and the worker's output.  A worker that dies or overruns is replaced for
the next check.  Torch's global RNG is reset to its start-up seed before every check, so
a check sees the same global state as in a fresh process (the checks use their own
generators anyway).

    @needs_triton
    def test_kernel(triton_interpreter: TritonInterpreter) -> None:
        triton_interpreter.run("from tests.unit.test_x import check; check()")
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (CPU-only torch wheels do not ship it)",
)

# The worker: one JSON request a line on stdin ({"code", "args"}), one JSON reply a line on
# the original stdout ({"ok", "error"}); what the checks print goes to stderr (a file).
_WORKER = r"""
import json, os, sys, traceback
import torch
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
seed = torch.initial_seed()
for line in sys.stdin:
    request = json.loads(line)
    sys.argv = ["-c", *request["args"]]
    torch.manual_seed(seed)
    try:
        exec(compile(request["code"], "<check>", "exec"), {"__name__": "__main__"})
        result = {"ok": True, "error": ""}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    sys.stderr.flush()
    reply.write(json.dumps(result) + "\n")
    reply.flush()
"""


class TritonInterpreter:
    """A Python process with ``TRITON_INTERPRET=1`` and the repository root on its path,
    started on the first ``run`` and restarted after a crash or a timeout."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None

    def run(self, code: str, *args: str) -> None:
        """Execute ``code`` with ``sys.argv[1:] == args`` in the worker; ``pytest.fail``
        with its traceback (and the worker's output) when it raises, dies or overruns."""
        proc = self._worker()
        assert proc.stdin is not None and proc.stdout is not None
        log_start = self._log_size()
        try:
            proc.stdin.write(json.dumps({"code": code, "args": list(args)}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; reading the reply reports how
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            if ready:  # end of file: it exited (or is exiting)
                try:
                    why = f"died (exit {proc.wait(10)})"
                except subprocess.TimeoutExpired:
                    why = "closed its output"
            else:
                why = f"timed out after {self.timeout_s:g} s"
            output = self._output(log_start)
            self.close()
            pytest.fail(f"the Triton interpreter process {why}:\n{output}")
        result = json.loads(line)
        if not result["ok"]:
            pytest.fail(f"{result['error']}\n--- worker output ---\n{self._output(log_start)}")

    def close(self) -> None:
        """Stop the worker (the next ``run`` starts a new one)."""
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _worker(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.close()
        # The repository root (for ``tests``) before the caller's path, which may name a
        # checkout's ``service`` directory ahead of an installed genserve.
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
        # Append mode: the worker writes at the end whatever this process last read.  It
        # lives as long as the worker (closed in close()), not one block.
        self._log = tempfile.TemporaryFile("a+", prefix="triton-interpreter-")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        return self._proc

    def _log_size(self) -> int:
        assert self._log is not None
        return self._log.seek(0, os.SEEK_END)

    def _output(self, start: int, limit: int = 20000) -> str:
        """What the worker printed since ``start`` (its last ``limit`` characters)."""
        if self._log is None:
            return ""
        self._log.seek(start)
        return self._log.read()[-limit:]
