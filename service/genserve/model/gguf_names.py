"""How llama.cpp's converter (``convert_hf_to_gguf.py``) names and transforms the tensors of
each GGUF architecture genserve reads natively, undone: GGUF tensor name → the Hugging Face
parameter name the native families load (``model/families``), and the value changes to
reverse.

* Names: ``blk.{i}.attn_q`` ... per ``gguf-py``'s ``TENSOR_NAMES``; the same HF module can
  have a different GGUF name per architecture (``post_attention_layernorm`` is Llama's
  ``ffn_norm`` but Gemma 2/3's ``post_attention_norm``, their ``ffn_norm`` being
  ``pre_feedforward_layernorm``), and Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are
  ``attn_qkv`` / ``ffn_up``.
* Q/K rows: permuted for llama.cpp's rotary layout for ``llama`` (Llama, Mistral, Granite
  are written as ``llama``) only; Qwen, Gemma and Phi-3 keep Hugging Face's order.
* Mixtures of experts (``qwen2moe``, ``qwen3moe``): the router ``ffn_gate_inp`` is
  ``mlp.gate``; the routed experts are stacked per layer, ``ffn_{gate,up}_exps``
  ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]`` (llama.cpp's ``ne`` reversed), named here
  ``mlp.experts.{gate,up,down}_proj`` without ``.weight`` as Hugging Face's stacked expert
  tensors are; Qwen2-MoE's shared expert ``ffn_*_shexp`` is ``mlp.shared_expert.*`` and its
  gate ``ffn_gate_inp_shexp`` is ``mlp.shared_expert_gate``.
* Mixtral is written as ``llama`` (its Q/K rows permuted like Llama's) with the same stacks
  (``w1`` → ``ffn_gate_exps``, ``w3`` → ``ffn_up_exps``, ``w2`` → ``ffn_down_exps``) and
  router ``ffn_gate_inp``, read here under the Mixtral family's module names
  (``block_sparse_moe.gate``, ``block_sparse_moe.experts.{gate,up,down}_proj``); a dense
  ``llama`` file has none of these tensors.
* gpt-oss (``gpt-oss``, ``conversion/gpt_oss.py``): the interleaved ``gate_up_proj`` split
  into the same ``ffn_{gate,up}_exps`` stacks (MXFP4 blocks from the released checkpoints,
  else the output type), with their biases ``ffn_{gate,up,down}_exps.bias`` ``[E, I]`` /
  ``[E, H]`` (read here as ``mlp.experts.{gate,up,down}_proj_bias``), the router
  ``ffn_gate_inp`` with a bias (``mlp.router``), q/k/v/o biases, the pre-MLP norm as
  ``post_attention_norm`` and the sinks as ``attn_sinks.weight`` (HF's bare
  ``self_attn.sinks``).
* Gemma (1/2/3) norm weights are stored as ``w + 1`` (Gemma's RMSNorm multiplies by
  ``1 + w``; llama.cpp's by the weight), every tensor whose name ends in ``norm.weight``,
  the q/k norms and the final norm included.  transformers subtracts the 1 again when it
  reads such a file (``Gemma2TensorProcessor``), and so does :func:`norm_shift` here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_MATRICES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 2/3: a norm before and after each sublayer.
_SANDWICH_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Phi-3 keeps its fused projections: [q | k | v] rows and [gate | up] rows.
_PHI3_MATRICES = {
    **{k: v for k, v in _MATRICES.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_up")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}

# Mixture-of-experts layers (llama.cpp's qwen2moe / qwen3moe): the router and the shared
# expert's gate are vectors loaded in floats; the shared expert is a dense MLP.
_MOE_VECTORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_MOE_MATRICES = {
    **_MATRICES,
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# The routed experts, stacked [E, rows, cols] (no ``.weight``, as HF's stacked tensors).
_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Mixtral (``llama`` with experts): the same stacks under the Mixtral family's names.
_MIXTRAL_VECTORS = {"ffn_gate_inp": "block_sparse_moe.gate"}
_MIXTRAL_EXPERTS = {
    "ffn_gate_exps": "block_sparse_moe.experts.gate_proj",
    "ffn_up_exps": "block_sparse_moe.experts.up_proj",
    "ffn_down_exps": "block_sparse_moe.experts.down_proj",
}


# gpt-oss: the pre-MLP norm is ``post_attention_norm``; the router has a bias.
_GPT_OSS_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
_GPT_OSS_VECTORS = {"ffn_gate_inp": "mlp.router"}


@dataclass(frozen=True, slots=True)
class GGUFLayout:
    """One GGUF architecture's tensor conventions (see the module docstring)."""

    # Per layer: GGUF tensor kind → Hugging Face module under ``model.layers.{i}``.
    matrices: Mapping[str, str] = field(default_factory=lambda: _MATRICES)
    norms: Mapping[str, str] = field(default_factory=lambda: _NORMS)
    # llama.cpp permuted the attn_q / attn_k rows for its rotary layout.
    permuted_qk: bool = False
    # llama.cpp stored ``w + norm_shift`` for every ``*norm.weight``.
    norm_shift: float = 0.0
    # Mixture-of-experts tensors: routers and gates (with suffix), stacked experts (without).
    moe_vectors: Mapping[str, str] = field(default_factory=dict)
    experts: Mapping[str, str] = field(default_factory=dict)
    # Tensors whose Hugging Face name has no ``.weight`` (gpt-oss's ``self_attn.sinks``).
    bare: Mapping[str, str] = field(default_factory=dict)


LAYOUTS: dict[str, GGUFLayout] = {
    "llama": GGUFLayout(permuted_qk=True, moe_vectors=_MIXTRAL_VECTORS, experts=_MIXTRAL_EXPERTS),
    "qwen2": GGUFLayout(),
    "qwen3": GGUFLayout(),
    "phi3": GGUFLayout(matrices=_PHI3_MATRICES),
    "gemma": GGUFLayout(norm_shift=1.0),
    "gemma2": GGUFLayout(norms=_SANDWICH_NORMS, norm_shift=1.0),
    "gemma3": GGUFLayout(norms=_SANDWICH_NORMS, norm_shift=1.0),
    "qwen2moe": GGUFLayout(matrices=_MOE_MATRICES, moe_vectors=_MOE_VECTORS, experts=_EXPERTS),
    "qwen3moe": GGUFLayout(matrices=_MOE_MATRICES, moe_vectors=_MOE_VECTORS, experts=_EXPERTS),
    "gpt-oss": GGUFLayout(
        norms=_GPT_OSS_NORMS,
        moe_vectors=_GPT_OSS_VECTORS,
        experts=_EXPERTS,
        bare={"attn_sinks": "self_attn.sinks"},
    ),
}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def layout(arch: object) -> GGUFLayout | None:
    """The conventions of GGUF architecture ``arch`` (``general.architecture``), or None
    for one genserve does not read natively."""
    return LAYOUTS.get(arch) if isinstance(arch, str) else None


def hf_matrix_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF *matrix* (embedding, head, projections), or None for
    any other tensor (norms, biases, tensors genserve does not use)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    matrices = LAYOUTS[arch].matrices
    if match is None or match.group(3) != "weight" or match.group(2) not in matrices:
        return None
    return f"model.layers.{match.group(1)}.{matrices[match.group(2)]}.weight"


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of any tensor genserve loads from a GGUF of ``arch`` (matrices,
    norms, biases); None for tensors it does not use (``rope_freqs``, ``rope_factors_*``)."""
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    matrix = hf_matrix_name(gguf_name, arch)
    if matrix is not None:
        return matrix
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    layer, kind, suffix = match.groups()
    conventions = LAYOUTS[arch]
    if kind in conventions.experts:  # the stack, or its per-expert biases (gpt-oss)
        stacked = conventions.experts[kind]
        return f"model.layers.{layer}.{stacked}" + ("" if suffix == "weight" else "_bias")
    if kind in conventions.bare:
        return f"model.layers.{layer}.{conventions.bare[kind]}" if suffix == "weight" else None
    module = (
        conventions.matrices.get(kind)
        or conventions.norms.get(kind)
        or conventions.moe_vectors.get(kind)
    )
    return None if module is None else f"model.layers.{layer}.{module}.{suffix}"


def is_expert_stack(gguf_name: str, arch: str) -> bool:
    """Whether ``gguf_name`` is a layer's stacked routed experts (``ffn_*_exps``)."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return (
        match is not None and match.group(2) in LAYOUTS[arch].experts and match.group(3) == "weight"
    )


def norm_shift(gguf_name: str, arch: str) -> float:
    """What llama.cpp added to tensor ``gguf_name``'s values (to subtract on reading)."""
    shift = LAYOUTS[arch].norm_shift
    return shift if gguf_name.endswith("norm.weight") else 0.0
