"""The transformers baselines alone, without a server: ``python -m genserve.bench.hf_only``.

``genserve-bench --hf-baseline`` runs the baselines after its server levels, on the prompt set
it tokenised with the server.  On a GPU lent for minutes, the compiled baseline
(``static-compile``: static cache + ``torch.compile``, CUDA graphs) is the expensive part, and a
server start in front of it is time it cannot spare.  This runs the same seeded prompt set
(:func:`~genserve.bench.prompts.make_prompts`, counted with the model's own tokenizer, which is
the one genserve serves) through the same baseline functions, one batch size at a time, and
prints and writes each summary as soon as it exists, so a run cut off by a time limit still
leaves the batch sizes it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from genserve.bench import hf_baseline
from genserve.bench.prompts import Prompt, make_prompts
from genserve.bench.records import RunResult
from genserve.bench.report import format_table
from genserve.bench.stats import summarise

_MODES = ("eager", "static", "static-compile")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m genserve.bench.hf_only", description=__doc__)
    p.add_argument("--model-id", type=Path, required=True, help="a save_pretrained directory")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--modes", default="static-compile", help=f"comma list of {_MODES}")
    p.add_argument("--batch-sizes", default="1,64", help="comma list of generate() batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len-mean", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt set (as genserve-bench)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--out", type=Path, required=True, help="directory for results.jsonl")
    p.add_argument(
        "--go-file",
        type=Path,
        default=None,
        help="compile, touch GO_FILE.ready-bN, then wait for GO_FILE to exist and measure "
        "holding an exclusive lock on GO_FILE.lock: processes started together compile at once "
        "(minutes each on a GPU machine's slow host) and measure one at a time, alone",
    )
    return p


@contextlib.contextmanager
def _gate(go_file: Path, batch_size: int) -> Iterator[None]:
    """Ready → wait for ``go_file`` → measure under an exclusive ``flock`` (see --go-file)."""
    go_file.with_name(f"{go_file.name}.ready-b{batch_size}").touch()
    while not go_file.exists():
        time.sleep(0.2)
    with go_file.with_name(go_file.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(
    model: object, tokenizer: object, mode: str, prompts: list[Prompt], b: int, go: Path | None
) -> RunResult:
    gate = None if go is None else functools.partial(_gate, go, b)
    if mode == "eager":
        with gate() if gate is not None else contextlib.nullcontext():
            return hf_baseline.run_padded_generate(model, tokenizer, prompts, b)
    return hf_baseline.run_static_generate(
        model, tokenizer, prompts, b, compile=mode == "static-compile", measure_gate=gate
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(_MODES))
    if unknown:
        print(f"unknown --modes {unknown}; choose from {_MODES}", file=sys.stderr)
        return 2
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    model, tokenizer = hf_baseline.load_model(args.model_id, args.dtype, args.threads, args.device)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    prompts = make_prompts(
        max(batch_sizes), args.prompt_len_mean, args.max_new_tokens, args.seed,
        count_tokens=count_tokens,
    )  # fmt: skip
    # One short unmeasured call: the first generate() pays one-time setup costs.
    hf_baseline.run_padded_generate(model, tokenizer, [Prompt(-1, prompts[0].text, 0, 4)], 1)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.jsonl").open("a") as sink:
        for b in batch_sizes:
            for mode in modes:
                summary = summarise(_run(model, tokenizer, mode, prompts[:b], b, args.go_file))
                sink.write(json.dumps(summary, default=str) + "\n")
                sink.flush()
                print(format_table([summary]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
