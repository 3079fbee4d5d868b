"""Integer-quantized test checkpoints, made as the published ones are: llm-compressor's `oneshot` with a
round-to-nearest `QuantizationModifier` over a checkpoint of this project (`create_tiny_model`), the vision
tower, the MoE routers and `lm_head` ignored, saved compressed (compressed-tensors). W4A16 and W8A16 are
`pack-quantized`; W8A8 (int8 weights per channel, int8 activations per token at run time) `int-quantized`.

llm-compressor pins its own transformers, older than the one the tests use as their oracle, so it lives in
an environment of its own (`QUANTIZER_ENV`, default `.llmcompressor/bin/python` at the top of the repository,
a venv made with `--system-site-packages` that the README's test command makes), which this module runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

QUANTIZER_ENV = "VLM_SERVE_QUANTIZER_PYTHON"  # a Python with llm-compressor
DEFAULT_QUANTIZER = Path(__file__).resolve().parents[2] / ".llmcompressor" / "bin" / "python"
# what `save_pretrained` of a quantized model leaves out: the tokenizer's and processor's files
PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "generation_config.json",
)
IGNORE = ("lm_head", "re:.*visual.*", "re:.*mlp.gate$")  # (llm-compressor's Qwen3-VL examples')


@dataclass(frozen=True)
class Recipe:
    """One quantization scheme of llm-compressor's `QuantizationModifier`."""

    bits: int = 4
    group_size: int | None = 32  # None: per channel
    symmetric: bool = True
    int8_activations: bool = False  # W8A8: dynamic per-token int8 inputs

    @property
    def name(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "channel"
        acts = "a8" if self.int8_activations else "a16"
        return f"w{self.bits}{acts}-{group}-{'sym' if self.symmetric else 'asym'}"


W4A16 = Recipe()
W8A8 = Recipe(bits=8, group_size=None, int8_activations=True)

ONESHOT = r"""
import json, sys, torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForImageTextToText

for job in json.loads(sys.argv[1]):
    r = job["recipe"]
    model = AutoModelForImageTextToText.from_pretrained(job["source"], dtype="auto")
    weights = QuantizationArgs(
        num_bits=r["bits"], type="int", symmetric=r["symmetric"],
        strategy="group" if r["group_size"] else "channel", group_size=r["group_size"],
    )
    acts = None
    if r["int8_activations"]:
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": scheme}, ignore=job["ignore"]))
    model.save_pretrained(job["out"], save_compressed=True)
"""


def quantizer_python() -> Path:
    """The Python that runs llm-compressor; a clear error where there is none."""
    python = Path(os.environ.get(QUANTIZER_ENV) or DEFAULT_QUANTIZER)
    if not python.exists():
        raise FileNotFoundError(
            f"no llm-compressor environment at {python}: make it with `python -m venv --system-site-packages "
            f".llmcompressor && .llmcompressor/bin/pip install llmcompressor==0.14.0.1` (or set ${QUANTIZER_ENV})"
        )
    return python


def quantize_checkpoints(
    jobs: list[tuple[Path, Path, Recipe]], ignore: tuple[str, ...] = IGNORE, run=subprocess.run
) -> list[Path]:
    """Each (source checkpoint, output folder, recipe) quantized by llm-compressor, in one process (its
    import takes seconds; `run` starts it), the source's tokenizer and processor files copied beside;
    returns the outputs."""
    payload = [
        {"source": str(src), "out": str(out), "recipe": asdict(r), "ignore": list(ignore)} for src, out, r in jobs
    ]
    result = run(
        [str(quantizer_python()), "-c", ONESHOT, json.dumps(payload)],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        stdin=subprocess.DEVNULL,
    )
    if result.returncode != 0:
        raise RuntimeError(f"llm-compressor failed:\n{result.stderr[-4000:]}")
    for src, out, _ in jobs:
        for name in PROCESSOR_FILES:
            if (Path(src) / name).is_file():
                shutil.copy(Path(src) / name, Path(out) / name)
    return [Path(out) for _, out, _ in jobs]


if __name__ == "__main__":  # python -m vlm_serve.testing.quantized SOURCE OUT [bits group|channel sym|asym a16|a8]
    source, out, *spec = sys.argv[1:]
    bits, group, sym, acts = (spec or ["4", "32", "sym", "a16"])[:4]
    recipe = Recipe(int(bits), None if group == "channel" else int(group), sym == "sym", acts == "a8")
    print(quantize_checkpoints([(Path(source), Path(out), recipe)])[0])
