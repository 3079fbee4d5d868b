"""Integer-quantized checkpoints for the tests, and their oracles.

- `dequantized`: a compressed-tensors checkpoint's real weights, decompressed by the compressed-tensors
  package itself (in float32: its scales widened first, so that (q - zero) * scale is exact), written as
  a plain float32 checkpoint transformers reads (experts fused as the published bf16 releases store them).
- `to_awq`, `to_gptq`: the same integers packed as AutoAWQ's GEMM layout and GPTQ's (v1, v2, desc_act)
  by packers of their own, written the way those libraries write them (AWQ's nibble order 0 2 4 6 1 3 5 7,
  GPTQ's zero points less one in v1, float16 scales): so every format that loads must give the tokens of
  one dequantized model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file

from vlm_serve.testing.quantized import PROCESSOR_FILES

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # (AutoAWQ's `order_map`: nibble i of a word holds column AWQ_ORDER[i])
EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _read(src: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(config, plain tensors, quantized modules' tensors by module and piece)."""
    config = json.loads((src / "config.json").read_text())
    plain, modules = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        module, piece = name.rsplit(".", 1)
        if piece.startswith("weight_") or (piece == "weight" and tensor.dtype == torch.int8):
            modules.setdefault(module, {})[piece] = tensor
        else:
            plain[name] = tensor
    return config, plain, modules


def _scheme(config: dict):
    groups = QuantizationConfig.model_validate(config["quantization_config"]).config_groups
    assert len(groups) == 1, "one scheme per test checkpoint"
    return next(iter(groups.values()))


def _write(dst: Path, src: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in PROCESSOR_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def dequantized(src: Path, dst: Path) -> Path:
    """The compressed-tensors checkpoint `src` with its real weights in float32 (transformers' oracle)."""
    config, plain, modules = _read(src)
    scheme = _scheme(config)
    compressor = BaseCompressor.get_value_from_registry(scheme.format or config["quantization_config"]["format"])
    tensors = {name: t.float() for name, t in plain.items()}
    for module, pieces in modules.items():
        pieces = {**pieces, "weight_scale": pieces["weight_scale"].float()}
        tensors[f"{module}.weight"] = compressor.decompress(pieces, scheme)["weight"].float()
    tensors = _fused_experts(tensors)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["torch_dtype"] = config["dtype"] = config["text_config"]["dtype"] = "float32"
    return _write(dst, src, config, tensors)


def _fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Experts one by one as the published releases fuse them: gate_up_proj (E, H, 2I), down_proj (E, I, H)."""
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
    for prefix, by_index in experts.items():
        ordered = [by_index[e] for e in range(len(by_index))]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]).T for p in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([p["down_proj"].T for p in ordered])
    return out


def integers(
    src: Path,
) -> tuple[dict, dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """A pack-quantized checkpoint's weights as unsigned codes (out, in), scales (out, groups) and unsigned
    zero points (out, groups), read with compressed-tensors' own unpacking: (config, plain tensors, those)."""
    config, plain, modules = _read(src)
    args = _scheme(config).weights
    offset = 1 << (args.num_bits - 1)
    read = {}
    for module, pieces in modules.items():
        shape = pieces["weight_shape"].tolist()
        codes = unpack_from_int32(pieces["weight_packed"], args.num_bits, torch.Size(shape)).to(torch.int32) + offset
        scale = pieces["weight_scale"]
        if args.symmetric:
            zero = torch.full(scale.shape, offset, dtype=torch.int32)
        else:
            zp_shape = torch.Size([shape[0], scale.shape[1]])
            zero = (
                unpack_from_int32(pieces["weight_zero_point"], args.num_bits, zp_shape, packed_dim=0).to(torch.int32)
                + offset
            )
        read[module] = (codes, scale, zero)
    return config, plain, read


def _words(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Unsigned values (..., n) packed along the last dimension, 32 / bits to an int32 word, value i of
    each word (in `order`, else in turn) in bits bits * i and up."""
    per = 32 // bits
    grouped = values.to(torch.int64).unflatten(-1, (-1, per))
    if order is not None:
        grouped = grouped[..., order]
    words = (grouped << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def to_awq(src: Path, dst: Path) -> Path:
    """The 4-bit grouped checkpoint `src` in AutoAWQ's GEMM layout: qweight (in, out / 8), qzeros
    (groups, out / 8), both in AWQ's column order, scales (groups, out) float16."""
    config, plain, read = integers(src)
    args = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    tensors = dict(plain)
    for module, (codes, scale, zero) in read.items():
        tensors[f"{module}.qweight"] = _words(codes.T, 4, AWQ_ORDER)
        tensors[f"{module}.qzeros"] = _words(zero.T, 4, AWQ_ORDER)
        tensors[f"{module}.scales"] = scale.T.to(torch.float16)
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": args["group_size"],
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": ["visual"],
    }
    return _write(dst, src, config, tensors)


def to_gptq(src: Path, dst: Path, checkpoint_format: str = "gptq", act_order: bool = False) -> Path:
    """The checkpoint `src` in GPTQ's layout: qweight (in * bits / 32, out), packed along `in`; qzeros
    (groups, out * bits / 32), each zero point less one where `checkpoint_format` is "gptq" (v1); scales
    (groups, out) float16; g_idx (in). With `act_order` (desc_act) the groups are numbered in another order
    (a fixed shuffle): the same weights, their columns' groups told by g_idx alone."""
    config, plain, read = integers(src)
    args = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    bits, group = args["num_bits"], args["group_size"]
    tensors = dict(plain)
    for module, (codes, scale, zero) in read.items():
        columns, groups = codes.shape[1], scale.shape[1]
        g_idx = torch.arange(columns, dtype=torch.int32) // (group or columns)
        if act_order:  # group g's columns are told group order[g]; its scale and zero point move there
            order = torch.roll(torch.arange(groups), 1).flip(0)
            g_idx, scale, zero = order[g_idx.long()].to(torch.int32), scale.clone(), zero.clone()
            scale[:, order], zero[:, order] = scale.clone(), zero.clone()
        stored = (zero - 1) & ((1 << bits) - 1) if checkpoint_format == "gptq" else zero
        tensors[f"{module}.qweight"] = _words(codes, bits).T
        tensors[f"{module}.qzeros"] = _words(stored.T, bits)
        tensors[f"{module}.scales"] = scale.T.to(torch.float16)
        tensors[f"{module}.g_idx"] = g_idx
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group or -1,
        "desc_act": act_order,
        "sym": bool(args["symmetric"]),
        "checkpoint_format": checkpoint_format,
    }
    return _write(dst, src, config, tensors)
