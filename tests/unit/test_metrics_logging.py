"""genserve.logging: one JSON object per line with --json-output, each request's lines carry
its req_id and, when traced, the trace_id/span_id of the current span; prompts and outputs
appear only with --log-requests.  Run in a subprocess: structlog's configuration is global
and caches loggers, so configuring it here would leak into other tests."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

SCRIPT = textwrap.dedent(
    """
    import contextvars
    import sys
    from opentelemetry.sdk.trace import TracerProvider
    from genserve.engine.outputs import FinalInfo, GenerationRequest
    from genserve.engine.request import FinishReason, StoppingCriteria
    from genserve.logging import configure_logging
    from genserve.server.observe import RequestObserver, bind_call
    from genserve.step import SamplingParams

    json_output, log_requests = sys.argv[1] == "json", sys.argv[2] == "log"
    configure_logging(json_output)
    tracer = TracerProvider().get_tracer("t")
    observer = RequestObserver(tracer=tracer, log_requests=log_requests)
    def handle():  # as gRPC does: each call runs in a context of its own
        with tracer.start_as_current_span("rpc") as span:
            ctx = span.get_span_context()
            print(format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"), flush=True)
            bind_call("call-1")
            req = observer.validate(
                "call-1", "SECRET PROMPT",
                lambda: GenerationRequest(
                    "call-1", (1, 2, 3), SamplingParams(), StoppingCriteria(max_new_tokens=2)
                ),
            )
            with observer.track(req) as record:
                record.finished(FinalInfo(FinishReason.LENGTH, "SECRET OUTPUT", 2, 3, 0, 0))

    contextvars.copy_context().run(handle)
    import structlog
    structlog.get_logger("other").info("no_request_here")
    """
)


def run(json_output: bool, log_requests: bool) -> tuple[str, str, str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            "json" if json_output else "console",
            "log" if log_requests else "quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    trace_id, span_id = proc.stdout.split()
    return trace_id, span_id, proc.stderr


def test_json_lines_carry_request_and_trace_ids() -> None:
    trace_id, span_id, stderr = run(json_output=True, log_requests=False)
    lines: list[dict[str, Any]] = [json.loads(line) for line in stderr.splitlines()]
    (finished,) = (line for line in lines if line["event"] == "request_finished")
    assert finished["req_id"] == "call-1"
    assert finished["trace_id"] == trace_id and finished["span_id"] == span_id
    assert finished["outcome"] == "length" and finished["generated_tokens"] == 2
    assert finished["level"] == "info" and "timestamp" in finished
    (other,) = (line for line in lines if line["event"] == "no_request_here")
    assert "req_id" not in other and "trace_id" not in other
    assert "SECRET" not in stderr  # no --log-requests: no prompt, no output


def test_log_requests_adds_prompt_and_output() -> None:
    _, _, stderr = run(json_output=True, log_requests=True)
    lines = [json.loads(line) for line in stderr.splitlines()]
    (received,) = (line for line in lines if line["event"] == "request_received")
    (finished,) = (line for line in lines if line["event"] == "request_finished")
    assert received["inputs"] == "SECRET PROMPT" and received["req_id"] == "call-1"
    assert finished["generated_text"] == "SECRET OUTPUT"


def test_console_is_the_default_format() -> None:
    trace_id, _, stderr = run(json_output=False, log_requests=False)
    (line,) = (line for line in stderr.splitlines() if "request_finished" in line)
    assert not line.startswith("{")
    assert "req_id=call-1" in line and f"trace_id={trace_id}" in line
