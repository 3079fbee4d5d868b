"""LoRA adapters as `peft` saves them (`adapter_config.json` + `adapter_model.safetensors`), read and checked,
and put into the model's layers' slots (`LoRAManager`).

A PEFT tensor is named after the module it adapts (`base_model.model.model.language_model.layers.3.self_attn.
q_proj.lora_A.weight`); our fused projections take q/k/v and gate/up as parts, as the checkpoint loader does
(`stacked_name`). The scaling is `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from vlm_serve.llm.layers.linear import LinearBase
from vlm_serve.llm.lora.layer import LoRASlots
from vlm_serve.llm.models.qwen3_vl import stacked_name

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TOWER = "model.visual."  # the vision tower's modules (and its merger's)
PARTS_OF = {"qkv_proj": 3, "gate_up_proj": 2}  # fused projections: parts, each with ranks of its own
# what this reader does not do, by adapter_config.json's key: refused by name rather than served wrong
UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules saved whole (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out weights",
}


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the problem."""


@dataclass
class LoRAAdapter:
    """An adapter read from its folder: per module of ours and part, its (A, B) checkpoint tensors."""

    name: str
    path: Path
    rank: int
    scaling: float
    tensors: dict[tuple[str, int | str | None], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter in folder `path` (LoRAError naming the problem)."""
    path = Path(path)
    for file in (CONFIG, WEIGHTS):
        if not (path / file).is_file():
            raise LoRAError(f"LoRA adapter {name!r}: {path / file} is missing (an adapter as peft saves it)")
    try:
        config = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG} is not JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    unsupported = [what for key, what in UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"trained biases (bias {config['bias']!r})")
    if unsupported:
        raise LoRAError(f"LoRA adapter {name!r} uses what is not served here: {', '.join(unsupported)}")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        for key in f.keys():
            module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                whole = "the embeddings or the LM head" if "embed" in key or "lm_head" in key else "a module"
                raise LoRAError(f"LoRA adapter {name!r} saves {whole} whole ({key}): not served here")
            pairs.setdefault(module, {})[kind[0]] = f.get_tensor(key)
    tensors = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_{next(iter(ab))} without its pair")
        ours, part = stacked_name(module + ".weight")
        tensors[ours.removesuffix(".weight"), part] = (ab["A"], ab["B"])
    return LoRAAdapter(name, path, rank, scaling, tensors)


class LoRAManager:
    """The adapters resident in a model: up to `max_loras` slots in the layers they target."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
        self.slots: list[LoRAAdapter | None] = [None] * max_loras
        self.ids = [0] * max_loras  # each slot's adapter's id: a new one at every load (its KV's cache namespace)
        self._loads = 0

    def load(self, adapter: LoRAAdapter) -> int:
        """Puts `adapter` in a free slot; returns the slot."""
        tower = sorted({module for module, _ in adapter.tensors if module.startswith(TOWER)})
        if tower:  # (its embeddings would differ from the base's: the encoders and their cache must know it)
            raise LoRAError(f"LoRA adapter {adapter.name!r} adapts the vision tower ({tower[0]}, ...): not served yet")
        tensors = adapter.tensors
        unknown = sorted({module for module, _ in tensors} - set(self.linears))
        if unknown:
            raise LoRAError(f"LoRA adapter {adapter.name!r} targets modules this model does not have: {unknown[:5]}")
        if None not in self.slots:
            raise LoRAError(f"no free LoRA slot for {adapter.name!r}: {self.max_loras} adapters are loaded")
        slot = self.slots.index(None)
        for (module, part), (a, b) in tensors.items():
            linear = self.linears[module]
            if linear.lora is None:
                parts = PARTS_OF.get(module.rsplit(".", 1)[-1], 1)
                linear.lora = LoRASlots(linear, self.max_loras, self.max_rank, parts)
            linear.lora.set(slot, part, a, b, adapter.scaling)
        self.slots[slot] = adapter
        self._loads += 1
        self.ids[slot] = self._loads
        return slot

    def resolve(self, name: str) -> tuple[int, int]:
        """The slot and id of the loaded adapter `name`."""
        for slot, adapter in enumerate(self.slots):
            if adapter is not None and adapter.name == name:
                return slot, self.ids[slot]
        loaded = sorted(a.name for a in self.slots if a is not None)
        raise LoRAError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")

    def unload(self, slot: int) -> None:
        for linear in self.linears.values():
            if linear.lora is not None:
                linear.lora.clear(slot)
        self.slots[slot] = None
