"""The per-call limits a request is checked against (TGI's router flags), set by the launcher."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_client_batch_size: int
    vocab_size: int = 0  # the model's logits width; 0: the tokenizer's vocabulary size
    watermark_gamma: float = 0.5  # --watermark-gamma
    watermark_delta: float = 2.0  # --watermark-delta
    # The flag (or cause) that set max_input_tokens / max_total_tokens, cited when refusing.
    input_limit_source: str = "--max-input-tokens"
    total_limit_source: str = "--max-total-tokens"
