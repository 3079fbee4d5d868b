"""LoRA adapters for tests and benchmarks: made by peft (the test extra installs it) with random weights, so
that they change the answers."""

from __future__ import annotations

from pathlib import Path

import torch

from vlm_serve.builtin import BUILTIN_MODEL

ADAPTER = "style"  # the name the combined-feature set-ups serve their adapter by
ATTENTION = r".*language_model\..*\.(q_proj|k_proj|v_proj|o_proj)"
TOWER = r".*visual\..*\.(qkv|attn\.proj|linear_fc1|linear_fc2)"  # the tower's blocks and its mergers
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # (peft's target_parameters)


def hf_model(model_dir: Path):
    """transformers' model of the checkpoint in `model_dir` (dense or MoE), in float32."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    moe = "moe" in config.model_type
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(
    folder: Path,
    model_dir: Path = BUILTIN_MODEL,
    seed: int = 0,
    rank: int = 8,
    targets: str | list[str] = f"{ATTENTION}|{TOWER}",
    experts: bool = True,
) -> Path:
    """A peft adapter of `rank` on the `targets` modules of the checkpoint in `model_dir` (by default every
    decoder layer's q/k/v/o and the vision tower's linear layers) and, of a MoE with `experts`, its experts;
    its weights random (a trained adapter's `B` is not zero either), saved in `folder`."""
    import peft

    torch.manual_seed(seed)
    model = hf_model(model_dir)
    moe = hasattr(model.config.text_config, "num_experts")
    parameters = EXPERTS if moe and experts else None
    lora = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, target_parameters=parameters, init_lora_weights=False
    )
    peft.get_peft_model(model, lora).save_pretrained(folder)
    return Path(folder)
