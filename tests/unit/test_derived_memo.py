"""The native spec and tokenizer class remembered per model directory (model/derived_memo.py):
the same as transformers derives them, a miss whenever a file changes, and a start that reads
them imports no transformers config class (whose import pulls torch.distributed.tensor and
accelerate, ~1.1 s)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from genserve.model import derived_memo, families
from genserve.model.config import load_model_config
from genserve.model.derived_memo import DerivedMemo, memo_key
from genserve.tokenizer import Tokenizer
from tests.conftest import TinyModelFactory

_SAMPLE = "Hello, wörld! <|im_start|>user\n  tabs\tand 数字 123"


def test_spec_is_remembered_and_read_back_equal(tiny_model_dir: Path, tmp_path: Path) -> None:
    memo = tmp_path / "memo"
    derived = families.load_model_config(tiny_model_dir)
    assert load_model_config(tiny_model_dir, memo_dir=memo) == derived
    assert len(list(memo.glob("*.spec.pickle"))) == 1
    assert DerivedMemo(memo, tiny_model_dir, False).spec() == derived
    assert load_model_config(tiny_model_dir, memo_dir=memo) == derived


def test_a_changed_file_is_a_miss(tiny_model_factory: TinyModelFactory, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama"), model)
    memo = tmp_path / "memo"
    before = load_model_config(model, memo_dir=memo)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = before.num_layers + 1
    (model / "config.json").write_text(json.dumps(config))
    after = load_model_config(model, memo_dir=memo)
    assert after.num_layers == before.num_layers + 1
    assert after == families.load_model_config(model)
    assert len(list(memo.glob("*.spec.pickle"))) == 2
    key = memo_key(model, False)
    (model / "special_tokens_map.json").write_text("{}")  # any file of the directory counts
    assert memo_key(model, False) != key
    assert memo_key(model, True) != memo_key(model, False)


def test_a_damaged_memo_is_a_miss(tiny_model_factory: TinyModelFactory, tmp_path: Path) -> None:
    model = tiny_model_factory("llama")
    memo = tmp_path / "memo"
    derived = load_model_config(model, memo_dir=memo)
    for path in memo.iterdir():
        path.write_bytes(b"\x80cut short")
    assert DerivedMemo(memo, model, False).spec() is None
    assert DerivedMemo(memo, model, False).tokenizer_class() is None
    assert load_model_config(model, memo_dir=memo) == derived  # and written again
    assert DerivedMemo(memo, model, False).spec() == derived


def test_remote_code_is_never_memoised(
    tiny_model_factory: TinyModelFactory, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom.CustomConfig"}
    (model / "config.json").write_text(json.dumps(config))
    assert memo_key(model, True) is None
    memo = DerivedMemo(tmp_path / "memo", model, True)
    memo.remember_tokenizer_class(Tokenizer)  # not transformers' own: never remembered either
    assert not (tmp_path / "memo").exists()


def test_tokenizer_of_the_remembered_class_is_autotokenizers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    auto = Tokenizer(tiny_model_dir)
    memo = DerivedMemo(tmp_path / "memo", tiny_model_dir, False)
    memo.remember_tokenizer_class(type(auto.hf))
    cls = DerivedMemo(tmp_path / "memo", tiny_model_dir, False).tokenizer_class()
    assert cls is type(auto.hf)
    direct = Tokenizer(tiny_model_dir, hf_class=cls)
    assert direct.backend.to_str() == auto.backend.to_str()
    assert direct.special_ids == auto.special_ids
    assert direct.eos_token_ids == auto.eos_token_ids
    assert direct.encode(_SAMPLE) == auto.encode(_SAMPLE)
    assert direct.hf.init_kwargs == auto.hf.init_kwargs
    assert direct.hf.chat_template == auto.hf.chat_template
    # Every attribute of the transformers object, the backend aside (compared above).
    mine, theirs = vars(direct.hf), vars(auto.hf)
    assert mine.keys() == theirs.keys()
    assert {k: repr(v) for k, v in mine.items() if k != "_tokenizer"} == {
        k: repr(v) for k, v in theirs.items() if k != "_tokenizer"
    }


def test_a_remembered_start_imports_no_config_class(
    tiny_model_factory: TinyModelFactory, tmp_path: Path
) -> None:
    model = tiny_model_factory("llama")
    memo = tmp_path / "memo"
    load_model_config(model, memo_dir=memo)
    DerivedMemo(memo, model, False).remember_tokenizer_class(type(Tokenizer(model).hf))
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from genserve.model.config import load_model_config\n"
        "from genserve.model.derived_memo import DerivedMemo\n"
        "from genserve.tokenizer import Tokenizer\n"
        f"model, memo = Path({str(model)!r}), Path({str(memo)!r})\n"
        "load_model_config(model, memo_dir=memo)\n"
        "Tokenizer(model, hf_class=DerivedMemo(memo, model, False).tokenizer_class())\n"
        "heavy = sorted(m for m in sys.modules if m == 'transformers.activations' or "
        "m.startswith(('transformers.models.llama', 'torch.distributed.tensor', 'accelerate')))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_old_memos_are_pruned_least_recently_used_first(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(derived_memo, "MAX_MEMO_FILES", 8)
    memo = tmp_path / "memo"
    memo.mkdir()

    def aged(name: str, age: int) -> Path:
        path = memo / name
        if not path.exists():
            path.write_bytes(b"another model's memo")
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
        return path

    stale = [aged(f"{i:032x}.spec.pickle", i) for i in range(8)]
    spec = families.load_model_config(tiny_model_dir)
    kept = DerivedMemo(memo, tiny_model_dir, False)
    kept.remember_spec(spec)  # 9 files: the 5 oldest go, down to half the limit
    path = kept._path("spec.pickle")
    assert path is not None
    assert sorted(memo.iterdir()) == sorted([*stale[5:], path])

    aged(path.name, 0)  # the oldest now, until it is read
    newer = [aged(f"{100 + i:032x}.spec.pickle", 10 + i) for i in range(5)]
    assert kept.spec() == spec  # a read makes it the most recently used
    derived_memo._prune(memo)  # 9 files: the 3 stale and 2 of the newer ones go
    assert sorted(memo.iterdir()) == sorted([*newer[2:], path])
