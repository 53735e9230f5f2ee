"""The model cache: one entry per GGUF content whatever the file is called, interrupted builds
cleaned up at the next start, and ``genserve cache list`` / ``prune``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from genserve import cache_cli
from genserve.model import conversion, model_cache
from genserve.model.loader import resolve_model
from genserve.testing.tiny_gguf import make_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0", seed=5)


def test_same_gguf_under_two_names_is_one_entry(tiny_gguf: Path, tmp_path: Path) -> None:
    other = tmp_path / "renamed-copy.gguf"
    shutil.copyfile(tiny_gguf, other)
    cache = tmp_path / "models"
    first = resolve_model(str(tiny_gguf), cache_dir=cache)
    record = cache / first.local_dir.name / model_cache.ENTRY_FILE
    built = record.stat().st_mtime_ns
    second = resolve_model(str(other), cache_dir=cache)
    assert second.local_dir == first.local_dir and second.revision == first.revision
    assert first.local_dir.name == f"gguf-{first.revision.removeprefix('sha256-sampled:')}"
    (entry,) = model_cache.list_entries(cache)
    assert set(entry.sources) == {str(tiny_gguf.resolve()), str(other.resolve())}
    assert json.loads(record.read_text())["created"] * 1e9 <= built  # not rebuilt


@pytest.mark.parametrize(
    "damage",
    ["truncate tokenizer", "overwrite config", "delete tokenizer", "garbage record", "no config"],
)
def test_damaged_entry_is_rebuilt_not_fatal(tiny_gguf: Path, tmp_path: Path, damage: str) -> None:
    """A cache entry cut short or overwritten is rebuilt at the next start (#28), and the
    model loads from it."""
    from genserve.tokenizer import Tokenizer

    cache = tmp_path / "models"
    entry = resolve_model(str(tiny_gguf), cache_dir=cache).local_dir
    good = {name: (entry / name).read_bytes() for name in ("config.json", "tokenizer.json")}
    tokenizer, config = entry / "tokenizer.json", entry / "config.json"
    if damage == "truncate tokenizer":
        tokenizer.write_bytes(good["tokenizer.json"][:100])
    elif damage == "overwrite config":  # same size, other bytes: only the digest tells
        config.write_bytes(b" " * len(good["config.json"]))
    elif damage == "delete tokenizer":
        tokenizer.unlink()
    elif damage == "garbage record":
        (entry / model_cache.ENTRY_FILE).write_text("{not json")
    else:
        config.unlink()
    assert not model_cache.is_current(entry, conversion.GGUF_ENTRY_VERSION)
    again = resolve_model(str(tiny_gguf), cache_dir=cache).local_dir
    assert again == entry
    assert {name: (entry / name).read_bytes() for name in good} == good
    assert model_cache.is_current(entry, conversion.GGUF_ENTRY_VERSION)
    assert Tokenizer(entry).vocab_size > 0


def test_cut_digest_memo_is_recomputed(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "models"
    first = resolve_model(str(tiny_gguf), cache_dir=cache)
    (memo,) = model_cache.digest_memo_dir(cache).glob("*.txt")
    memo.write_text(memo.read_text()[:10])
    assert resolve_model(str(tiny_gguf), cache_dir=cache).revision == first.revision
    assert len(memo.read_text()) == 64


def test_sampled_digest_sees_header_and_weights(tiny_gguf: Path, tmp_path: Path) -> None:
    """The digest covers the header in full and samples the tensor data: a change in either
    is another file (the trade-off: bytes between samples are not read)."""
    from genserve.model.file_identity import sampled_digest
    from genserve.model.gguf_index import GGUFIndex

    base = sampled_digest(tiny_gguf)
    data = bytearray(tiny_gguf.read_bytes())
    start = min(int(t.data_offset) for t in GGUFIndex(tiny_gguf).tensors)
    for at in (66, start, len(data) - 1):  # "llama" (the architecture), data start, last byte
        changed = tmp_path / f"changed-{at}.gguf"
        copy = bytearray(data)
        copy[at] ^= 0xFF
        changed.write_bytes(bytes(copy))
        assert sampled_digest(changed) != base, at


_KILLED_BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from genserve.model import model_cache

    def build(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half a file")
        print("building", flush=True)
        time.sleep(600)

    model_cache.build_once(Path(sys.argv[1]), build, "src")
    """
)


def _start_build(entry: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_BUILD, str(entry)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # log lines first
        if line.strip() == "building":
            return proc
    raise AssertionError(f"the build exited ({proc.wait()}) before building")


def test_killed_build_is_cleaned_up_at_the_next_start(tmp_path: Path) -> None:
    cache = tmp_path / "models"
    entry = cache / "gguf-0123456789abcdef"
    proc = _start_build(entry)
    try:
        # While the builder lives, its work is left alone.
        assert model_cache.clean_interrupted(cache) == []
        assert len(list((cache / ".tmp").iterdir())) == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (cache / ".locks" / f"{entry.name}.lock").is_file()  # what a kill leaves
    # The next start removes the temporary directory and the stale lock.
    removed = model_cache.clean_interrupted(cache)
    assert {p.parent.name for p in removed} == {".tmp", ".locks"}
    assert list((cache / ".tmp").iterdir()) == []
    assert list((cache / ".locks").iterdir()) == []
    # ...and a build of the same entry goes through.
    done = model_cache.build_once(entry, lambda out: (out / "config.json").write_text("{}"), "s")
    assert model_cache.is_complete(done)


def test_start_cleans_leftovers(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "models"
    proc = _start_build(cache / "gguf-fedcba9876543210")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Leftovers of older genserve versions (temporary directory and lock beside entries).
    (cache / ".tiny-0123456789abcdef.abc123").mkdir()
    (cache / ".tiny-0123456789abcdef.lock").write_text("")
    resolve_model(str(tiny_gguf), cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == [
        ".digests",
        ".locks",
        ".tmp",
        model_cache.list_entries(cache)[0].name,
    ]
    assert list((cache / ".tmp").iterdir()) == [] and list((cache / ".locks").iterdir()) == []


def _entry(cache: Path, name: str, size: int, age_days: float) -> Path:
    path = cache / name
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "blob").write_bytes(b"x" * size)
    (path / model_cache.ENTRY_FILE).write_text(json.dumps({"sources": [f"/m/{name}.gguf"]}))
    then = time.time() - age_days * 86400
    os.utime(path / model_cache.ENTRY_FILE, (then, then))
    return path


def test_cache_list_and_prune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "models"
    _entry(cache, "gguf-aaaa000000000000", 3000, age_days=40)
    _entry(cache, "gguf-bbbb000000000000", 2000, age_days=1)
    _entry(cache, "bin-cccc000000000000", 1000, age_days=10)
    root = ["--genserve-cache", str(tmp_path)]

    assert cache_cli.main([*root, "list", "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["name"] for e in listed] == [
        "gguf-aaaa000000000000",
        "gguf-bbbb000000000000",
        "bin-cccc000000000000",
    ]
    assert all(e["size_bytes"] > 1000 for e in listed)
    assert listed[0]["sources"] == ["/m/gguf-aaaa000000000000.gguf"]
    assert cache_cli.main([*root, "list"]) == 0
    table = capsys.readouterr().out
    assert "gguf-aaaa000000000000" in table and "3 entries" in table

    assert cache_cli.main([*root, "prune", "--older-than", "30", "--dry-run"]) == 0
    assert "would remove gguf-aaaa000000000000" in capsys.readouterr().out
    assert (cache / "gguf-aaaa000000000000").is_dir()
    assert cache_cli.main([*root, "prune", "--older-than", "30"]) == 0
    assert not (cache / "gguf-aaaa000000000000").exists()
    assert cache_cli.main([*root, "prune", "cccc"]) == 0  # a digest prefix
    assert not (cache / "bin-cccc000000000000").exists()
    with pytest.raises(SystemExit, match="no entry match"):
        cache_cli.main([*root, "prune", "dddd"])
    capsys.readouterr()
    assert cache_cli.main([*root, "prune", "--all", "--json"]) == 0
    (gone,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert gone["name"] == "gguf-bbbb000000000000" and gone["removed"] is True
    assert model_cache.list_entries(cache) == []


def test_genserve_cache_command(tmp_path: Path) -> None:
    _entry(tmp_path / "models", "gguf-eeee000000000000", 10, age_days=0)
    run = subprocess.run(
        [sys.executable, "-m", "genserve.cli", "cache", "--genserve-cache", str(tmp_path), "list"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=True,
    )
    assert "gguf-eeee000000000000" in run.stdout


def test_an_entry_of_an_older_format_is_rebuilt(tiny_gguf: Path, tmp_path: Path) -> None:
    """The key is the file's content, not the converter's code: an entry written by an older
    genserve (another format version, or none recorded) is replaced at the next start, not
    served with its stale config."""
    cache = tmp_path / "models"
    first = resolve_model(str(tiny_gguf), cache_dir=cache)
    entry = first.local_dir
    record = model_cache.read_record(entry)
    assert record["version"] == conversion.GGUF_ENTRY_VERSION
    # What an older genserve left: a config without this version's settings, no version.
    (entry / "config.json").write_text('{"stale": true}')
    del record["version"]
    (entry / model_cache.ENTRY_FILE).write_text(json.dumps(record))
    assert not model_cache.is_current(entry, conversion.GGUF_ENTRY_VERSION)
    again = resolve_model(str(tiny_gguf), cache_dir=cache)
    assert again.local_dir == entry
    assert "stale" not in json.loads((entry / "config.json").read_text())
    assert model_cache.read_record(entry)["version"] == conversion.GGUF_ENTRY_VERSION
    assert [e.name for e in model_cache.list_entries(cache)] == [entry.name]
    # A current entry is reused as it is.
    marker = entry / "config.json"
    before = marker.stat().st_mtime_ns
    resolve_model(str(tiny_gguf), cache_dir=cache)
    assert marker.stat().st_mtime_ns == before


def _stale_entry(tiny_gguf: Path, cache: Path) -> Path:
    """The entry of ``tiny_gguf`` as an older genserve (another format version) left it."""
    entry = resolve_model(str(tiny_gguf), cache_dir=cache).local_dir
    record = model_cache.read_record(entry)
    (entry / "config.json").write_text('{"stale": true}')
    record["version"] = conversion.GGUF_ENTRY_VERSION - 1
    record.pop("files", None)
    (entry / model_cache.ENTRY_FILE).write_text(json.dumps(record))
    return entry


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replacing_an_entry_never_pulls_it_from_a_reader(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """A process of another genserve version reading the old entry (by path, or through
    files it has open) keeps a complete entry under it while this version replaces it: the
    new one is built beside the old and swapped in, never after deleting the old."""
    if not exchange:  # a filesystem without RENAME_EXCHANGE
        monkeypatch.setattr(model_cache, "_exchange", lambda a, b: False)
    cache = tmp_path / "models"
    entry = _stale_entry(tiny_gguf, cache)
    held = (entry / "config.json").open()  # the other process's open file
    seen_during_build: list[str] = []
    real_save = conversion._save_gguf_metadata

    def save_and_look(gguf_file: Path, out: Path, trust_remote_code: bool = False) -> None:
        # Mid-build, the old entry is still there, whole, under its name.
        seen_during_build.append((entry / "config.json").read_text())
        real_save(gguf_file, out, trust_remote_code)

    monkeypatch.setattr(conversion, "_save_gguf_metadata", save_and_look)
    again = resolve_model(str(tiny_gguf), cache_dir=cache)
    assert seen_during_build == ['{"stale": true}']
    assert again.local_dir == entry
    assert model_cache.is_current(entry, conversion.GGUF_ENTRY_VERSION)
    assert "stale" not in (entry / "config.json").read_text()
    assert held.read() == '{"stale": true}'  # the open file still reads its old bytes
    held.close()
    # Nothing of the old entry is left behind.
    assert list((cache / ".tmp").iterdir()) == []
    assert [e.name for e in model_cache.list_entries(cache)] == [entry.name]


def test_an_entry_stays_readable_by_path_while_replaced(tiny_gguf: Path, tmp_path: Path) -> None:
    """A reader polling the entry's files by path while another process replaces the entry
    (the stale-version case) never finds a file missing."""
    cache = tmp_path / "models"
    entry = _stale_entry(tiny_gguf, cache)
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from pathlib import Path
                p = Path({str(entry / "config.json")!r})
                print("ready", flush=True)
                reads = 0
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    if "stale" not in p.read_text():
                        break
                    reads += 1
                # and once more after: the new entry
                p.read_text()
                print("ok", reads, flush=True)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None
    assert reader.stdout.readline().strip() == "ready"
    resolve_model(str(tiny_gguf), cache_dir=cache)
    out, _ = reader.communicate(timeout=150)
    assert reader.returncode == 0, out
    assert out.startswith("ok")
    assert model_cache.is_current(entry, conversion.GGUF_ENTRY_VERSION)
