"""Tensor- and expert-parallel shards (2 CPU ranks over gloo) compute what one rank computes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port, prefill_logits

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.scheduler.scheduler import Scheduler
from vlm_serve.llm.scheduler.schedule_batch import Req
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.tokenizer import Tokenizer

PROMPT = [5, 17, 300, 42, 7, 901, 66, 12, 450, 3, 88, 1000, 23]


def _run(model_dir: str, tp_size: int, ep_size: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill logits of PROMPT and 8 greedy tokens after it."""
    config = ModelConfig.from_pretrained(model_dir)
    # text only: no encoder pool processes
    args = ServerArgs(model=model_dir, tp_size=tp_size, ep_size=ep_size, max_total_tokens=1024, vit_dp=0)
    runner = ModelRunner(args, config)
    scheduler = Scheduler(args, runner, Tokenizer.from_pretrained(model_dir))
    logits = prefill_logits(scheduler, PROMPT)
    gen = Req("gen", list(PROMPT), SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    scheduler.add_request(gen)
    while not gen.finished:
        scheduler.step()
    return logits, gen.output_ids


def _worker(rank: int, port: int, model_dir: str, tp_size: int, ep_size: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp_size)
    try:
        logits, tokens = _run(model_dir, tp_size, ep_size)
        results[rank] = (logits, tokens)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "arch,ep_size", [("dense", 1), ("moe", 1), ("moe", 2)], ids=["dense-tp2", "moe-tp2", "moe-tp2-ep2"]
)
def test_two_ranks_match_one(arch, ep_size, tiny_moe_dir, tiny_dense_dir):
    model_dir = str(tiny_moe_dir if arch == "moe" else tiny_dense_dir)
    ref_logits, ref_tokens = _run(model_dir, 1, 1)
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), model_dir, 2, ep_size, results), nprocs=2)
    for rank in range(2):
        logits, tokens = results[rank]
        assert torch.allclose(logits, ref_logits, atol=1e-4 * ref_logits.abs().max())
        assert tokens == ref_tokens
