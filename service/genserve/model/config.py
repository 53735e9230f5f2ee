"""The architecture description the native model is built from.

``config.json`` is parsed by transformers' ``AutoConfig`` (which knows every historical
spelling: ``rope_theta``/``rope_scaling`` vs ``rope_parameters``, Qwen2's
``use_sliding_window``, ...) and reduced by the family's module (``model/families``) to the
typed spec of ``model/spec.py``.  The model code never touches a transformers object.
"""

from __future__ import annotations

from genserve.model.families import NATIVE_ARCHITECTURES, config_from_hf, load_model_config
from genserve.model.spec import ModelConfig, RopeConfig, UnsupportedModelError

# Kept for the callers that name the native architectures.
SUPPORTED_ARCHITECTURES = NATIVE_ARCHITECTURES

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "RopeConfig",
    "UnsupportedModelError",
    "config_from_hf",
    "load_model_config",
]
