"""Prefix-cache keys for models whose rotary angles depend on the sequence's length.

Under longrope (Phi-3, Phi-4-mini) and dynamic NTK a prompt's keys are rotated by the whole
prompt's length, as transformers' one-forward prefill does (``SeqSpec.rotary_lens``): a
block computed for a short prompt is not the block a long prompt sharing those tokens needs.
So a request's blocks are salted with its prompt's regime: longrope has two (at or below
the original context: the short factors; above: the long ones); dynamic NTK scales by the
exact length past the original context, so a long prompt shares only with prompts of its
own length.  Prompts within the original context rotate plainly and share as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class LengthRotary:
    """A served model's length-dependent rotary: its kind and original context."""

    kind: Literal["longrope", "dynamic"]
    original_max_positions: int

    def salt(self, prompt_len: int) -> str | None:
        """The prefix-cache salt of a prompt of ``prompt_len`` tokens (None: plain)."""
        if prompt_len <= self.original_max_positions:
            return None
        return "rope:long" if self.kind == "longrope" else f"rope:ntk:{prompt_len}"


def length_rotary(rope_type: str, params: Mapping[str, float]) -> LengthRotary | None:
    """From a ``RopeConfig``'s type and params: None where angles depend on position only."""
    if rope_type not in ("longrope", "dynamic"):
        return None
    original = params.get("original_max_position_embeddings")
    if original is None:
        return None
    return LengthRotary("longrope" if rope_type == "longrope" else "dynamic", int(original))


def combine(*salts: str | None) -> str | None:
    """One salt from several (adapter, rotary regime); None when none applies."""
    parts = [s for s in salts if s is not None]
    return "|".join(parts) if parts else None
