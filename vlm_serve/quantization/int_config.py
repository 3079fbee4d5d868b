"""Integer weights as llm-compressor (compressed-tensors), AutoAWQ and GPTQ checkpoints hold them: which linear
layers a checkpoint quantizes, and how, read from `config.json`'s `quantization_config`.

Every format here stores a weight W [out, in] as unsigned b-bit codes q (b = 4 or 8), a scale s per output
row and group of `group_size` input columns (or one group of all of them: per channel), and a zero point z
per row and group (asymmetric) or z = 2^(b-1) (symmetric): W = (q - z) * s. The formats differ in how
codes and zero points are packed into words and named (`int_packing`), and in how they say which layers
are quantized:
- compressed-tensors (llm-compressor's `oneshot`): `config_groups`, each a scheme with `targets` (module
  names, `re:` regexes matched from the start, or the class name `Linear`), and an `ignore` list of the
  same kinds; `format` "pack-quantized" (4- or 8-bit codes in int32 words: W4A16, W8A16) or
  "int-quantized" (int8 tensors; with int8 activations quantized per token at run time: W8A8);
- AutoAWQ's GEMM layout: 4-bit, zero points, groups; `modules_to_not_convert` by name piece;
- GPTQ (AutoGPTQ, GPTQModel): 4 or 8 bits, symmetric or not, `desc_act` (each input column's group in
  `g_idx`); the layers that carry `qweight` are the quantized ones.
What is refused is refused here, by the setting's name, before a tensor is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METHODS = ("compressed-tensors", "awq", "gptq")  # integer `quant_method`s this project reads
BITS = (4, 8)
# what vLLM's users name these formats on the command line (its kernels' names): the same checkpoints
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "cpu_awq": "awq", "cpu_gptq": "gptq"}


@dataclass(frozen=True)
class IntScheme:
    """How one layer's weight is quantized, whatever the format that packs it."""

    bits: int  # 4 or 8
    group_size: int | None  # input columns per scale; None: one group of them all (per channel)
    symmetric: bool  # no zero points stored: z = 2^(bits - 1)
    act_order: bool = False  # input columns in groups by `g_idx` (GPTQ's desc_act), not in runs
    int8_activations: bool = False  # W8A8: each input row quantized to int8 at run time (dynamic, per token)

    def groups(self, columns: int) -> int:
        """Scales per row of a weight with `columns` input columns (the last group may be partial)."""
        return 1 if self.group_size is None else -(-columns // self.group_size)

    @property
    def zero(self) -> int:
        """The zero point of a symmetric scheme's codes."""
        return 1 << (self.bits - 1)

    def describe(self) -> str:
        group = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        acts = "int8 activations" if self.int8_activations else "float activations"
        return f"{self.bits}-bit, {'symmetric' if self.symmetric else 'zero points'}, {group}, {acts}"


@dataclass(frozen=True)
class SchemeGroup:
    """A compressed-tensors config group: the modules it targets, its scheme and its storage format."""

    targets: tuple[str, ...]
    scheme: IntScheme
    layout: str  # "pack-quantized", "int-quantized" (compressed-tensors), "awq", "gptq", "gptq_v2"


@dataclass(frozen=True)
class IntQuantConfig:
    """A checkpoint's integer quantization: the scheme of each linear layer it quantizes."""

    method: str  # compressed-tensors, awq or gptq
    groups: tuple[SchemeGroup, ...]
    ignore: tuple[str, ...] = ()  # modules kept unquantized (compressed-tensors' and AWQ's own matching)

    @classmethod
    def from_dict(cls, config: dict) -> IntQuantConfig:
        """Reads `quantization_config`; refuses what this project cannot serve, naming the setting."""
        method = config.get("quant_method")
        if method == "compressed-tensors":
            return _compressed_tensors(config)
        if method == "awq":
            return _awq(config)
        if method == "gptq":
            return _gptq(config)
        raise ValueError(f"quant_method {method!r} is not an integer format ({', '.join(METHODS)})")

    def layout_of(self, module: str) -> tuple[IntScheme, str] | None:
        """(scheme, layout) of the Linear module `module` (checkpoint name), or None where it is kept as is."""
        if any(_matches(module, entry, self.method) for entry in self.ignore):
            return None
        for kind in ("name", "regex", "class"):  # (compressed-tensors' precedence: exact, then regex, then class)
            for group in self.groups:
                if any(_target_kind(t) == kind and _matches(module, t, self.method) for t in group.targets):
                    return group.scheme, group.layout
        return None

    def stored_quantized(self, module: str) -> bool:
        """Whether the checkpoint must hold the Linear module `module` quantized: compressed-tensors says so
        by name; AWQ and GPTQ checkpoints say it by the tensors they hold (`qweight`), leaving out routers,
        `lm_head` and vision towers without listing them."""
        return self.method == "compressed-tensors" and self.layout_of(module) is not None

    @property
    def int8_activations(self) -> bool:
        return any(group.scheme.int8_activations for group in self.groups)

    def describe(self) -> str:
        schemes = sorted({group.scheme.describe() for group in self.groups})
        return f"{self.method} ({'; '.join(schemes)})"


def _target_kind(target: str) -> str:
    return "regex" if target.startswith("re:") else "class" if target == "Linear" else "name"


def _matches(module: str, entry: str, method: str) -> bool:
    if entry == "Linear":
        return True
    if method == "awq":  # (AutoAWQ's and vLLM's: a piece of the name)
        return entry in module
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry == module


# -- compressed-tensors -------------------------------------------------------------------------------------

CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


def _compressed_tensors(config: dict) -> IntQuantConfig:
    _refuse_set(config, "sparsity_config", "2:4 sparsity and other sparse formats are not supported")
    _refuse_set(config, "transform_config", "transforms (SpinQuant, QuIP) are not supported")
    _refuse_set(config, "kv_cache_scheme", "a quantized KV cache is not supported")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"quantization_status {status!r} is not supported (a checkpoint saved compressed)")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("config_groups is empty: no layer is quantized")
    read = []
    for name, group in groups.items():
        where = f"config_groups.{name}"
        layout = group.get("format") or config.get("format")
        if layout not in CT_FORMATS:
            raise ValueError(f"{where}: format {layout!r} is not supported (supported: {', '.join(CT_FORMATS)})")
        if group.get("output_activations"):
            raise ValueError(f"{where}.output_activations: quantized outputs are not supported")
        targets = tuple(group.get("targets") or ())
        scheme = _ct_weights(group.get("weights"), f"{where}.weights")
        activations = group.get("input_activations")
        if activations:
            _ct_activations(activations, f"{where}.input_activations")
            if scheme.bits != 8 or scheme.group_size is not None or not scheme.symmetric:
                raise ValueError(
                    f"{where}: int8 activations go with symmetric per-channel int8 weights (W8A8), not {scheme.describe()}"
                )
            scheme = IntScheme(8, None, True, int8_activations=True)
        if layout != "pack-quantized" and scheme.bits != 8:
            raise ValueError(f"{where}: format {layout!r} holds 8-bit weights, not {scheme.bits}-bit")
        read.append(SchemeGroup(targets, scheme, "pack-quantized" if layout == "pack-quantized" else "int-quantized"))
    return IntQuantConfig("compressed-tensors", tuple(read), tuple(config.get("ignore") or ()))


def _ct_weights(args: dict | None, where: str) -> IntScheme:
    if not args:
        raise ValueError(f"{where}: missing (only weight quantization is supported)")
    if args.get("type", "int") != "int":
        raise ValueError(f"{where}.type {args['type']!r} is not supported (integer weights only: 'int')")
    bits = args.get("num_bits")
    if bits not in BITS:
        raise ValueError(f"{where}.num_bits {bits!r} is not supported (supported: 4, 8)")
    if args.get("dynamic"):
        raise ValueError(f"{where}.dynamic: dynamic weight quantization is not supported")
    if args.get("block_structure"):
        raise ValueError(f"{where}.block_structure: block-wise integer scales are not supported")
    strategy = args.get("strategy")
    group = args.get("group_size")
    if strategy == "group":
        _check_group(group, bits, f"{where}.group_size")
    elif strategy == "channel":
        group = None
    else:
        raise ValueError(f"{where}.strategy {strategy!r} is not supported (supported: 'group', 'channel')")
    actorder = args.get("actorder")
    if actorder not in (None, "group", "weight", "static", "dynamic"):
        raise ValueError(f"{where}.actorder {actorder!r} is not supported")
    # (only "group" stores each column's group; "weight" and "static" quantized in activation order but
    # kept the groups in runs of columns)
    return IntScheme(bits, group, bool(args.get("symmetric", True)), act_order=actorder == "group")


def _ct_activations(args: dict, where: str) -> None:
    wanted = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
    for key, value in wanted.items():
        if args.get(key, "int" if key == "type" else None) != value:
            raise ValueError(
                f"{where}.{key} {args.get(key)!r} is not supported (activations: dynamic symmetric int8 per token)"
            )


def _check_group(group, bits: int, where: str) -> None:
    rows = 32 // bits  # (codes per 32-bit word: a group is whole words)
    if not isinstance(group, int) or group <= 0 or group % rows:
        raise ValueError(f"{where} {group!r} is not supported (a positive multiple of {rows}: 32, 64, 128, ...)")


def _refuse_set(config: dict, key: str, why: str) -> None:
    if config.get(key):
        raise ValueError(f"{key}: {why}")


# -- AutoAWQ, GPTQ ------------------------------------------------------------------------------------------


def _awq(config: dict) -> IntQuantConfig:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (supported: 'gemm')")
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ bits {bits!r} is not supported (supported: 4)")
    if not config.get("zero_point", True):
        raise ValueError("AWQ zero_point false is not supported (AutoAWQ's GEMM layout has zero points)")
    group = config.get("group_size", config.get("q_group_size"))
    _check_group(group, bits, "AWQ group_size")
    scheme = IntScheme(4, group, symmetric=False)
    return IntQuantConfig(
        "awq", (SchemeGroup(("Linear",), scheme, "awq"),), tuple(config.get("modules_to_not_convert") or ())
    )


def _gptq(config: dict) -> IntQuantConfig:
    bits = config.get("bits")
    if bits not in BITS:
        raise ValueError(f"GPTQ bits {bits!r} is not supported (supported: 4, 8)")
    layout = config.get("checkpoint_format", "gptq")
    if layout not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {layout!r} is not supported (supported: 'gptq', 'gptq_v2')")
    if config.get("lm_head"):
        raise ValueError("GPTQ lm_head true: a quantized lm_head is not supported")
    if config.get("dynamic"):
        raise ValueError("GPTQ dynamic: per-module overrides are not supported")
    group = config.get("group_size", 128)
    if group == -1:
        group = None
    else:
        _check_group(group, bits, "GPTQ group_size")
    scheme = IntScheme(bits, group, bool(config.get("sym", True)), act_order=bool(config.get("desc_act")))
    return IntQuantConfig("gptq", (SchemeGroup(("Linear",), scheme, layout),))
