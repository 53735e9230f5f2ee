"""``genserve-bench --make-model SHAPE DIR``: write a random-weight model with a real
checkpoint's shape (see :mod:`genserve.testing.shape_model`) for offline GPU benchmarks."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str]) -> int:
    from genserve.testing.shape_model import SHAPES, TYPED_SHAPES, make_shape_model

    p = argparse.ArgumentParser(prog="genserve-bench --make-model")
    p.add_argument("shape", choices=sorted([*SHAPES, *TYPED_SHAPES]))
    p.add_argument("out_dir", type=Path)
    p.add_argument("--device", default="cpu", help="where to initialise (cuda: fast for 8B)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: tokenizer's)")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(list(argv))
    out = make_shape_model(
        ns.shape, ns.out_dir, device=ns.device, dtype=ns.dtype, vocab_size=ns.vocab, seed=ns.seed
    )
    print(out)
    return 0
