"""The correctness reference every parity test compares against: transformers ``generate()``
on the same float32 weights, greedy, one prompt at a time."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from genserve.model.loader import transformers_weights_kwargs


def _attention_kwargs(model_dir: Path) -> dict[str, str]:
    """Eager attention where the model soft-caps its attention scores (Gemma 2): SDPA cannot,
    and transformers 5.17 picked SDPA for Gemma 2 and dropped the cap (5.24 picks eager)."""
    config = AutoConfig.from_pretrained(str(model_dir))
    softcap = getattr(getattr(config, "text_config", config), "attn_logit_softcapping", None)
    return {"attn_implementation": "eager"} if softcap else {}


def hf_greedy(
    model_dir: Path, prompts: list[str], max_new_tokens: int, *, ignore_eos: bool = False
) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy new token ids and their logprobs. ``ignore_eos`` keeps generating
    to ``max_new_tokens`` past an end-of-sequence token (compare with a request that sets
    ``ignore_eos`` or a server that never stops early)."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=torch.float32,
        **transformers_weights_kwargs(model_dir),
        **_attention_kwargs(model_dir),
    )
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if ignore_eos else None,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tok.eos_token_id,
            )
            new_ids = out.sequences[0, ids.shape[1] :].tolist()
            logprobs = [
                torch.log_softmax(logits[0].float(), dim=-1)[t].item()
                for logits, t in zip(out.logits, new_ids, strict=True)
            ]
            results.append((new_ids, logprobs))
    return results
