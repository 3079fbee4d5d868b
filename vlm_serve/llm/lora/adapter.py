"""LoRA adapters as `peft` saves them (`adapter_config.json` + `adapter_model.safetensors`), read and checked,
and put into the model's layers' slots (`LoRAManager`).

A PEFT tensor is named after the module it adapts (`base_model.model.model.language_model.layers.3.self_attn.
q_proj.lora_A.weight`); our fused projections take q/k/v and gate/up as parts, as the checkpoint loader does
(`stacked_name`). The scaling is `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from vlm_serve.config import ModelConfig
from vlm_serve.llm.layers.linear import LinearBase
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.llm.lora.experts import ExpertLoRASlots
from vlm_serve.llm.lora.layer import LoRASlots
from vlm_serve.llm.models.base import VISION_PREFIX, stacked_name
from vlm_serve.llm.models.registry import model_family

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TOWER = VISION_PREFIX  # the vision tower's modules (and its mergers')
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
    digest: str = ""  # of its two files: what tells two servers' adapters of one name apart

    @property
    def identity(self) -> str:
        return f"{self.name!r} ({self.digest})"

    @property
    def adapts_tower(self) -> bool:
        return any(module.startswith(TOWER) for module, _ in self.tensors)

    @property
    def adapts_lm(self) -> bool:
        return any(not module.startswith(TOWER) for module, _ in self.tensors)


@dataclass(frozen=True)
class TowerAdapter:
    """What an encoder needs to run pictures through an adapter's vision-tower part: where to read it, and
    its load id (new at every load; it keys the embeddings the adapter makes)."""

    name: str
    path: str
    load_id: int


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
        if ".base_layer" in module or module.endswith(".experts"):  # (peft's target_parameters: one per nesting)
            tensors[module.split(".base_layer")[0], f"parameter {module.count('.base_layer')}"] = (ab["A"], ab["B"])
            continue
        ours, part = stacked_name(module + ".weight")
        tensors[ours.removesuffix(".weight"), part] = (ab["A"], ab["B"])
    digest = hashlib.blake2b(digest_size=8)
    for file in (CONFIG, WEIGHTS):
        with open(path / file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return LoRAAdapter(name, path, rank, scaling, tensors, digest.hexdigest())


class LoRAManager:
    """The adapters resident in a model: up to `max_loras` slots in the layers they target.

    `prefix` is what an adapter's module names start with in `model` (TOWER for a vision tower alone);
    an adapter's modules elsewhere are left to another manager. `also`: the modules such a manager has,
    which the adapter may target too (the LM's manager knows the tower's, whose encoders load them); None
    where another manager has checked the adapter already."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, prefix: str = "", also: Collection[str] | None = ()
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.linears = {prefix + name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
        # mixture-of-experts blocks, by the name peft gives their fused experts
        self.experts = {
            prefix + name + ".experts": m for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)
        }
        self.also = also
        self.slots: list[LoRAAdapter | None] = [None] * max_loras
        self.ids = [0] * max_loras  # each slot's adapter's id: a new one at every load (its KV's cache namespace)
        self._loads = 0

    def load(self, adapter: LoRAAdapter) -> int:
        """Puts `adapter` in a free slot; returns the slot."""
        modules = {module for module, _ in adapter.tensors}
        if self.also is not None:
            unknown = sorted(modules - set(self.linears) - set(self.experts) - set(self.also))
            if unknown:
                raise LoRAError(
                    f"LoRA adapter {adapter.name!r} targets modules this model has no linear layer for: {unknown[:5]}"
                )
        if None not in self.slots:
            raise LoRAError(f"no free LoRA slot for {adapter.name!r}: {self.max_loras} adapters are loaded")
        slot = self.slots.index(None)
        self.slots[slot] = adapter
        try:
            for (module, part), (a, b) in adapter.tensors.items():
                if module in self.linears:
                    self._set(slot, module, part, a, b, adapter.scaling)
                elif module in self.experts:
                    self._set_experts(slot, self.experts[module], a, b, adapter)
        except ValueError as exc:  # (shapes that are not the model's)
            self.unload(slot)
            raise LoRAError(f"LoRA adapter {adapter.name!r} does not fit this model: {module}: {exc}") from None
        self._loads += 1
        self.ids[slot] = self._loads
        return slot

    def _set(self, slot: int, module: str, part: int | str | None, a: torch.Tensor, b: torch.Tensor, scaling: float):
        linear = self.linears[module]
        if linear.lora is None:
            linear.lora = LoRASlots(linear, self.max_loras, self.max_rank, PARTS_OF.get(module.rsplit(".", 1)[-1], 1))
        linear.lora.set(slot, part, a, b, scaling)

    def _set_experts(self, slot: int, block: SparseMoeBlock, a: torch.Tensor, b: torch.Tensor, adapter: LoRAAdapter):
        if block.packed is not None and not block.keep_dense:
            raise ValueError("the experts were packed for the CPU kernel alone (a model loaded without LoRA)")
        if block.lora is None:
            block.lora = ExpertLoRASlots(block, self.max_loras, self.max_rank)
        which = block.lora.which(a, b)
        if which is None:
            raise ValueError(
                f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit neither gate_up_proj nor down_proj"
            )
        block.lora.set(slot, which, a, b, adapter.rank, adapter.scaling)

    def resolve(self, name: str) -> tuple[int, int]:
        """The slot and id of the loaded adapter `name`."""
        for slot, adapter in enumerate(self.slots):
            if adapter is not None and adapter.name == name:
                return slot, self.ids[slot]
        loaded = sorted(a.name for a in self.slots if a is not None)
        raise LoRAError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")

    def loaded(self, load_id: int) -> LoRAAdapter | None:
        """The adapter of load `load_id`, while it is loaded (None for 0: the base)."""
        slot = self.ids.index(load_id) if load_id in self.ids else None
        return self.slots[slot] if load_id and slot is not None else None

    def tower(self, slot: int) -> TowerAdapter | None:
        """What the encoders need of the adapter in `slot`, if it adapts the vision tower."""
        adapter = self.slots[slot]
        return TowerAdapter(adapter.name, str(adapter.path), self.ids[slot]) if adapter.adapts_tower else None

    def unload(self, slot: int) -> None:
        for layer in (*self.linears.values(), *self.experts.values()):
            if layer.lora is not None:
                layer.lora.clear(slot)
        self.slots[slot] = None


def tower_modules(model_config: ModelConfig) -> set[str]:
    """The names adapters give the vision tower's linear layers (the tower built without memory)."""
    with torch.device("meta"):
        tower = model_family(model_config).vision(model_config.vision)
    return {TOWER + name for name, m in tower.named_modules() if isinstance(m, LinearBase)}


class TowerLoRA:
    """The vision tower's adapters in an encoder: read from their folders when a picture first needs one
    (by load id), up to `max_loras` resident, the least recently used replaced."""

    def __init__(self, visual: nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.manager = LoRAManager(visual, max_loras, max_rank, TOWER, also=None)
        self.resident: OrderedDict[int, int] = OrderedDict()  # load id -> slot
        self._lock = threading.Lock()  # (an encode on the side may overlap one between forwards)

    @contextlib.contextmanager
    def using(self, adapters: list[TowerAdapter | None]) -> Iterator[list[int]]:
        """Each item's slot (-1: the base), held for the encode inside; what is not resident is loaded. The
        items need at most `max_loras` adapters."""
        with self._lock:
            wanted = {a.load_id: a for a in adapters if a is not None}
            for load_id, adapter in wanted.items():
                if load_id in self.resident:
                    self.resident.move_to_end(load_id)
                    continue
                if None not in self.manager.slots:
                    victim = next(i for i in self.resident if i not in wanted)
                    self.manager.unload(self.resident.pop(victim))
                read = read_adapter(adapter.name, adapter.path, self.manager.max_rank)
                self.resident[load_id] = self.manager.load(read)
            yield [self.resident[a.load_id] if a is not None else -1 for a in adapters]
