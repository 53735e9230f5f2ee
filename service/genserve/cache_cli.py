"""``genserve cache``: list and prune the model cache (after ``huggingface-cli scan-cache`` and
``delete-cache``).

    genserve cache list [--json]
    genserve cache prune (--all | --older-than DAYS | ENTRY ...) [--dry-run] [--json]

``ENTRY`` is an entry's directory name (``gguf-3f2a…``) or a prefix of its digest
(``3f2a``).  The cache is ``$GENSERVE_CACHE/models`` (``--genserve-cache`` otherwise as for
``genserve`` itself, default ``~/.cache/genserve``).  Pruning never touches an entry being
built, and interrupted builds' leftovers are removed on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from genserve.model.model_cache import CacheEntry, clean_interrupted, list_entries, remove_entry


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{size} B"
        value /= 1024
    raise AssertionError


def _as_json(entry: CacheEntry) -> dict[str, object]:
    return {
        "name": entry.name,
        "path": str(entry.path),
        "kind": entry.kind,
        "size_bytes": entry.size_bytes,
        "last_used": entry.last_used,
        "sources": list(entry.sources),
    }


def _print_table(entries: list[CacheEntry]) -> None:
    now = time.time()
    rows = [("ENTRY", "KIND", "SIZE", "LAST USED", "SOURCES")]
    for e in entries:
        days = (now - e.last_used) / 86400
        rows.append(
            (e.name, e.kind, _human(e.size_bytes), f"{days:.1f} days ago", ", ".join(e.sources))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4])
    total = sum(e.size_bytes for e in entries)
    print(f"\n{len(entries)} entries, {_human(total)} in all")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="genserve cache", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--genserve-cache",
        type=Path,
        default=Path(os.environ.get("GENSERVE_CACHE", Path.home() / ".cache" / "genserve")),
        help="genserve's cache directory (models are under its models/).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="Entries with their sizes, last use and sources.")
    ls.add_argument("--json", action="store_true", help="One JSON object per entry.")
    prune = sub.add_parser("prune", help="Delete entries.")
    which = prune.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="Every entry.")
    which.add_argument(
        "--older-than", type=float, metavar="DAYS", help="Entries not used for DAYS days."
    )
    which.add_argument("entries", nargs="*", default=[], metavar="ENTRY")
    prune.add_argument("--dry-run", action="store_true", help="Say what would go; delete nothing.")
    prune.add_argument("--json", action="store_true", help="One JSON object per entry removed.")
    return p


def _select(entries: list[CacheEntry], args: argparse.Namespace) -> list[CacheEntry]:
    if args.all:
        return entries
    if args.older_than is not None:
        cutoff = time.time() - args.older_than * 86400
        return [e for e in entries if e.last_used < cutoff]
    chosen: list[CacheEntry] = []
    for wanted in args.entries:
        matches = [
            e for e in entries if e.name == wanted or e.name.split("-", 1)[-1].startswith(wanted)
        ]
        if len(matches) != 1:
            found = "no entry" if not matches else f"{len(matches)} entries"
            raise SystemExit(f"genserve cache prune: {found} match {wanted!r}")
        chosen += matches
    return chosen


def main(argv: Sequence[str]) -> int:
    """Run ``genserve cache ARGS``; returns the exit status."""
    args = _parser().parse_args(list(argv))
    if args.command == "prune" and not (args.entries or args.all or args.older_than is not None):
        raise SystemExit("genserve cache prune: name entries, or give --all or --older-than")
    cache = args.genserve_cache / "models"
    if cache.is_dir():
        clean_interrupted(cache)
    entries = list_entries(cache)
    if args.command == "list":
        if args.json:
            for e in entries:
                print(json.dumps(_as_json(e)))
        else:
            _print_table(entries)
        return 0
    chosen = _select(entries, args)
    for e in chosen:
        if not args.dry_run:
            remove_entry(e)
        if args.json:
            print(json.dumps({**_as_json(e), "removed": not args.dry_run}))
        else:
            verb = "would remove" if args.dry_run else "removed"
            print(f"{verb} {e.name} ({_human(e.size_bytes)})")
    if not args.json:
        freed = sum(e.size_bytes for e in chosen)
        print(f"{'would free' if args.dry_run else 'freed'} {_human(freed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
