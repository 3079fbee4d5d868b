"""The built-in model: a 3.4M-parameter Qwen3-VL-MoE trained on this project's synthetic scenes
(`scenes.py`; trained by `tools/builtin_train.py`), shipped with the package in the published checkpoint layout. It is what
`serve`, `generate`, `caption`, `demo` and `Engine()` run when no model is named."""

from pathlib import Path

BUILTIN_MODEL = Path(__file__).resolve().with_name("qwen3-vl-shapes")
# its EAGLE-3 draft head (`tools/builtin_train_eagle3.py`), in the published layout
BUILTIN_DRAFT = Path(__file__).resolve().with_name("qwen3-vl-shapes-eagle3")
