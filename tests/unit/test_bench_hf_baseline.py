"""The Hugging Face baselines on a tiny random-weight Llama with a word-level tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from genserve.bench import hf_baseline  # noqa: E402
from genserve.bench.prompts import STORY_LEADS, WORDS, make_prompts  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(WORDS) | {w for lead in STORY_LEADS for w in lead.split()})
    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]", pad_token="[EOS]"
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=1,
        bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> tuple[Any, Any]:
    return hf_baseline.load_model(tiny_model_dir, "float32", num_threads=1)


def test_padded_generate_times_every_row(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    prompts = make_prompts(3, 12, 6, seed=0)
    done: list[int] = []
    run = hf_baseline.run_padded_generate(model, tokenizer, prompts, 2, on_done=done.append)
    assert done == [2, 1]
    assert (run.system, run.concurrency, len(run.records)) == ("hf_generate", 2, 3)
    for prompt, record in zip(prompts, run.records, strict=True):
        assert record.prompt_id == prompt.prompt_id
        assert record.input_length == len(tokenizer(prompt.text)["input_ids"])
        assert 1 <= record.num_generated_tokens <= 6
        assert len(record.token_times) == record.num_generated_tokens
        assert record.start < record.token_times[0] <= record.token_times[-1] <= record.end
    assert run.wall_s > 0


def test_early_eos_shortens_only_its_row(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    prompts = make_prompts(2, 12, 6, seed=1)
    encoded = tokenizer(prompts[0].text, return_tensors="pt")
    first = model.generate(**encoded, max_new_tokens=6, do_sample=False, pad_token_id=1)
    generated = first[0, encoded["input_ids"].shape[1] :].tolist()
    old_eos = model.generation_config.eos_token_id
    # Make row 0's third greedy token the end-of-sequence token.
    model.generation_config.eos_token_id = generated[2]
    try:
        run = hf_baseline.run_padded_generate(model, tokenizer, prompts, 2)
    finally:
        model.generation_config.eos_token_id = old_eos
    row = run.records[0]
    assert row.finish_reason == "eos_token"
    assert row.num_generated_tokens == generated.index(generated[2]) + 1
    assert row.end == row.token_times[-1]
    if run.records[1].finish_reason == "length":
        assert run.records[1].num_generated_tokens == 6
    assert any("ended with EOS" in note for note in run.notes)


def test_generate_batch_baseline(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    if not hf_baseline.has_generate_batch(model):
        pytest.skip("this transformers has no continuous batching")
    prompts = make_prompts(3, 12, 5, seed=2)
    run = hf_baseline.run_generate_batch(model, tokenizer, prompts, block_size=16)
    assert (run.system, len(run.records)) == ("hf_generate_batch", 3)
    for prompt, record in zip(prompts, run.records, strict=True):
        assert record.error is None
        assert record.prompt_id == prompt.prompt_id
        assert 1 <= record.num_generated_tokens <= 5
        assert len(record.token_times) == record.num_generated_tokens
        assert record.ttft is not None and record.ttft > 0
    assert run.wall_s > 0


def test_static_cache_baseline_gives_eager_tokens(loaded: tuple[Any, Any]) -> None:
    """The static-cache baseline (compile off on CPU: compiling is minutes here) records only
    the real prompts of a filled-up last batch, and greedy rows equal the eager ones."""
    model, tokenizer = loaded
    prompts = make_prompts(3, 12, 5, seed=3)
    static = hf_baseline.run_static_generate(model, tokenizer, prompts, 2, compile=False)
    assert (static.system, static.concurrency, len(static.records)) == ("hf_static", 2, 3)
    assert [r.prompt_id for r in static.records] == [p.prompt_id for p in prompts]
    assert any("left-padded" in note for note in static.notes)
    eager = hf_baseline.run_padded_generate(model, tokenizer, prompts, 2)
    assert [r.num_generated_tokens for r in static.records] == [
        r.num_generated_tokens for r in eager.records
    ]
    assert static.wall_s > 0


def test_hf_only_writes_each_batch_as_it_finishes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``python -m genserve.bench.hf_only``: the baselines without a server, one JSON line
    per (batch size, mode), each with the requests it was asked for."""
    import json

    from genserve.bench import hf_only

    out = tmp_path / "out"
    argv = ["--model-id", str(tiny_model_dir), "--device", "cpu", "--modes", "eager,static"]
    argv += ["--batch-sizes", "1,2", "--max-new-tokens", "3", "--out", str(out)]
    assert hf_only.main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["system"], r["concurrency"]) for r in rows] == [
        ("hf_generate", 1), ("hf_static", 1), ("hf_generate", 2), ("hf_static", 2)
    ]  # fmt: skip
    assert all(r["num_failed"] == 0 and r["num_requests"] == r["concurrency"] for r in rows)
    assert hf_only.main([*argv[:4], "--modes", "nope", "--out", str(out)]) == 2


def test_hf_only_go_file_gates_measurements_one_at_a_time(tmp_path: Path) -> None:
    """``--go-file``: each process says it has compiled (a ready file), waits for the go file,
    then measures holding an exclusive lock, so measurements never overlap."""
    import threading
    import time

    from genserve.bench.hf_only import _gate

    go = tmp_path / "go"
    events: list[tuple[str, int]] = []

    def measure(batch: int) -> None:
        with _gate(go, batch):
            events.append(("in", batch))
            time.sleep(0.2)
            events.append(("out", batch))

    threads = [threading.Thread(target=measure, args=(b,)) for b in (1, 64)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not all((tmp_path / f"go.ready-b{b}").exists() for b in (1, 64)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.1)
    assert events == []  # nobody measures before the go file
    go.touch()
    for t in threads:
        t.join(timeout=10)
    assert [kind for kind, _ in events] == ["in", "out", "in", "out"]
    assert events[0][1] == events[1][1] != events[2][1] == events[3][1]
