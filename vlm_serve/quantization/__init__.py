"""Quantized checkpoints: what `config.json`'s `quantization_config` says, and each format's arithmetic. FP8 with
block scales (Qwen's FP8 releases: `fp8`) and integer weights (compressed-tensors, AWQ, GPTQ: `int_config`,
their packings in `int_packing`)."""

from __future__ import annotations

import json
from pathlib import Path

from vlm_serve.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Config,
    dequantize_fp8_blocks,
    dequantize_rows,
    quantize_fp8_blocks,
    row_scales,
    shard_scale,
    shard_scales,
)
from vlm_serve.quantization.int_config import ALIASES, IntQuantConfig, IntScheme
from vlm_serve.quantization.int_config import METHODS as INT_METHODS

QuantConfig = Fp8Config | IntQuantConfig
QUANT_METHODS = ("fp8", *INT_METHODS)  # the `quant_method`s this project reads

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANT_METHODS",
    "Fp8Config",
    "IntQuantConfig",
    "IntScheme",
    "QuantConfig",
    "dequantize_fp8_blocks",
    "dequantize_rows",
    "quantize_fp8_blocks",
    "read_quantization_config",
    "row_scales",
    "shard_scale",
    "shard_scales",
]


def read_quantization_config(model_dir: str | Path, method: str | None = None) -> QuantConfig | None:
    """The checkpoint's quantization (from `config.json`), or None when its weights are not quantized.
    `method` (`--quantization`) names the format the user expects: a checkpoint of another, or none, is
    refused, as vLLM refuses it."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()).get("quantization_config")
    expected = ALIASES.get(method, method)
    if expected is not None and expected not in QUANT_METHODS:
        raise ValueError(f"--quantization {method!r} is not supported (supported: {', '.join(QUANT_METHODS)})")
    found = None if config is None else config.get("quant_method")
    if expected is not None and found != expected:
        what = "no quantization_config" if config is None else f"quant_method {found!r}"
        raise ValueError(f"--quantization {method}: {path} has {what} (weights are served as stored)")
    if config is None:
        return None
    try:
        if found not in QUANT_METHODS:
            raise ValueError(
                f"quant_method {found!r} is not supported (supported: {', '.join(repr(m) for m in QUANT_METHODS)})"
            )
        return Fp8Config.from_dict(config) if found == "fp8" else IntQuantConfig.from_dict(config)
    except ValueError as e:
        raise ValueError(f"{path}: quantization_config: {e}") from None
