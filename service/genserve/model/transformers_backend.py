"""The transformers fallback: any ``*ForCausalLM`` served through transformers' own modeling
code, behind the same model interface the runner drives the native model through.

The runner calls ``model(token_ids, positions, kv_caches, meta) -> hidden`` on the step's
flat batch and ``model.compute_logits(hidden_rows)`` on the rows it samples or scores.
:class:`TransformersCausalLM` implements both over a transformers model, two ways:

- **paged** (``ServingPath.implementation == "transformers"``): the decoder runs once per
  step on the whole flat batch (``[1, num_tokens]`` with each token's ``position_ids``,
  no transformers cache, no mask) with ``config._attn_implementation = "genserve_paged"``
  (``model/transformers_attention.py``), which stores K/V in genserve's blocks and attends
  each sequence over its block table.  Continuous batching, chunked prefill, prefix caching
  and n-gram speculation work as for the native model, since a layer's K/V at a position
  depends only on the tokens up to it.
- **sequential** (``"transformers-sequential"``: recurrent or hybrid layers, or attention
  outside the interface): each scheduled chunk runs on its own with that request's
  transformers cache (created by the model on the request's first chunk, dropped when it
  ends), one request after another.  The runner tells the model which request each chunk
  is (:meth:`TransformersCausalLM.bind_step`).  Slower; prefix caching and speculation are
  off (``genserve.model.fallback_options``), and the paged pool is sized but never touched.

Logits: the ``*ForCausalLM`` forward itself, with its decoder swapped for one that returns
the given hidden states, so the model's own head and its post-processing (Gemma 2's final
soft-cap, Granite's ``logits_scaling``, Cohere's ``logit_scale``, ...) apply unchanged.

The KV cache geometry (which layers have attention, their KV heads and K/V widths) is found
by one probe forward of two tokens at load, with a recording attention function.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

from genserve.model.adapter_errors import AdapterError
from genserve.model.attention import TorchAttentionMetadata
from genserve.model.config import ModelConfig, RopeConfig
from genserve.model.loader import transformers_weights_kwargs
from genserve.model.serving_path import ServingPath
from genserve.model.spec import NormSpec
from genserve.model.transformers_attention import (
    ATTENTION_NAME,
    PagedStep,
    bind_step,
    register,
)

log = structlog.get_logger("genserve.model")

_PROBE_NAME = "genserve_probe"


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """The paged cache one transformers model needs: one cache layer per attention layer
    (``layer_slots``: transformers ``layer_idx`` → cache layer), sized for the widest."""

    layer_slots: dict[int, int]
    num_kv_heads: int
    head_dim: int  # max over layers of the K and V widths


@dataclass(slots=True)
class _StepRows:
    """Sequential path: the request, token count and start position of each chunk, in the
    order of the flat batch."""

    rows: list[tuple[str, int, int]] = field(default_factory=list)


class TransformersCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` with the native model's interface (see module doc)."""

    def __init__(self, hf: Any, path: ServingPath, geometry: CacheGeometry) -> None:
        super().__init__()
        self.hf = hf
        self.path = path
        self.geometry = geometry
        self.num_local_kv_heads = geometry.num_kv_heads
        self._base_name = _decoder_attribute(hf)
        self._head_lock = threading.Lock()
        self._step_rows = _StepRows()
        self._caches: dict[str, Any] = {}  # sequential path: req_id → transformers cache

    @property
    def base(self) -> nn.Module:
        module: nn.Module = getattr(self.hf, self._base_name)
        return module

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        token_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: Sequence[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of the step's flat batch."""
        if self.path.per_request_state:
            return self._forward_sequential(token_ids)
        if not isinstance(meta, TorchAttentionMetadata):
            raise TypeError(f"the transformers fallback needs the torch backend, got {meta!r}")
        with bind_step(PagedStep(meta, kv_caches, self.geometry.layer_slots)):
            out = self.base(
                input_ids=token_ids[None], position_ids=positions[None], use_cache=False
            )
        hidden: torch.Tensor = out[0][0]
        return hidden

    def bind_step(self, rows: list[tuple[str, int, int]]) -> None:
        """Sequential path: ``(req_id, num_tokens, start_pos)`` of each chunk of the next
        forward, in flat-batch order."""
        self._step_rows.rows = rows

    def end_requests(self, req_ids: Sequence[str] | None = None) -> None:
        """Sequential path: drop the transformers caches of ``req_ids`` (None: all)."""
        if req_ids is None:
            self._caches.clear()
        for req_id in req_ids or ():
            self._caches.pop(req_id, None)

    def _forward_sequential(self, token_ids: torch.Tensor) -> torch.Tensor:
        outs = []
        start = 0
        for req_id, num_tokens, start_pos in self._step_rows.rows:
            cache = self._caches.pop(req_id, None) if start_pos > 0 else None
            if start_pos > 0 and (cache is None or cache.get_seq_length() != start_pos):
                raise RuntimeError(
                    f"{req_id}: no transformers cache at position {start_pos} (sequential "
                    "fallback path; prefix caching and speculation must be off)"
                )
            out = self.base(
                input_ids=token_ids[start : start + num_tokens][None], cache=cache, use_cache=True
            )
            self._caches[req_id] = out.cache
            outs.append(out[0][0])
            start += num_tokens
        if start != token_ids.shape[0]:
            raise RuntimeError("the step's chunks do not cover its tokens (bind_step missing?)")
        return torch.cat(outs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden]`` → ``[rows, vocab]`` float32 through the model's own head."""
        with self._head_lock:
            decoder = self.base
            setattr(self.hf, self._base_name, _FixedOutput(_HiddenOnly(hidden[None])))
            try:
                # inputs_embeds only gives the forward the row count; the stand-in ignores it.
                out = self.hf(
                    inputs_embeds=hidden[None], use_cache=False, output_router_logits=False
                )
            finally:
                setattr(self.hf, self._base_name, decoder)
        logits: torch.Tensor = out.logits[0]
        return logits.float()

    # -------------------------------------------- what the native model has and this lacks
    def pack_weights(self) -> None:
        """No packed layouts: transformers' modules run as they are."""

    def use_fused_cpu_ops(self, matvec_rows: int = 0) -> None:
        """genserve's fused CPU ops serve native layers only."""

    def enable_lora(self, step: object) -> dict[str, Any]:
        raise AdapterError(
            "LoRA adapters are not supported by the transformers fallback "
            f"({self.path.architecture})"
        )


class _HiddenOnly:
    """A decoder output holding only ``last_hidden_state`` (also item 0); every other field
    (cache, router logits, attentions...) reads as None."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str) -> None:
        return None


class _FixedOutput(nn.Module):
    """Stands in for a decoder during :meth:`TransformersCausalLM.compute_logits`."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _decoder_attribute(hf: Any) -> str:
    """The name under which ``hf`` holds its decoder (``model``, ``transformer``,
    ``gpt_neox``...; ``base_model_prefix`` is not always it: Llama-4 text)."""
    from transformers import PreTrainedModel

    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    children = dict(hf.named_children())
    for name, child in children.items():
        if child is decoder:
            return str(name)
    for name in (str(hf.base_model_prefix), "model", "transformer"):
        if isinstance(children.get(name), nn.Module):
            return name
    models = [name for name, child in children.items() if isinstance(child, PreTrainedModel)]
    if len(models) != 1:
        raise TypeError(f"cannot find the decoder of {type(hf).__name__}")
    return str(models[0])


# ---------------------------------------------------------------------- loading
def load_transformers_model(
    model_dir: Path,
    path: ServingPath,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
) -> tuple[TransformersCausalLM, ModelConfig]:
    """Load ``model_dir`` with transformers and wrap it; also the :class:`ModelConfig` the
    runner sizes the cache and sampler from (its cache fields describe the fallback's
    cache, the rest is informative)."""
    from transformers import AutoModelForCausalLM

    register()
    # A GGUF cache entry holds config and tokenizer only: transformers reads (and
    # dequantizes) the recorded GGUF file itself for families genserve has no native parts for.
    hf = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        **transformers_weights_kwargs(model_dir),
    )
    hf.to(device).eval()
    geometry = probe_geometry(hf, device)
    if not path.per_request_state:
        hf.set_attn_implementation(ATTENTION_NAME)
    vocab = int(hf.get_output_embeddings().weight.shape[0])
    text = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    num_heads = int(getattr(text, "num_attention_heads", 0) or geometry.num_kv_heads)
    config = ModelConfig(
        architecture=path.architecture,
        vocab_size=vocab,
        hidden_size=int(getattr(text, "hidden_size", 0) or 0),
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        num_layers=len(geometry.layer_slots),
        num_heads=num_heads,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096) or 4096),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        norm=NormSpec(eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6)),
        rope=RopeConfig(),
        sliding_windows=(None,) * len(geometry.layer_slots),
        eos_token_ids=_eos_ids(getattr(text, "eos_token_id", None)),
    )
    log.info(
        "transformers_fallback",
        architecture=path.architecture,
        implementation=path.implementation,
        reason=path.reason,
        model_class=type(hf).__name__,
        attention_layers=len(geometry.layer_slots),
        cache_kv_heads=geometry.num_kv_heads,
        cache_head_dim=geometry.head_dim,
    )
    return TransformersCausalLM(hf, path, geometry), config


def probe_geometry(hf: Any, device: torch.device) -> CacheGeometry:
    """Run two tokens through ``hf`` with a recording attention function: which
    ``layer_idx`` attend, with how many KV heads and which K/V widths."""
    from transformers import AttentionInterface

    if not getattr(type(hf), "_supports_attention_backend", False):
        return _config_geometry(hf)
    seen: dict[int, tuple[int, int, int]] = {}

    def record(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is not None:
            seen[int(layer_idx)] = (key.shape[1], key.shape[-1], value.shape[-1])
        batch, heads, length, _ = query.shape
        return query.new_zeros(batch, length, heads, value.shape[-1]), None

    AttentionInterface.register(_PROBE_NAME, record)
    previous = hf.config._attn_implementation
    try:
        hf.set_attn_implementation(_PROBE_NAME)
        with torch.inference_mode():
            ids = torch.tensor([[1, 2]], device=device)
            getattr(hf, _decoder_attribute(hf))(input_ids=ids, use_cache=False)
    finally:
        hf.set_attn_implementation(previous)
    if not seen:
        return _config_geometry(hf)
    order = sorted(seen)
    return CacheGeometry(
        {layer: slot for slot, layer in enumerate(order)},
        max(s[0] for s in seen.values()),
        max(max(s[1], s[2]) for s in seen.values()),
    )


def _config_geometry(hf: Any) -> CacheGeometry:
    """Attention outside the interface (sequential path, whose paged pool only accounts
    for tokens): blocks sized from the config as if every layer had attention."""
    text = hf.config.get_text_config()
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return CacheGeometry({i: i for i in range(int(text.num_hidden_layers))}, heads, dim)


def _eos_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return ()
