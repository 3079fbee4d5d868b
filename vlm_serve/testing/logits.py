"""The logits a model gives a whole prompt, read from the engine's own forward (parity checks)."""

from __future__ import annotations

import torch

from vlm_serve.llm.forward_batch import ForwardMode
from vlm_serve.multimodal.items import MultimodalItem
from vlm_serve.multimodal.padding import pad_input_ids
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.scheduler.schedule_batch import Req, ScheduleBatch
from vlm_serve.scheduler.scheduler import Scheduler


def prefill_logits(
    scheduler: Scheduler, input_ids: list[int], mm_items: list[MultimodalItem] = (), lora_slot: int = -1
) -> torch.Tensor:
    """Logits at every prompt position from one EXTEND forward through the paged KV cache (and the LoRA
    adapter in `lora_slot`, if any), with no prefix reused; on the CPU in float32, whatever the model's
    device and dtype."""
    runner, tree_cache = scheduler.runner, scheduler.tree_cache
    ids = pad_input_ids(input_ids, list(mm_items), runner.model_config.text.vocab_size)
    req = Req("prefill-logits", ids, SamplingParams(), list(mm_items), lora_slot=lora_slot)
    req.init_positions(runner.model_config.vision)
    req.last_node, req.extend_len = tree_cache.root, req.seq_len
    if mm_items and scheduler.encoding.add(req, 0):
        while req in scheduler.encoding:
            scheduler.encoding.poll(timeout=0.1)
    batch = ScheduleBatch([req], runner.req_to_token_pool, runner.allocator, tree_cache, ForwardMode.EXTEND)
    forward_batch = batch.prepare_for_extend()
    runner.init_forward_metadata(forward_batch)
    logits = runner.compute_logits(runner.forward(forward_batch))
    tree_cache.cache_finished_req(req)
    scheduler.encoding.release(req)
    return logits.float().cpu()
