"""The bounds the GPU kit sets its figures beside (tools/roofline.py): the bytes a decode step reads are the
checkpoint's language-model weights (all but the embedding table; of the experts, those touched), the tower's
FLOPs are what torch counts when transformers runs it, and a profiled timeline's idle gaps are where no
kernel ran."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from vlm_serve.config import ModelConfig
from vlm_serve.tools.roofline import decode_traffic, device_idle, tower_flops


def checkpoint_bytes(path) -> dict[str, int]:
    sizes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():
                sizes[name] = tensors.get_tensor(name).nbytes
    return sizes


@pytest.mark.parametrize("checkpoint", ["tiny_dense_dir", "tiny_moe_dir"])
def test_a_decode_step_reads_the_language_models_weights_but_the_embedding_table(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    sizes = {k: v for k, v in checkpoint_bytes(path).items() if not k.startswith("model.visual.")}
    experts = sum(v for k, v in sizes.items() if ".mlp.experts." in k)
    shared = sum(v for k, v in sizes.items() if ".mlp.experts." not in k and "embed_tokens" not in k)
    config = ModelConfig.from_pretrained(path)
    traffic = decode_traffic(config, weight_bytes=4, kv_bytes=4)  # (the tiny checkpoints are float32)
    assert traffic.shared_bytes == shared
    assert traffic.moe_layers * traffic.experts * traffic.expert_bytes == experts
    text = config.text
    kv = text.num_hidden_layers * 2 * text.num_key_value_heads * text.head_dim * 4
    if experts:  # one token reads its top-k experts of each layer; a large batch nearly all of them
        assert traffic.experts_touched(1) == pytest.approx(text.num_experts_per_tok)
        assert traffic.experts_touched(1000) == pytest.approx(text.num_experts)
        one = shared + traffic.moe_layers * text.num_experts_per_tok * traffic.expert_bytes
    else:
        one = shared
    assert traffic.step_bytes(1, 100) == pytest.approx(one + 100 * kv)


def test_the_towers_flops_are_what_torch_counts_when_transformers_runs_it(tiny_dense_dir):
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        tiny_dense_dir,
        dtype=torch.float32,
        attn_implementation="eager",  # (attention as products torch counts)
    )
    config = ModelConfig.from_pretrained(tiny_dense_dir)
    grid = torch.tensor([[1, 16, 24]])  # 384 patches
    vision = config.vision
    pixels = torch.randn(384, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.model.visual(pixels, grid_thw=grid)
    # (torch counts the products: norms, activations and the rotary embedding are the few percent left out)
    assert tower_flops(config, 384) == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_idle_gaps_are_where_no_kernel_ran_with_the_host_work_that_overlapped_them():
    kernels = [(0, 10), (5, 20), (30, 40), (41, 50), (80, 100)]  # idle 20-30, 40-41, 50-80
    host = [("launch", 45, 70), ("sync", 70, 85), ("early", 0, 25)]
    span, busy, gaps = device_idle(kernels, host, top=2)
    assert span == 100 and busy == pytest.approx((20 + 10 + 9 + 20) / 100)
    assert [(g.start_us, g.length_us) for g in gaps] == [(50, 30), (20, 10)]
    assert gaps[0].host == [("launch", 20), ("sync", 10)]
    assert gaps[1].host == [("early", 5)]
    assert device_idle([], host) == (0.0, 0.0, [])
