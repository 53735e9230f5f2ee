"""Seeded prompts of varied lengths (a few tokens to several hundred)."""

from __future__ import annotations

import random

_WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "river",
    "mountains",
    "hold",
    "ancient",
    "secrets",
    "of",
    "light",
    "and",
    "code;",
    "servers",
    "stream",
    "tokens,",
    "caches",
    "keep",
    "blocks,",
    "schedulers",
    "batch",
    "requests",
    "café",
    "naïve",
    "über",
    "東京",
    "数据",
    "🎉",
    "résumé",
    "garçon",
)


def varied_prompts(n: int, seed: int = 0, max_words: int = 300) -> list[str]:
    rng = random.Random(seed)
    lengths = [2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, max_words]
    prompts = []
    for i in range(n):
        num_words = lengths[i % len(lengths)] + rng.randint(0, 3)
        prompts.append(" ".join(rng.choice(_WORDS) for _ in range(num_words)))
    return prompts


# Server limits with room for every prompt above (the parity tests on 1 and 2 shards); float32
# and, for quantized weights, the float path (the integer kernels, the default where the CPU
# has them, move the logits: tests of that path append --cpu-int-dot on, the last flag wins).
PARITY_SERVER_ARGS = (
    "--dtype",
    "float32",
    "--cpu-int-dot",
    "off",
    "--max-concurrent-requests",
    "64",
    "--max-input-tokens",
    "900",
    "--max-total-tokens",
    "1024",
    "--max-batch-total-tokens",
    "32768",
    "--prometheus-port",
    "0",
)
