"""structlog set-up: a human-readable console by default, one JSON object per line with
``--json-output``.  Standard-library loggers (grpc, transformers) go through the same
renderer so a log collector sees one format.

Request context comes from context variables, so no call site has to pass it: the servicer
binds ``req_id`` for the task serving a request (:func:`bind_request_id`), and when the
request is traced, every line also carries the current span's ``trace_id`` and ``span_id``
(W3C hex, the ids a trace backend shows).  Prompts and generated text are only ever logged
when the operator asked for it (``--log-requests``); that decision lives with the caller."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace


def add_trace_context(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: ``trace_id``/``span_id`` of the current span, if it is valid.

    Without tracing the current span is OpenTelemetry's invalid no-op span, so this adds
    nothing and costs one context-variable read."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def bind_request_id(req_id: str) -> None:
    """Every later log line of the current asyncio task carries ``req_id``.

    Deliberately not undone: each gRPC call (and each sequence of a multi-input call) runs in
    a task of its own whose context ends with it, and resetting a context-variable token from
    an async generator finalised elsewhere would fail."""
    structlog.contextvars.bind_contextvars(req_id=req_id)


_json_output = False


def progress_bars() -> bool:
    """Whether progress may be drawn as bars: only on a terminal, and never with
    ``--json-output`` (where every line on stdout/stderr must be one JSON object, so progress
    is logged as events instead)."""
    return not _json_output and sys.stderr.isatty()


def configure_logging(json_output: bool, level: int = logging.INFO) -> None:
    global _json_output
    _json_output = json_output
    if json_output:
        # Libraries draw their own bars (huggingface_hub downloads, transformers' GGUF
        # reader): off, before they are imported.  Python warnings become log records.
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        logging.captureWarnings(True)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        add_trace_context,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if json_output:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("urllib3", "filelock", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # warnings.warn (torch's, transformers') becomes a "py.warnings" log record, so it is
    # rendered like every other line instead of printed raw to stderr.
    logging.captureWarnings(True)
    _route_transformers_logging()


def _route_transformers_logging() -> None:
    """transformers logs through a handler of its own that writes plain text to stderr and
    does not propagate: hand its records to the root handler above instead."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the client-only install has no transformers
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
