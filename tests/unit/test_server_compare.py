"""``genserve-bench cpu --model``: the decode-rate window and the argument checks (the servers
themselves run in the benchmark, not in the suite: a real-size model takes minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from genserve.bench import cpu_compare
from genserve.bench.server_compare import decode_rate, random_prompts


def test_decode_rate_counts_only_the_window_all_streams_generate_in() -> None:
    # Stream a starts early (its lone early token is another stream's prefill time), b ends
    # late; the window is [1.0, 2.0]: a's tokens at 1.5 and 2.0, b's at 1.5 and 2.0.
    a = [0.2, 1.5, 2.0]
    b = [1.0, 1.5, 2.0, 3.0]
    assert decode_rate([a, b]) == pytest.approx(4 / 1.0)
    assert decode_rate([[0.0, 0.5, 1.0]]) == pytest.approx(2 / 1.0)
    with pytest.raises(ValueError, match="never generated at the same time"):
        decode_rate([[0.0, 1.0], [2.0, 3.0]])


def test_prompts_are_repeatable_and_sized() -> None:
    first = random_prompts(3, 40, seed=1)
    assert first == random_prompts(3, 40, seed=1) and first != random_prompts(3, 40, seed=2)
    assert [len(p) for p in first] == [40, 40, 40]


def test_model_files_must_exist(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        cpu_compare.main(["--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # server flags only make sense with --model
        cpu_compare.main(["--out", str(tmp_path), "--", "--cpu-int-dot", "on"])
