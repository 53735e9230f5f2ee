"""The typed description a native decoder is assembled from.

A family module (``model/families/<name>.py``) reduces a transformers config to one
:class:`ModelConfig`: the dimensions every runner needs, plus which *parts* each layer is made
of — the norm kind (:class:`NormSpec`), the attention options (:class:`AttentionSpec`), the MLP
kind (:class:`MlpSpec`), how the sublayers are wired (:class:`BlockSpec`), the rotary
embeddings (:class:`RopeConfig`, one per distinct base, chosen per layer), and where each part's
weights live in the checkpoint (:class:`WeightNames`).  Nothing here names an architecture: the
decoder (``model/decoder.py``) and the CPU fast paths read only these fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model this server implements natively."""


class NormKind(StrEnum):
    RMS = "rms"  # w * x / rms(x) (Llama)
    RMS_ONE_PLUS = "rms_one_plus"  # (1 + w) * x / rms(x), in float32 (Gemma)
    LAYER = "layer"  # LayerNorm, with or without a bias


@dataclass(frozen=True, slots=True)
class NormSpec:
    kind: NormKind = NormKind.RMS
    eps: float = 1e-6
    bias: bool = False  # LayerNorm only


class QKNorm(StrEnum):
    NONE = "none"
    PER_HEAD = "per_head"  # a norm over each head's head_dim (Qwen3, Gemma 3, Cohere)
    FULL_WIDTH = "full_width"  # over all heads' features at once (OLMo-2)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' ``rope_parameters``)."""

    rope_type: str = "default"
    theta: float = 10000.0
    # Extra numeric keys of the scaling kind, e.g. ``factor``, ``low_freq_factor`` (llama3).
    params: Mapping[str, float] = field(default_factory=dict)
    # longrope: the per-frequency divisors for short and long contexts.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    # Softmax scale (head_dim ** -0.5 unless the family says otherwise).
    scale: float | None = None
    # Gemma 2: scores become ``cap * tanh(scores / cap)`` before the softmax.
    softcap: float | None = None
    qk_norm: QKNorm = QKNorm.NONE
    qk_norm_spec: NormSpec = NormSpec()
    # Cohere: the per-head norm has one weight row per head (else one shared row).
    qk_norm_weights_per_head: bool = False
    # Leading features of each head that rotate (partial rotary: Phi-2, GPT-NeoX, StableLM).
    rotary_dim: int | None = None  # None: the whole head
    # Cohere rotates adjacent pairs (x0, x1) instead of the two halves.
    interleaved_rotary: bool = False
    # gpt-oss: a learned logit per query head joins each softmax's denominator (an "attention
    # sink" key whose value is zero), checkpoint ``{layer}.{WeightNames.sinks}``.
    sinks: bool = False


class Activation(StrEnum):
    SILU = "silu"
    GELU = "gelu"  # exact (erf)
    GELU_TANH = "gelu_tanh"  # the tanh approximation (gelu_new, gelu_pytorch_tanh)


@dataclass(frozen=True, slots=True)
class MlpSpec:
    activation: Activation = Activation.SILU
    gated: bool = True  # down(act(gate) * up); else down(act(up))
    bias: bool = False


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """Which norms a layer has and how its two sublayers meet the residual stream.

    Sequential: ``x += post_attn(attn(pre_attn(x)))``, then the same for the MLP.  Parallel
    (Phi-2, GPT-NeoX, Cohere): ``x += attn(pre_attn(x)) + mlp(pre_mlp(x) or pre_attn(x))``.
    """

    pre_attn_norm: bool = True
    post_attn_norm: bool = False
    pre_mlp_norm: bool = True
    post_mlp_norm: bool = False
    parallel: bool = False
    # Granite: each sublayer's output is scaled before it joins the residual.
    residual_multiplier: float = 1.0

    @property
    def is_llama(self) -> bool:
        """The sequential pre-norm block the fused CPU decode layer implements."""
        return (
            self.pre_attn_norm
            and self.pre_mlp_norm
            and not (self.post_attn_norm or self.post_mlp_norm or self.parallel)
            and self.residual_multiplier == 1.0
        )


class Scoring(StrEnum):
    SOFTMAX = "softmax"  # softmax over every expert, then top-k (Mixtral, Qwen-MoE)
    SIGMOID = "sigmoid"  # independent sigmoids (DeepSeek-V3, GLM-4.5, MiniMax-M2)
    TOPK_SOFTMAX = "topk_softmax"  # top-k of the logits, softmax over those k (gpt-oss)


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How a token picks its experts and weighs them (``model/moe.py`` implements it).

    Softmax: ``top-k(softmax(logits))``, renormalised to sum 1 when ``renormalize``.
    Sigmoid: experts are chosen by ``sigmoid(logits) + correction bias`` within the
    ``topk_groups`` best of ``num_groups`` groups (a group scores by its two best experts),
    weighted by their plain sigmoid scores (renormalised when ``renormalize``).  Top-k
    softmax: the k largest logits, weighted by a softmax over those k alone.  Every way the
    weights are then multiplied by ``scaling_factor``.  ``bias``: the router is an affine
    map (gpt-oss), its bias at ``{MoeNames.router}.bias``."""

    num_experts: int
    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    renormalize: bool = False
    correction_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0
    bias: bool = False


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation on ``gate``/``up``: ``gate`` clamped to at most
    ``limit``, ``up`` to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha *
    gate)``."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True, slots=True)
class MoeNames:
    """Checkpoint names of a MoE layer's parts, under the layer's prefix.  Each expert's
    projections are ``{experts}.{e}.{gate|up|down}`` (or, where the checkpoint stacks
    them, ``{experts}.gate_up_proj`` ``[E, 2I, H]`` and ``{experts}.down_proj``)."""

    router: str = "mlp.gate"
    correction_bias: str = "mlp.gate.e_score_correction_bias"
    experts: str = "mlp.experts"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "mlp.shared_expert"  # {shared}.gate_proj ... (the dense MLP's names)
    shared_gate: str = "mlp.shared_expert_gate"
    # gpt-oss stacks its experts transposed, gate and up columns alternating:
    # ``gate_up_proj`` [E, H, 2I] (column 2j: gate j, 2j + 1: up j), ``down_proj`` [E, I, H],
    # with biases ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H].
    interleaved_gate_up: bool = False


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts MLP: routed SiLU-gated experts of width ``intermediate_size``
    (with ``activation`` set: gpt-oss's clamped SwiGLU; with ``expert_bias``: a bias on
    each expert's gate/up and down projections), plus an always-on shared expert (width
    ``shared_intermediate_size``; 0: none) whose output is scaled by ``sigmoid(x . w)`` when
    ``shared_gate`` (Qwen2-MoE).  ``layers`` says per layer whether its MLP is the MoE one
    (else the dense ``MlpSpec`` MLP of ``ModelConfig.intermediate_size``: DeepSeek's first
    dense layers, Qwen's ``mlp_only_layers``)."""

    router: RouterSpec
    intermediate_size: int
    layers: tuple[bool, ...]
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    names: MoeNames = MoeNames()
    activation: ClampedSwiGLU | None = None
    expert_bias: bool = False


@dataclass(frozen=True, slots=True)
class MlaNames:
    """Checkpoint names of a latent-attention layer's parts, under the layer's prefix (the
    output projection is ``WeightNames.o``)."""

    q: str = "self_attn.q_proj"  # when there is no query compression (q_lora_rank None)
    q_a: str = "self_attn.q_a_proj"
    q_a_norm: str = "self_attn.q_a_layernorm"
    q_b: str = "self_attn.q_b_proj"
    kv_a: str = "self_attn.kv_a_proj_with_mqa"
    kv_a_norm: str = "self_attn.kv_a_layernorm"
    kv_b: str = "self_attn.kv_b_proj"


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; ``model/mla.py`` implements it).

    Keys and values come from one compressed latent per token: ``kv_a`` maps the hidden
    state to ``kv_lora_rank`` latent features (RMS-normed) plus ``qk_rope_head_dim`` rotary
    key features shared by every head; ``kv_b`` expands the latent to each head's
    ``qk_nope_head_dim`` key and ``v_head_dim`` value features.  Queries are
    ``qk_nope_head_dim + qk_rope_head_dim`` per head, through a ``q_lora_rank`` bottleneck
    (RMS-normed) or one projection when ``q_lora_rank`` is None.  The paged cache holds, per
    token, the normed latent and the rotated rope key: :attr:`cache_width` values, one
    "head".  ``interleaved_rope``: the checkpoint's rope features rotate in adjacent pairs
    (DeepSeek's layout; permuted into halves at load)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    norm_eps: float = 1e-6  # the q_a / kv_a RMSNorms (transformers builds them with 1e-6)
    bias: bool = False  # q_a, kv_a and o projections (``attention_bias``)
    interleaved_rope: bool = True
    names: MlaNames = MlaNames()

    @property
    def cache_width(self) -> int:
        """Values the cache holds per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class QKVLayout(StrEnum):
    SEPARATE = "separate"  # q_proj, k_proj, v_proj
    FUSED = "fused"  # one [q | k | v] matrix (Phi-3 qkv_proj)
    PER_HEAD = "per_head"  # [head0 q k v | head1 q k v | ...] (GPT-NeoX query_key_value)


@dataclass(frozen=True, slots=True)
class WeightNames:
    """Checkpoint names of each part (without ``.weight``/``.bias``); ``{i}`` is the layer.

    ``q``/``k``/``v`` name the separate projections, or (``qkv_layout`` fused/per-head) ``q``
    names the one fused matrix.  ``gate`` empty with a gated MLP means ``up`` holds
    ``[gate | up]`` (Phi-3 ``gate_up_proj``)."""

    embed: str = "model.embed_tokens"
    layer: str = "model.layers.{i}"
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    qkv_layout: QKVLayout = QKVLayout.SEPARATE
    o: str = "self_attn.o_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    sinks: str = "self_attn.sinks"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    pre_attn_norm: str = "input_layernorm"
    post_attn_norm: str = "post_attention_layernorm"
    pre_mlp_norm: str = "post_attention_layernorm"
    post_mlp_norm: str = "post_feedforward_layernorm"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    lm_head_bias: bool = False  # Phi-2

    def projection_names(self) -> tuple[str, ...]:
        return (self.layer, self.q, self.k, self.v, self.o, self.gate, self.up, self.down)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the native decoder is built from (see the module docstring)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    # The rotary embedding of the global layers (the one --rope-scaling rewrites).
    rope: RopeConfig
    # Per layer: attend only to the last ``w`` positions (Mistral, sliding layers).
    sliding_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...] = ()
    norm: NormSpec = NormSpec()
    attention: AttentionSpec = AttentionSpec()
    mlp: MlpSpec = MlpSpec()
    block: BlockSpec = BlockSpec()
    names: WeightNames = WeightNames()
    # Per layer: which rotary embedding it uses (0: ``rope``; 1: ``local_rope``), None: none
    # (SmolLM3's no-rope layers).  Empty: every layer uses ``rope``.
    layer_ropes: tuple[int | None, ...] = ()
    # Gemma 3's sliding layers rotate with their own base.
    local_rope: RopeConfig | None = None
    # Token embeddings are multiplied by this (Gemma: sqrt(hidden); Granite's multiplier).
    embed_scale: float = 1.0
    # Logits are multiplied by ``logit_scale`` (Cohere), divided by ``logit_divisor``
    # (Granite's logits_scaling), then soft-capped (Gemma 2).
    logit_scale: float = 1.0
    logit_divisor: float = 1.0
    final_softcap: float | None = None
    # Mixture-of-experts MLPs (None: every layer's MLP is dense).
    moe: MoeSpec | None = None
    # Multi-head latent attention in every layer (None: the q/k/v attention of ``attention``);
    # ``head_dim`` is then its rotary width and ``num_kv_heads`` 1 (the latent, see MlaSpec).
    mla: MlaSpec | None = None

    @property
    def qkv_bias(self) -> bool:
        return self.attention.qkv_bias

    @property
    def rms_norm_eps(self) -> float:
        return self.norm.eps

    @property
    def lora_blocker(self) -> str | None:
        """Why LoRA adapters cannot be applied to this model (None: they can): the
        adapter paths name Llama's separate projections, unpermuted."""
        n, attn = self.names, self.attention
        if self.mla is not None:
            return "its latent attention has no adapter path"
        if self.moe is not None:
            return "its mixture-of-experts MLPs have no adapter path"
        if n.qkv_layout is not QKVLayout.SEPARATE or not n.gate or not self.mlp.gated:
            return "its checkpoint fuses the q/k/v or gate/up projections"
        if (attn.rotary_dim or self.head_dim) != self.head_dim or attn.interleaved_rotary:
            return "its partial or interleaved rotary permutes the q/k projections"
        if n.projection_names() != WeightNames().projection_names():
            return "its projections are not named as Llama's"
        return None

    def rope_index(self, layer: int) -> int | None:
        return self.layer_ropes[layer] if self.layer_ropes else 0
