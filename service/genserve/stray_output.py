"""``--json-output``: every line the process writes on stdout and stderr is one JSON object.

genserve's own log lines are JSON already (``genserve.logging``), and so are Python warnings
and standard-library loggers once routed through it.  What is left writes to the file
descriptors directly: progress bars (tqdm, which redraws with ``\\r``), a library's
``print``, C++ warnings from torch or gloo, the shard workers' output, an interpreter
traceback.  :func:`capture` points descriptors 1 and 2 at pipes; a thread per pipe passes a
line that is a JSON object through unchanged and wraps any other line into one
(``{"event": "stray_output", "stream": "stderr", "text": ...}``), so a log collector never
sees a line it cannot parse.  :meth:`StrayOutput.close` restores the descriptors and writes
what is still buffered (call it before ``os._exit``)."""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
from datetime import UTC, datetime

_LINE_BREAK = re.compile(rb"[\r\n]+")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # tqdm's cursor moves between redraws


def _is_json_object(line: bytes) -> bool:
    if not (line.startswith(b"{") and line.endswith(b"}")):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def as_json_line(line: bytes, stream: str) -> bytes:
    """``line`` (no line break) itself when it is a JSON object, else a JSON object holding
    it; with a line break.  A log line written after a progress bar that left no line break
    (``done{"event": ...}``) becomes two: the bar's text, then the log line."""
    if _is_json_object(line):
        return line + b"\n"
    start = line.find(b'{"', 1)
    if start > 0 and _is_json_object(line[start:]):
        return as_json_line(line[:start], stream) + line[start:] + b"\n"
    text = _ANSI.sub("", line.decode("utf-8", errors="replace")).strip()
    record = {
        "event": "stray_output",
        "stream": stream,
        "text": text,
        "level": "warning" if stream == "stderr" else "info",
        "logger": stream,
        "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }
    return json.dumps(record, ensure_ascii=False).encode() + b"\n"


class StrayOutput:
    """Descriptors 1 and 2 captured (see the module docstring)."""

    def __init__(self) -> None:
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            sys.stdout.flush()
            sys.stderr.flush()
            real = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            self._saved[fd] = real
            thread = threading.Thread(
                target=self._pump, args=(read_end, real, stream), name=f"json-{stream}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        # An uncaught exception's traceback is printed before atexit runs: it gets through.
        atexit.register(self.close)

    @staticmethod
    def _pump(read_end: int, real: int, stream: str) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(read_end, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *lines, pending = _LINE_BREAK.split(pending + chunk)
            out = b"".join(as_json_line(line, stream) for line in lines if line.strip())
            if out:
                os.write(real, out)
        if pending.strip():
            os.write(real, as_json_line(pending, stream))
        os.close(read_end)

    def close(self, timeout_s: float = 1.0) -> None:
        """Put the real descriptors back and wait (up to ``timeout_s``) for the pipes to be
        drained; a child process still holding a pipe open only shortens the wait.  Once."""
        if self._closed:
            return
        self._closed = True
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, real in self._saved.items():
            os.dup2(real, fd)  # closes the pipe's write end held at fd
        for thread in self._threads:
            thread.join(timeout_s)


def capture() -> StrayOutput:
    """Start capturing stdout and stderr (see the module docstring)."""
    return StrayOutput()
