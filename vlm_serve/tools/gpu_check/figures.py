"""The `figures` part: decode tokens/s with the bandwidth it achieves, a picture's TTFT split beside its FLOP
bounds, decode ITL while pictures arrive, and on CUDA the MoE block at decode sizes."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vlm_serve.tools import roofline
from vlm_serve.tools.gpu_check.check import Check
from vlm_serve.tools.gpu_check.prompts import jpeg_upload, picture_prompt, text_prompts


def decode_figures(engine, batches: tuple[int, ...], tokens: int) -> dict:
    """Decode tokens/s at each batch size (the prefill's time, measured alone, taken out), TPOT at the
    first, the bytes a step reads (weights, touched experts, KV at the mean context) as achieved bandwidth
    and a share of the device's peak, and TTFT of one 1024 x 1024 picture split into preprocessing, the
    tower and the rest (its second asking with a new picture: the first warms up), beside its FLOP bound."""
    traffic = roofline.decode_traffic(engine.model_config)
    peaks = roofline.device_peaks(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    length = 32
    figures: dict = {"prompt_tokens": None, "generated_tokens": tokens}
    for batch in batches:
        # new prompts each time, so that none is in the prefix cache; the first run warms up
        runs = [text_prompts(engine, batch, first, length) for first in (0, batch, 2 * batch)]
        engine.generate_processed(runs[0], max_tokens=2, ignore_eos=True, temperature=0)
        began = time.perf_counter()
        engine.generate_processed(runs[1], max_tokens=1, ignore_eos=True, temperature=0)
        prefill = time.perf_counter() - began
        began = time.perf_counter()
        engine.generate_processed(runs[2], max_tokens=tokens + 1, ignore_eos=True, temperature=0)
        decode = time.perf_counter() - began - prefill
        prompt = statistics.mean(len(x.input_ids) for x in runs[2])
        figures["prompt_tokens"] = round(prompt)
        step = decode / tokens
        moved = traffic.step_bytes(batch, prompt + tokens / 2)
        row = {"tok_s": round(batch * tokens / decode, 1), "step_ms": round(1000 * step, 3)}
        row |= {"mb_per_step": round(moved / 1e6, 3), "achieved_gb_s": round(moved / step / 1e9, 1)}
        if peaks is not None:
            row |= {
                "hbm_peak_pct": round(100 * moved / step / peaks[0], 1),
                "bound_tok_s": round(batch * peaks[0] / moved, 1),
            }
        figures[f"decode_batch_{batch}"] = row
    for seed in (1, 2):
        upload = jpeg_upload(seed)  # (made before the clock starts: drawing the picture is no part of serving it)
        began = time.perf_counter()
        picture = picture_prompt(engine, upload)
        preprocess = time.perf_counter() - began
        began = time.perf_counter()
        out = engine.generate_processed([picture], max_tokens=1, temperature=0)[0]
        ttft = time.perf_counter() - began
    tower = sum(t.vit for t in out.media_timings)
    patches = sum(t * h * w for t, h, w in (item.grid_thw for item in picture.mm_items))
    split = {"preprocess": preprocess, "tower": tower, "prefill_and_rest": ttft - tower, "engine": ttft}
    split["with_preprocess"] = ttft + preprocess
    figures["ttft_ms_1024px_picture"] = {k: round(1000 * v, 1) for k, v in split.items()}
    figures["ttft_ms_1024px_picture"] |= {"patches": patches, "prompt_tokens": len(picture.input_ids)}
    stages = picture.mm_items[0].timings  # the preprocessing's own split (a JPEG's bytes to patches)
    figures["preprocess_ms_by_stage"] = {
        k: round(1000 * getattr(stages, k), 1) for k in ("decode", "hash", "preprocess")
    }
    if peaks is not None:
        bound = {
            "tower": roofline.tower_flops(engine.model_config, patches) / peaks[1],
            "prefill": roofline.prefill_flops(engine.model_config, len(picture.input_ids)) / peaks[1],
        }
        figures["ttft_bound_ms_at_peak_bf16"] = {k: round(1000 * v, 1) for k, v in bound.items()}
    return figures


def itl_while_pictures_arrive(engine, decoding: int = 8, pictures: int = 6, tokens: int = 160) -> dict:
    """Gaps between the decode steps of `decoding` text requests while `pictures` 1024 x 1024 pictures
    arrive (one each 16 steps): their p50 and p99 in ms."""
    # preprocessed before the clock starts, as a server's tokenizer process does beside the scheduler
    arriving = [picture_prompt(engine, jpeg_upload(100 + i)) for i in range(pictures)]
    submissions = [
        engine.submit(p, max_tokens=tokens, ignore_eos=True, temperature=0) for p in text_prompts(engine, decoding)
    ]
    while not all(c.outs for s in submissions for c in s.choices):  # every request decoding
        engine.step()
    gaps, step, last, sent = [], 0, time.perf_counter(), 0
    produced = sum(len(c.outs) for s in submissions for c in s.choices)
    while not all(s.done for s in submissions):
        if step % 16 == 0 and sent < pictures:
            engine.submit(arriving[sent], max_tokens=1, temperature=0)
            sent += 1
        engine.step()
        step += 1
        now_produced = sum(len(c.outs) for s in submissions for c in s.choices)
        if now_produced > produced:  # a step that gave the decoding requests tokens
            now = time.perf_counter()
            gaps.append(1000 * (now - last))
            last, produced = now, now_produced
    while not engine.scheduler.is_idle():
        engine.step()
    gaps.sort()
    return {
        "itl_p50_ms": round(statistics.median(gaps), 2),
        "itl_p99_ms": round(gaps[int(0.99 * (len(gaps) - 1))], 2),
        "steps": len(gaps),
    }


def moe_block_figures(size: str, rows: tuple[int, ...] = (1, 16, 64)) -> dict:
    """The MoE block of the `size` preset (bfloat16, random) at decode sizes on CUDA, in µs a call (CUDA
    events over 50 calls): the whole block eagerly and replayed from a CUDA graph, and its two expert GEMMs
    each way as torch's grouped GEMM and as `gemm_triton.grouped_linear` run them, with the GB/s those read
    of the experts the rows touch: which of the two to take at decode sizes."""
    from vlm_serve.llm.kernels import gemm_triton
    from vlm_serve.llm.layers.activation import silu_and_mul
    from vlm_serve.llm.layers.moe import SparseMoeBlock
    from vlm_serve.testing.tiny_model import SIZES

    shape = SIZES[size]
    hidden, experts = shape.moe.hidden, shape.experts
    with torch.device("cuda"):
        block = SparseMoeBlock(hidden, experts.intermediate, experts.num_experts, experts.per_token)
        block = block.to(torch.bfloat16)
        for weight in (block.gate.weight, block.w13, block.w2):
            weight.data.normal_(0, weight.shape[-1] ** -0.5)
    per_expert = (block.w13[0].nbytes + block.w2[0].nbytes) / 1e9

    def micros(fn, calls: int = 50) -> float:
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return 1000 * start.elapsed_time(end) / calls

    def triton_experts(xs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ends = ends.to(torch.int32)
        gate_up = gemm_triton.grouped_linear(xs, block.w13, ends)
        return gemm_triton.grouped_linear(silu_and_mul(gate_up), block.w2, ends)

    figures = {}
    for n in rows:
        x = torch.randn(n, hidden, dtype=torch.bfloat16, device="cuda")
        seen = []
        grouped = block._grouped_mm

        def seeing(xs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
            seen.append((xs, ends))
            return grouped(xs, ends)

        block._grouped_mm = seeing
        block(x)  # (the rows as the block groups them by expert)
        block._grouped_mm = grouped
        xs, ends = seen[0]
        touched = int((torch.diff(ends, prepend=ends.new_zeros(1)) > 0).sum())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block(x)
        row = {"experts_touched": touched, "block_eager_us": micros(lambda: block(x))}
        row["block_graph_us"] = micros(graph.replay)
        for name, fn in (("torch_grouped", grouped), ("triton_grouped", triton_experts)):
            us = micros(lambda fn=fn: fn(xs, ends))
            row[f"{name}_us"], row[f"{name}_gb_s"] = us, touched * per_expert / (us / 1e6)
        reference = grouped(xs, ends).float()  # (the two agree to bfloat16's rounding: their difference, per mille)
        row["triton_off_per_mille"] = 1000 * float((triton_experts(xs, ends).float() - reference).abs().max())
        row["triton_off_per_mille"] /= float(reference.abs().max())
        figures[f"rows {n}"] = {k: round(v, 1) for k, v in row.items()}
    return figures


def run_figures(check: Check, device: torch.device, size: str) -> None:
    from vlm_serve.engine import Engine
    from vlm_serve.testing.tiny_model import create_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="gpu-check-figures-"))
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    batches, tokens = ((1, 16, 64, 160), 64) if device.type == "cuda" else ((1, 4), 8)
    figures: dict[str, dict] = {}
    for arch in ("dense", "moe"):
        path = create_tiny_model(folder / arch, arch=arch, size=size, weights=False, dtype="bfloat16")

        def measure(arch=arch, path=path) -> str:
            # as users run it: the overlap loop, decode replayed from CUDA graphs (eager decode, bound by its
            # kernel launches, was measured on an H200: docs/gpu.md)
            with Engine(path, load_format="dummy", device=device.type, dtype=dtype, vit_dp=0) as engine:
                figures[f"{arch} {size}"] = decode_figures(engine, batches, tokens)
            return json.dumps(figures[f"{arch} {size}"])

        check.run(f"{arch} {size}: decode with its bandwidth, TTFT split", measure)
    if device.type == "cuda":

        def moe_block() -> str:
            figures[f"moe {size} block"] = moe_block_figures(size)
            return json.dumps(figures[f"moe {size} block"])

        check.run(f"moe {size}: its block at decode sizes, torch's grouped GEMM against Triton's", moe_block)
    for vit_dp, name in ((1, "encoder pool"), (0, "inline")):
        path = folder / "dense"

        def itl(vit_dp=vit_dp, name=name) -> str:
            with Engine(path, load_format="dummy", device=device.type, dtype=dtype, vit_dp=vit_dp) as engine:
                # warm-up
                engine.generate_processed([picture_prompt(engine, jpeg_upload(99))], max_tokens=1, temperature=0)
                figures[f"dense {size} ITL, {name}"] = itl_while_pictures_arrive(engine, tokens=2 * tokens)
            return json.dumps(figures[f"dense {size} ITL, {name}"])

        check.run(f"dense {size}: decode ITL while 1024 px pictures arrive, {name}", itl)
    (check.out / "figures.json").write_text(json.dumps(figures, indent=1))
