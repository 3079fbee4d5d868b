"""vlm_serve: serving Qwen3-VL vision-language models. `from vlm_serve import Engine`."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "GenerateOutput"]


def __getattr__(name: str) -> Any:
    # imported on first use, so that `vlm_serve.config` and the CLI stay light
    if name in __all__:
        from vlm_serve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'vlm_serve' has no attribute {name!r}")
