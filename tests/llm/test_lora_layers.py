"""LoRA adapters as peft saves them, served beside the base weights: the prefill logits of a prompt through
an adapter equal PeftModel's, the base's stay the base's, and in one batch each run of rows goes through its
own adapter."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import transformers

from vlm_serve.engine import Engine
from vlm_serve.llm.layers.linear import ReplicatedLinear
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.llm.lora.adapter import LoRAError, LoRAManager, read_adapter, tower_modules
from vlm_serve.llm.lora.experts import ExpertLoRASlots
from vlm_serve.llm.lora.layer import LoRABatch, LoRASlots, lora_batch
from vlm_serve.testing.logits import prefill_logits

peft = pytest.importorskip("peft", reason="peft is the oracle of these tests (the test extra installs it)")

TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 300, 42, 7, 901, 66, 12, 450, 3, 88, 1000, 23]


def hf_model(model_dir):
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir, folder, seed: int, **config) -> None:
    """A peft adapter with random (non-zero) weights on the language model."""
    torch.manual_seed(seed)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": TEXT_TARGETS, "init_lora_weights": False} | config
    peft.get_peft_model(hf_model(model_dir), peft.LoraConfig(**settings)).save_pretrained(folder)


def peft_logits(model_dir, folder) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(hf_model(model_dir), folder).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("rslora", [False, True])
def test_prefill_logits_through_an_adapter_equal_peft_and_the_base_stays_the_base(tiny_dense_dir, tmp_path, rslora):
    folder = tmp_path / "adapter"
    make_adapter(tiny_dense_dir, folder, seed=1, use_rslora=rslora)
    with Engine(tiny_dense_dir, dtype="float32", enable_lora=True, max_lora_rank=8) as engine:
        base = prefill_logits(engine.scheduler, PROMPT)
        slot = engine.scheduler.runner.lora.load(read_adapter("a", folder, max_rank=8))
        adapted = prefill_logits(engine.scheduler, PROMPT, lora_slot=slot)
        again = prefill_logits(engine.scheduler, PROMPT)
    expected = peft_logits(tiny_dense_dir, folder)
    assert not torch.allclose(expected, base, atol=1e-3)  # (the adapter changes the answer)
    torch.testing.assert_close(adapted, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again, base)


@pytest.mark.parametrize(
    "experts", [["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ["mlp.experts.down_proj"]], ids=["both", "down"]
)
def test_prefill_logits_through_an_adapter_of_the_experts_equal_peft(tiny_moe_dir, tmp_path, experts):
    """(peft adapts the fused expert parameters: `target_parameters`.)"""
    folder = tmp_path / "adapter"
    torch.manual_seed(3)
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], target_parameters=experts, init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(folder)
    with Engine(tiny_moe_dir, dtype="float32", enable_lora=True, max_lora_rank=8, lora_paths=[f"a={folder}"]) as engine:
        base = prefill_logits(engine.scheduler, PROMPT)
        adapted = prefill_logits(engine.scheduler, PROMPT, lora_slot=0)
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = (
            peft.PeftModel.from_pretrained(model.eval(), folder).eval()(input_ids=torch.tensor([PROMPT])).logits[0]
        )
    assert not torch.allclose(expected, base, atol=1e-3)
    torch.testing.assert_close(adapted, expected, atol=1e-4, rtol=1e-4)


def test_each_run_of_rows_goes_through_its_own_adapter():
    torch.manual_seed(0)
    linear = ReplicatedLinear(8, 6, bias=False)
    linear.weight.data.normal_()
    linear.lora = LoRASlots(linear, num_slots=3, max_rank=2, num_parts=1)
    adapters = [(torch.randn(2, 8), torch.randn(6, 2), 0.5 * (i + 1)) for i in range(3)]
    for slot, (a, b, scaling) in enumerate(adapters):
        linear.lora.set(slot, None, a, b, scaling)
    x = torch.randn(7, 8)
    row_slots = [2, 2, -1, 0, 0, 1, -1]
    with lora_batch(LoRABatch.of_rows(row_slots)):
        y = linear(x)
    for row, slot in enumerate(row_slots):
        want = x[row] @ linear.weight.T
        if slot >= 0:
            a, b, scaling = adapters[slot]
            want = want + scaling * (b @ (a @ x[row]))
        torch.testing.assert_close(y[row], want, atol=1e-5, rtol=1e-5)
    assert LoRABatch.of_rows([-1, -1]) is None


def test_each_token_goes_through_its_own_adapter_of_the_experts():
    torch.manual_seed(0)
    block = SparseMoeBlock(hidden_size=16, intermediate_size=12, num_experts=4, top_k=2)
    for weight in (block.gate.weight, block.w13, block.w2):
        weight.data.normal_(std=0.3)
    block.lora = ExpertLoRASlots(block, num_slots=3, max_rank=2)
    for slot in range(3):  # (peft's layout: A (experts x rank, in), B (out, rank x experts))
        block.lora.set(slot, 0, torch.randn(8, 16), torch.randn(24, 8), rank=2, scaling=0.5)
        block.lora.set(slot, 1, torch.randn(8, 12), torch.randn(16, 8), rank=2, scaling=0.5)
    x = torch.randn(9, 16)
    row_slots = [2, 2, -1, 0, 0, 1, -1, 1, 2]
    with lora_batch(LoRABatch.of_rows(row_slots)):
        y = block(x)
    for row, slot in enumerate(row_slots):
        with lora_batch(LoRABatch.of_rows([slot])):
            torch.testing.assert_close(y[row], block(x[row : row + 1])[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y, block(x))  # (the adapters change every adapted row)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"r": 16}, "has rank 16, above --max-lora-rank 8"),
        ({"use_dora": True}, "DoRA"),
        ({"target_modules": ["lm_head"]}, "saves the embeddings or the LM head whole"),
        ({"target_modules": ["patch_embed.proj"]}, r"no linear layer for: \['model.visual.patch_embed.proj'\]"),
        ({"layers_to_transform": [0]}, r"no linear layer for: \['model.language_model.layers.9"),
        ({"target_modules": ["o_proj"], "r": 2}, r"does not fit this model"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_refused_by_name(tiny_dense_dir, tmp_path, config, message):
    folder = tmp_path / "adapter"
    make_adapter(tiny_dense_dir, folder, seed=2, **config)
    weights = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    if "layers_to_transform" in config:  # (an adapter made for a deeper model: its layer 0 renamed layer 9)
        weights = {k.replace(".layers.0.", ".layers.9."): v for k, v in weights.items()}
    if config.get("r") == 2:  # (an adapter made for a wider model)
        weights = {k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in weights.items()}
    safetensors.torch.save_file(weights, folder / "adapter_model.safetensors")
    with Engine(tiny_dense_dir, dtype="float32") as engine, pytest.raises(LoRAError, match=message):
        runner = engine.scheduler.runner
        manager = LoRAManager(runner.model, max_loras=1, max_rank=8, also=tower_modules(runner.model_config))
        manager.load(read_adapter("a", folder, 8))
    assert manager.slots == [None]  # (nothing of it stays loaded)


def test_a_folder_without_the_adapter_files_is_refused_naming_the_file(tmp_path):
    with pytest.raises(LoRAError, match="adapter_config.json is missing"):
        read_adapter("a", tmp_path, max_rank=8)
