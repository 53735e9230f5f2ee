"""Random PEFT LoRA adapters for tests: made with PEFT itself (its own names and config),
with non-zero B (PEFT initialises B to zero, which would make every adapter a no-op).

    python -m genserve.testing.tiny_lora BASE_DIR OUT_DIR [--rank 8] [--targets q_proj,v_proj]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def make_lora_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.1,
) -> Path:
    """Write a PEFT adapter for the model in ``base_dir`` into ``out_dir``; returns it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from genserve.model.loader import transformers_weights_kwargs

    # A GGUF cache entry holds no weights: transformers reads them from its GGUF file.
    base = AutoModelForCausalLM.from_pretrained(
        str(base_dir), dtype=torch.float32, **transformers_weights_kwargs(base_dir)
    )
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(str(out_dir))
    return out_dir


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--rslora", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_lora_adapter(
        args.base_dir,
        args.out_dir,
        rank=args.rank,
        alpha=args.alpha,
        targets=args.targets.split(","),
        use_rslora=args.rslora,
        seed=args.seed,
    )
    print(args.out_dir)


if __name__ == "__main__":
    main()
