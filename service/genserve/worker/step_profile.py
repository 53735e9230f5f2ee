"""Where a decode step's time goes: the torch profiler's per-op times folded into the parts
of a Llama step (projections, LM head, attention, norms, elementwise ops, sampler), and what
is left of the wall time, which is Python and dispatch between the ops.

Used by ``python -m genserve.worker.runner_bench --profile``.  The profiler adds a few
microseconds per op, so the "Python / dispatch" share is an upper bound; the op shares are
what the kernels themselves took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.profiler import ProfilerActivity, profile, record_function

if TYPE_CHECKING:
    from genserve.worker.model_runner import ModelRunner

# Op name (without the "aten::"/"genserve::" namespace) -> part of the step.  Ops not named
# here count as "other ops".
_PARTS: dict[str, str] = {
    # A decode-only CPU step runs each layer as one op (kernels/decode_layer_cpu.cpp), whose
    # parts the profiler does not see.
    "decode_layer": "decoder layers (one op each)",
    # A MoE layer's attention half (one op; its router and experts are profiled as ops).
    "decode_attention": "attention halves of MoE layers (one op each)",
    **dict.fromkeys(
        ("mm", "addmm", "matvec", "panel_linear", "qpanel_linear", "_linear_pointwise", "bmm"),
        "projections",
    ),
    **dict.fromkeys(
        (
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_attention_math",
            "paged_decode_attention",
            "index_copy_",
            "index_select",
            "softmax",
            "_softmax",
        ),
        "attention (+KV write)",
    ),
    **dict.fromkeys(
        ("_fused_rms_norm", "rms_norm", "add_rms_norm", "pow", "mean", "rsqrt"), "norms"
    ),
    **dict.fromkeys(
        ("silu", "silu_and_mul", "mul", "add", "flip", "rotary", "cat", "neg_", "sin", "cos"),
        "rotary / activation / residual",
    ),
}

_SAMPLER = "genserve.sampler"
_LM_HEAD = "genserve.lm_head"


@dataclass(frozen=True, slots=True)
class StepProfile:
    wall_s: float  # profiled wall time, all steps
    steps: int
    parts_s: dict[str, float]  # summed self time of the ops of each part

    def table(self, title: str) -> str:
        lines = [f"{title}: {self.wall_s / self.steps * 1000:.1f} ms/step under the profiler"]
        accounted = 0.0
        for name, seconds in sorted(self.parts_s.items(), key=lambda kv: -kv[1]):
            accounted += seconds
            lines.append(f"  {name:32} {seconds / self.wall_s * 100:5.1f}%")
        rest = max(0.0, self.wall_s - accounted)
        lines.append(f"  {'Python / dispatch (rest)':32} {rest / self.wall_s * 100:5.1f}%")
        return "\n".join(lines)


@contextmanager
def _labelled(obj: object, attr: str, label: str) -> Iterator[None]:
    """Wrap ``obj.attr`` (a method) in a profiler range named ``label`` for the duration."""
    original: Callable[..., object] = getattr(obj, attr)
    own = attr in vars(obj)  # an instance attribute to put back, else the class's method

    def wrapped(*args: object, **kwargs: object) -> object:
        with record_function(label):
            return original(*args, **kwargs)

    setattr(obj, attr, wrapped)
    try:
        yield
    finally:
        if own:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)


class StepProfiler:
    """``with StepProfiler(runner) as p: <decode steps>``, then ``p.result(steps)``."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._stack = ExitStack()
        self._prof: profile | None = None
        self._wall = 0.0
        self._start = 0.0

    def __enter__(self) -> StepProfiler:
        model = self._runner.model
        self._stack.enter_context(_labelled(self._runner, "_sample", _SAMPLER))
        self._stack.enter_context(_labelled(model, "compute_logits", _LM_HEAD))
        self._prof = self._stack.enter_context(profile(activities=[ProfilerActivity.CPU]))
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wall = time.perf_counter() - self._start
        self._stack.close()

    def result(self, steps: int) -> StepProfile:
        assert self._prof is not None, "use StepProfiler as a context manager first"
        parts: dict[str, float] = {}
        in_labels: dict[str, float] = {}
        for event in self._prof.events():  # type: ignore[no-untyped-call]
            if event.name in (_SAMPLER, _LM_HEAD):
                continue
            seconds = event.self_cpu_time_total / 1e6
            label = _enclosing_label(event)
            if label is not None:  # every op under the sampler / LM head range counts there
                in_labels[label] = in_labels.get(label, 0.0) + seconds
                continue
            if "::" not in event.name:
                continue  # Python-level ranges
            part = _PARTS.get(event.name.split("::")[-1], "other ops")
            parts[part] = parts.get(part, 0.0) + seconds
        parts["sampler"] = in_labels.get(_SAMPLER, 0.0)
        parts["final norm + LM head"] = in_labels.get(_LM_HEAD, 0.0)
        return StepProfile(self._wall, steps, parts)


def _enclosing_label(event: object) -> str | None:
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name in (_SAMPLER, _LM_HEAD):
            return str(parent.name)
        parent = getattr(parent, "cpu_parent", None)
    return None
