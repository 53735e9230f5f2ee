"""Issue #27: lm-evaluation-harness itself (the real `lm_eval` package, not its request shapes)
scores a genserve + genserve-gateway with its `local-completions` model, and its `hf` model
scores the same float32 weights in-process: the two must agree.

Two local tasks (custom YAML, `dataset_path: json` over a JSONL file written here; nothing comes
from a hub): a multiple-choice loglikelihood task (`acc`, each choice's summed logprob and its
greedy flag) and a `generate_until` task (the generated texts).  `batch_size` 8 with the server's
client batch limit at 3, so the gateway must fan one call out into several `Generate` calls.
The tokenizer local-completions counts context lengths with is the model directory's own."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clients.gateway_process import Gateway

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra (pyproject.toml)")

MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " a cat", " four"], "label": 0},
    {"question": "Two plus two is", "choices": [" four", " five", " blue"], "label": 0},
    {"question": "Paris is in", "choices": [" France", " Spain", " the sea", " a hat"], "label": 0},
    {"question": "Ice is", "choices": [" cold", " hot"], "label": 0},
    {"question": "A dog says", "choices": [" woof", " moo", " meow"], "label": 0},
    {"question": "The sun rises in the", "choices": [" east", " west"], "label": 0},
]
GEN_DOCS = [
    {"question": q, "answer": a}
    for q, a in [
        ("Once upon a time", " there"),
        ("The capital of France is", " Paris"),
        ("def add(a, b):", " return"),
        ("1, 2, 3,", " 4"),
        ("Hello, my name is", " Bob"),
        ("The quick brown fox", " jumps"),
        ("In the beginning", " God"),
        ("Roses are red,", " violets"),
        ("Water boils at", " 100"),
    ]
]

MC_YAML = """task: genserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
GEN_YAML = """task: genserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, docs, yaml in (("mc", MC_DOCS, MC_YAML), ("gen", GEN_DOCS, GEN_YAML)):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (out / f"{name}.yaml").write_text(yaml.format(data=data))
    return out


@pytest.fixture(scope="module")
def gateway(float32_gateway: Gateway) -> Gateway:
    """float32 (lm-eval's `hf` reference dtype); the client batch limit stays 3."""
    return float32_gateway


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No hub: datasets builds the json tasks from the local files, in a cache of its own."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf-datasets")),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def evaluate(model: str, model_args: dict[str, Any], task_dir: Path) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["genserve_mc", "genserve_gen"],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=8,  # given to the model: one /v1/completions call of 8 prompts
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    assert out is not None
    return out


def per_doc(result: dict[str, Any], task: str) -> list[Any]:
    """Each doc's responses (filtered, as the metric sees them), in doc order."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"] for s in samples]


def test_local_completions_scores_equal_hf(
    gateway: Gateway, tiny_model: Path, task_dir: Path
) -> None:
    served = evaluate(
        "local-completions",
        {
            "base_url": gateway.url + "/v1/completions",
            "model": "tiny",
            "tokenizer": str(tiny_model),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_retries": 1,
            "num_concurrent": 1,
        },
        task_dir,
    )
    reference = evaluate(
        "hf",
        {"pretrained": str(tiny_model), "dtype": "float32", "device": "cpu"},
        task_dir,
    )
    # Multiple choice: the same accuracy, and every choice's (loglikelihood, is_greedy) close.
    mc = "genserve_mc"
    assert served["results"][mc]["acc,none"] == reference["results"][mc]["acc,none"]
    got, want = per_doc(served, mc), per_doc(reference, mc)
    assert len(got) == len(MC_DOCS)
    for doc_got, doc_want in zip(got, want, strict=True):
        assert len(doc_got) == len(doc_want)
        for (lp, greedy), (lp_want, greedy_want) in zip(doc_got, doc_want, strict=True):
            assert lp == pytest.approx(lp_want, abs=1e-3)
            assert greedy == greedy_want
    # generate_until: the same greedy texts, so the same exact_match.
    gen = "genserve_gen"
    assert per_doc(served, gen) == per_doc(reference, gen)
    assert len(per_doc(served, gen)) == len(GEN_DOCS)
    assert (
        served["results"][gen]["exact_match,none"] == reference["results"][gen]["exact_match,none"]
    )
