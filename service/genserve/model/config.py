"""The architecture description the native model is built from.

``config.json`` is parsed by transformers' ``AutoConfig`` (which knows every historical
spelling: ``rope_theta``/``rope_scaling`` vs ``rope_parameters``, Qwen2's
``use_sliding_window``, ...) and reduced by the family's module (``model/families``) to the
typed spec of ``model/spec.py``.  The model code never touches a transformers object.
The spec is remembered per directory under the model cache (``model/derived_memo.py``):
later starts skip transformers' config classes, whose import costs ~1.1 s.
"""

from __future__ import annotations

from pathlib import Path

from genserve.model import families
from genserve.model.derived_memo import DerivedMemo
from genserve.model.families import NATIVE_ARCHITECTURES, config_from_hf
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


def load_model_config(
    model_dir: Path, trust_remote_code: bool = False, memo_dir: Path | None = None
) -> ModelConfig:
    """The native spec of ``model_dir/config.json`` (:class:`UnsupportedModelError` where no
    native family serves it): remembered in ``memo_dir`` the first time, read from there
    after (None: always through ``AutoConfig``)."""
    memo = DerivedMemo(memo_dir, model_dir, trust_remote_code)
    remembered = memo.spec()
    if remembered is not None:
        return remembered
    config = families.load_model_config(model_dir, trust_remote_code)
    memo.remember_spec(config)
    return config
