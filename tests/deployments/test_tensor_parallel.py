"""Tensor- and expert-parallel shards (2 CPU ranks over gloo) compute what one rank computes, under
both event loops: with overlap, each rank's forward thread runs the model's collectives while its
scheduler thread broadcasts the next inputs."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port
from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.llm.model_runner import ModelRunner, RunnerConcerns
from vlm_serve.messages.backend import BatchTokenIdOut, TokenizedGenerateReq
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.scheduler.concerns import SchedulerConcerns
from vlm_serve.scheduler.scheduler import Scheduler
from vlm_serve.testing.logits import prefill_logits
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.pool import EncoderConcerns, create_encoder

pytestmark = pytest.mark.server  # every test here starts tensor-parallel ranks

PROMPT = [5, 17, 300, 42, 7, 901, 66, 12, 450, 3, 88, 1000, 23]
NEW_TOKENS = 8
ITERATIONS = NEW_TOKENS + 6  # every rank runs the same number of loop iterations; the last ones idle


class _ListIO:
    """Rank 0's scheduler I/O: one request in, outputs kept."""

    def __init__(self, messages: list[Any]) -> None:
        self.messages, self.sent = messages, []

    def recv(self, block: bool) -> list[Any]:
        messages, self.messages = self.messages, []
        return messages

    def send(self, message: Any) -> None:
        self.sent.append(message)


def _run(
    model_dir: str, tp_size: int, ep_size: int, overlap: bool, lora: str | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Prefill logits of PROMPT and NEW_TOKENS greedy tokens after it (those on rank 0 only), through the
    LoRA adapter in folder `lora` if given."""
    config = ModelConfig.from_pretrained(model_dir)
    args = ServerArgs(
        model=model_dir,
        tp_size=tp_size,
        ep_size=ep_size,
        max_total_tokens=1024,
        vit_dp=0,
        disable_overlap_schedule=not overlap,
        enable_lora=lora is not None,
        lora_paths=[f"a={lora}"] if lora else [],
    )
    runner = ModelRunner(RunnerConcerns.of(args), config)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    io = _ListIO([TokenizedGenerateReq("gen", list(PROMPT), params, lora_name="a" if lora else None)])
    encoder = create_encoder(EncoderConcerns.of(args), config, runner.device)
    scheduler = Scheduler(SchedulerConcerns.of(args), runner, Tokenizer.from_pretrained(model_dir), encoder, io)
    logits = prefill_logits(scheduler, PROMPT, lora_slot=0 if lora else -1)
    for _ in range(ITERATIONS):
        scheduler.run_iteration()
    scheduler.shutdown()
    tokens = [t for m in io.sent if isinstance(m, BatchTokenIdOut) for out in m.outs for t in out.new_ids]
    return logits, tokens


def _worker(
    rank: int, port: int, model_dir: str, tp_size: int, ep_size: int, overlap: bool, results, lora: str | None = None
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp_size)
    try:
        results[rank] = _run(model_dir, tp_size, ep_size, overlap, lora)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,ep_size,overlap,weights",
    [
        *(
            (arch, ep, overlap, "float32")
            for overlap in (False, True)
            for arch, ep in (("dense", 1), ("moe", 1), ("moe", 2))
        ),
        # bfloat16 and FP8 weights (float32 activations) sharded: FP8 shards start inside scale blocks
        ("dense", 1, False, "bf16"),
        ("moe", 2, False, "bf16"),
        ("dense", 1, False, "fp8"),
        ("moe", 1, False, "fp8"),
        ("moe", 2, False, "fp8"),
        # 4- and 8-bit integer weights (llm-compressor's), sharded between their groups
        ("dense", 1, False, "w4a16-asym"),
        ("dense", 1, True, "w8a16-asym"),
        ("moe", 1, False, "w8a16"),  # (per channel: its experts' 24 columns a rank would cut groups of 16)
        ("moe", 2, True, "w4a16-asym"),
        ("qwen2.5", 1, False, "float32"),  # the second family: biased q/k/v shards, sectioned MRoPE
    ],
    ids=[
        *(f"{name}-{loop}" for loop in ("normal", "overlap") for name in ("dense-tp2", "moe-tp2", "moe-tp2-ep2")),
        "dense-tp2-bf16",
        "moe-tp2-ep2-bf16",
        "dense-tp2-fp8",
        "moe-tp2-fp8",
        "moe-tp2-ep2-fp8",
        "dense-tp2-w4a16",
        "dense-tp2-w8a16-overlap",
        "moe-tp2-w8a16",
        "moe-tp2-ep2-w4a16-overlap",
        "qwen2.5-tp2",
    ],
)
def test_two_ranks_match_one(
    arch, ep_size, overlap, weights, tiny_moe_dir, tiny_dense_dir, tiny_bf16_dirs, tiny_fp8_dirs, request
):
    float32 = {"moe": tiny_moe_dir, "dense": tiny_dense_dir}
    if arch == "qwen2.5":
        float32[arch] = request.getfixturevalue("tiny_qwen2_5_dir")
    if weights.startswith("w"):
        model_dir = str(request.getfixturevalue("int_checkpoints")[f"{arch}-{weights}"])
    else:
        model_dir = str({"bf16": tiny_bf16_dirs, "fp8": tiny_fp8_dirs}.get(weights, float32)[arch])
    ref_logits, ref_tokens = _run(model_dir, 1, 1, overlap)
    assert len(ref_tokens) == NEW_TOKENS
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), model_dir, 2, ep_size, overlap, results), nprocs=2)
    logits, tokens = results[0]
    assert torch.allclose(logits, ref_logits, atol=1e-4 * ref_logits.abs().max())
    assert tokens == ref_tokens
    assert torch.allclose(results[1][0], ref_logits, atol=1e-4 * ref_logits.abs().max())


@pytest.mark.parametrize(
    "arch,ep_size,overlap",
    [("dense", 1, False), ("dense", 1, True), ("moe", 1, True), ("moe", 2, False)],
    ids=["dense-tp2-normal", "dense-tp2-overlap", "moe-tp2-overlap", "moe-tp2-ep2-normal"],
)
def test_two_ranks_match_one_through_a_lora_adapter(tiny_dense_dir, tiny_moe_dir, tmp_path, arch, ep_size, overlap):
    """An adapter's A and B cut as their base layers are (B's rows on column-parallel layers, A's columns on
    row-parallel ones; of the experts, each rank's experts and its slice of their intermediate dimension): the
    same logits and tokens as one rank, which differ from the base's."""
    peft = pytest.importorskip("peft", reason="peft makes the adapter (the test extra installs it)")
    import transformers

    torch.manual_seed(3)
    model_dir = str(tiny_moe_dir if arch == "moe" else tiny_dense_dir)
    cls = (
        transformers.Qwen3VLMoeForConditionalGeneration
        if arch == "moe"
        else transformers.Qwen3VLForConditionalGeneration
    )
    hf = cls.from_pretrained(model_dir, dtype=torch.float32)
    if arch == "moe":
        targets = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
        targets["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    else:
        targets = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    config = peft.LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, **targets)
    peft.get_peft_model(hf, config).save_pretrained(tmp_path / "adapter")
    lora = str(tmp_path / "adapter")
    base_logits, _ = _run(model_dir, 1, 1, overlap)
    ref_logits, ref_tokens = _run(model_dir, 1, 1, overlap, lora)
    assert not torch.allclose(ref_logits, base_logits, atol=1e-3)
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), model_dir, 2, ep_size, overlap, results, lora), nprocs=2)
    logits, tokens = results[0]
    assert torch.allclose(logits, ref_logits, atol=1e-4 * ref_logits.abs().max())
    assert tokens == ref_tokens
