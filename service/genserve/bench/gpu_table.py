"""Merge ``genserve-bench`` result files (one per model shape) into the GPU table of issue #12:
per stream count, genserve's throughput and ITL next to transformers eager ``generate()`` and
static cache + ``torch.compile``, with the ratios the targets are stated in.

    python -m genserve.bench.gpu_table --out DIR NAME=results.json [NAME=results.json ...]

writes ``DIR/gpu-table.md`` and ``DIR/gpu-table.json`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_BASELINES = {
    "hf_generate": "hf_eager",
    "hf_static": "hf_static",
    "hf_static_compile": "hf_compile",
}


def rows_of(name: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per concurrency of ``results`` (a results.json): genserve and each baseline's
    throughput at the same batch/stream count."""
    by_conc: dict[int, dict[str, Any]] = {}
    for s in results.get("genserve", []):
        row = by_conc.setdefault(int(s["concurrency"]), {"model": name})
        row["genserve_tok_s"] = s["throughput_tok_s"]
        row["genserve_itl_p50_ms"] = (s.get("itl_ms") or {}).get("p50")
        row["genserve_ttft_steady_p50_ms"] = (s.get("ttft_steady_ms") or {}).get("p50")
    for b in results.get("baselines", []):
        key = _BASELINES.get(b["system"])
        if key is not None:
            by_conc.setdefault(int(b["concurrency"]), {"model": name})[f"{key}_tok_s"] = b[
                "throughput_tok_s"
            ]
    return [{"streams": conc, **by_conc[conc]} for conc in sorted(by_conc)]


def add_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """genserve's throughput over each baseline's at the same stream count/batch."""
    out = []
    for row in rows:
        row = dict(row)
        g = row.get("genserve_tok_s")
        for key in _BASELINES.values():
            base = row.get(f"{key}_tok_s")
            if g is not None and base:
                row[f"x_{key}"] = g / base
        out.append(row)
    return out


def merge_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of several result files of one model (e.g. a run with the eager baseline and one
    with the compiled one) merged per stream count; the first file's value of a field wins."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        into = merged.setdefault((row["model"], row["streams"]), {})
        for key, value in row.items():
            into.setdefault(key, value)
    return list(merged.values())


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:,.{digits}f}" if isinstance(value, float | int) else str(value)


def to_markdown(rows: Sequence[dict[str, Any]], device: str) -> str:
    head = (
        f"GPU: {device}\n\n| model | streams | genserve tok/s | ITL p50 ms | steady TTFT p50 ms "
        "| HF eager tok/s | HF static+compile tok/s | x eager | x compile |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['model']} | {r['streams']} | {_fmt(r.get('genserve_tok_s'))} "
        f"| {_fmt(r.get('genserve_itl_p50_ms'), 1)} | {_fmt(r.get('genserve_ttft_steady_p50_ms'))} "
        f"| {_fmt(r.get('hf_eager_tok_s'))} | {_fmt(r.get('hf_compile_tok_s'))} "
        f"| {_fmt(r.get('x_hf_eager'), 2)} | {_fmt(r.get('x_hf_compile'), 2)} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m genserve.bench.gpu_table")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="", help="the GPU's name, for the table header")
    p.add_argument("runs", nargs="+", help="NAME=path/to/results.json")
    ns = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for spec in ns.runs:
        name, _, path = spec.partition("=")
        if not path:
            p.error(f"expected NAME=results.json, got {spec!r}")
        file = Path(path)
        if not file.exists():  # a failed level run: keep the others' rows
            rows.append({"model": name, "streams": 0, "error": f"{file} missing"})
            continue
        rows += rows_of(name, json.loads(file.read_text()))
    rows = add_ratios(merge_rows(rows))
    ns.out.mkdir(parents=True, exist_ok=True)
    markdown = to_markdown([r for r in rows if "error" not in r], ns.device)
    (ns.out / "gpu-table.md").write_text(markdown)
    (ns.out / "gpu-table.json").write_text(
        json.dumps({"device": ns.device, "rows": rows}, indent=1)
    )
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
