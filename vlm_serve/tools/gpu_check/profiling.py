"""The `profile` part: torch's profiler over decode steps per attention backend, and on CUDA the device's
timelines as users run it (the share of it busy, the longest host gaps)."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from vlm_serve.tools import roofline
from vlm_serve.tools.gpu_check.check import Check
from vlm_serve.tools.gpu_check.parity import backends
from vlm_serve.tools.gpu_check.prompts import jpeg_upload, picture_prompt, text_prompts


def decode_timeline(engine, steps: int, activities: list, batch: int = 1) -> tuple[object, float]:
    """Torch's profiler over `steps` decode steps of `batch` requests (their prefill and first token before):
    the trace and the seconds those steps took."""
    from torch.profiler import profile

    submissions = [
        engine.submit(x, max_tokens=steps + 8, ignore_eos=True, temperature=0)
        for x in text_prompts(engine, batch, 1000 + batch)
    ]
    choices = [c for s in submissions for c in s.choices]
    while not all(c.outs for c in choices):
        engine.step()
    with profile(activities=activities) as trace:
        began, produced = time.perf_counter(), len(choices[0].outs)
        while len(choices[0].outs) < produced + steps:
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
    while not engine.scheduler.is_idle():
        engine.step()
    return trace, seconds


def idle_summary(trace, seconds: float, steps: int) -> dict:
    """A decode trace's device timeline: the share of it a kernel ran and its longest idle gaps, each with
    the host operations that overlapped it (leaf operations: the runtime calls and operators doing the work)."""
    kernels, host = [], []
    for event in trace.events():
        span = (event.time_range.start, event.time_range.end)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append(span)
        elif not event.cpu_children:
            host.append((event.name, *span))
    span, busy, gaps = roofline.device_idle(kernels, host)
    return {
        "steps": steps,
        "step_ms": round(1000 * seconds / steps, 3),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "device_busy_pct": round(100 * busy, 1),
        "device_busy_ms_per_step": round(busy * span / 1000 / steps, 3),
        "top_gaps": [
            {"at_us": round(g.start_us - kernels[0][0]), "us": round(g.length_us, 1), "host": g.host} for g in gaps
        ],
    }


def run_profile(check: Check, device: torch.device, size: str) -> None:
    """Where a decode step's time goes, on the dense model: torch's profiler over 16 steps at batch 16 per
    attention backend, in the normal loop (the tables by CPU and by device time in OUT/profile-<backend>.txt);
    and on CUDA, as users run it (the overlap loop, CUDA graphs), over decode steps of the dense model at
    batch 1 and 160, a 1024 x 1024 picture's TTFT and the MoE's decode at batch 1: the device-busy share and
    the longest host gaps (OUT/profile-timelines.json; at batch 1 the kernels by device time and the trace,
    OUT/profile-{dense,moe}-batch1.txt and trace-*.json.gz; the TTFT's kernels OUT/profile-ttft.txt)."""
    from torch.profiler import ProfilerActivity, profile

    from vlm_serve.engine import Engine
    from vlm_serve.testing.tiny_model import create_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="gpu-check-profile-"))
    path = create_tiny_model(folder / "dense", arch="dense", size=size, weights=False, dtype="bfloat16")
    config = json.loads((path / "config.json").read_text())["text_config"]
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    if device.type == "cuda":
        moe_path = create_tiny_model(folder / "moe", arch="moe", size=size, weights=False, dtype="bfloat16")
        figures: dict = {}

        def timeline(engine, name: str, batch: int, steps: int) -> None:
            decode_timeline(engine, steps, activities, batch)  # warm-up
            trace, seconds = decode_timeline(engine, steps, activities, batch)
            figures[name] = idle_summary(trace, seconds, steps)
            if batch == 1:
                stem = name.replace(" ", "-")
                (check.out / f"profile-{stem}.txt").write_text(
                    trace.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
                )
                trace.export_chrome_trace(str(check.out / f"trace-{stem}.json"))
                subprocess.run(["gzip", "-f", str(check.out / f"trace-{stem}.json")], check=False)
            (check.out / "profile-timelines.json").write_text(json.dumps(figures, indent=1))  # (as each comes)

        def summary(*names: str) -> str:
            return json.dumps({name: {k: v for k, v in figures[name].items() if k != "top_gaps"} for name in names})

        def timelines() -> str:
            with Engine(path, load_format="dummy", device="cuda", dtype=dtype, vit_dp=0) as engine:
                timeline(engine, "dense batch1", 1, 20)
                # warm-up
                engine.generate_processed([picture_prompt(engine, jpeg_upload(1))], max_tokens=1, temperature=0)
                prompt = picture_prompt(engine, jpeg_upload(2))
                with profile(activities=activities) as trace:
                    began = time.perf_counter()
                    engine.generate_processed([prompt], max_tokens=1, temperature=0)
                    figures["1024 x 1024 picture's TTFT"] = idle_summary(trace, time.perf_counter() - began, 1)
                table = trace.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
                (check.out / "profile-ttft.txt").write_text(table)
                timeline(engine, "dense batch160", 160, 10)
            return summary("dense batch1", "1024 x 1024 picture's TTFT", "dense batch160")

        def moe_timeline() -> str:
            with Engine(moe_path, load_format="dummy", device="cuda", dtype=dtype, vit_dp=0) as engine:
                timeline(engine, "moe batch1", 1, 20)
            return summary("moe batch1")

        check.run(
            f"dense {size}: timelines of decode at batch 1 and 160 (as users run it) and of a picture's TTFT", timelines
        )
        check.run(f"moe {size}: timeline of decode at batch 1 (its kernels: profile-moe-batch1.txt)", moe_timeline)
    profiled = backends(device, dtype, config["head_dim"])
    for backend in profiled[-1:] if device.type == "cuda" else profiled:  # (CUDA: the torch one's was measured)

        def measure(backend=backend) -> str:
            # the normal loop: the forward runs on this thread, where the profiler sees its operators
            options = dict(
                device=device.type, dtype=dtype, attention_backend=backend, vit_dp=0, disable_overlap_schedule=True
            )
            with Engine(path, load_format="dummy", **options) as engine:
                engine.generate_processed(text_prompts(engine, 16), max_tokens=4, ignore_eos=True, temperature=0)
                prompts = text_prompts(engine, 16, 16)
                with profile(activities=activities) as trace:
                    began = time.perf_counter()
                    engine.generate_processed(prompts, max_tokens=17, ignore_eos=True, temperature=0)
                    seconds = time.perf_counter() - began
            events = trace.key_averages()
            tables = [events.table(sort_by="self_cpu_time_total", row_limit=30)]
            if device.type == "cuda":
                tables.append(events.table(sort_by="self_cuda_time_total", row_limit=30))
            (check.out / f"profile-{backend}.txt").write_text("\n\n".join(tables))
            return f"16 steps at batch 16 (and the prefill) in {1000 * seconds:.0f} ms"

        check.run(f"dense {size} {backend}: profile of decode steps", measure)
