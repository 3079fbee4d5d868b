"""LoRA adapters for tests and benchmarks: made by peft (the test extra installs it) with random weights, so
that they change the answers."""

from __future__ import annotations

from pathlib import Path

import torch

from vlm_serve.builtin import BUILTIN_MODEL

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTER = "style"  # the name the combined-feature set-ups serve their adapter by


def make_adapter(folder: Path, model_dir: Path = BUILTIN_MODEL, seed: int = 0, rank: int = 8) -> Path:
    """A peft adapter of `rank` on every decoder layer's q/k/v/o projections of the checkpoint in
    `model_dir`, its weights random (a trained adapter's `B` is not zero either), saved in `folder`."""
    import peft
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    moe = "moe" in config.model_type
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls.from_pretrained(model_dir, dtype=torch.float32)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION, init_lora_weights=False)
    peft.get_peft_model(model, lora).save_pretrained(folder)
    return Path(folder)
