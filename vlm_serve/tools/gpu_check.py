"""The GPU validation kit: one command that checks the CUDA path and measures it, on a lent GPU.

    python -m vlm_serve.tools.gpu_check OUT [--device cuda] [--parts suite,parity,server,figures]

Parts, in order of value (each writes its records under OUT and a line to OUT/summary.txt):
- `suite`: the test files that run models (`SUITE`) under pytest on the device (`auto` picks CUDA there),
  with the attention backend `auto` picks (FlashInfer where installed). CUDA only: CI runs them on CPU.
- `parity`: each attention backend the device has, in float32 and bfloat16 (where the backend runs it),
  against transformers in float32 on the CPU: the prefill logits of a prompt with a picture (float32
  within `FLOAT32_TOLERANCE` of the largest logit, bfloat16 about as close as transformers' own bfloat16
  is: `BFLOAT16_SLACK`) and greedy
  answers: 16 identical tokens of random tiny models in float32, and the built-in model's answers in
  bfloat16 (short, confident answers) identical to float32's.
- `server`: `vlm-serve serve` with the built-in model and one encoder rank (`--vit-dp 1`, on the GPU):
  pictures, a clip, a repeated picture and a streamed answer equal the in-process engine's on the CPU.
- `figures`: on random models of real shapes (`large` preset, `load_format="dummy"`; `tiny` on CPU):
  decode tokens/s at batch 1/16/64/160 with the bytes a step reads as achieved bandwidth (and a share of
  the device's peak, `roofline`), TTFT of one 1024 x 1024 picture split into preprocessing, tower and
  prefill beside their FLOP bounds, and decode ITL p99 while such pictures arrive, with the encoder pool
  and with the tower inline.
  The parity part also checks that decode replayed from CUDA graphs gives the eager tokens.
- `profile`: torch's profiler over decode steps, per attention backend (where the time goes), and on CUDA
  as users run it, over 20 steps at batch 1 of the dense model and of the MoE (the kernels by device time),
  a picture's TTFT and 10 steps at batch 160: the device-busy share and the longest host gaps.

On CPU (`--device cpu`, what CI runs) every part but `suite` runs, at tiny sizes.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from vlm_serve.llm.layers.attention import FLASHINFER_HEAD_DIMS
from vlm_serve.server.ports import free_port
from vlm_serve.tools import roofline

FLOAT32_TOLERANCE = 1e-3  # of the largest |logit|: float32 kernels differ in summation order only
# bfloat16 (8 bits of mantissa) against float32: random models amplify the rounding, and a token whose
# top-k experts are nearly tied can be routed differently, the more so the more experts (128 experts
# top-8: transformers' own bfloat16 logits then differ from its float32 ones by 0.24 of a standard
# deviation, with the same most likely token at 57% of the positions). So bfloat16 is held to transformers'
# own bfloat16 (on the CPU): a mean |logit difference| at most BFLOAT16_SLACK times its (plus 0.01 of a
# standard deviation), and the same most likely token as float32 at a share of the positions no lower than
# its share by more than BFLOAT16_ARGMAX_ERRORS standard errors of a share over that many positions (a
# prompt has a few dozen: on an H200, a MoE's share was 53% against transformers' 60%, one standard error,
# with the mean difference equal to transformers', 0.235 against 0.233).
BFLOAT16_SLACK = 1.25
BFLOAT16_ARGMAX_ERRORS = 2.0
SUITE = [  # in order of value: a lent GPU's time may end before the last
    "tests/llm/test_cuda_paths.py", "tests/parity/test_model_parity.py", "tests/deployments/test_server.py",
    "tests/vision/test_encoder_pool.py", "tests/llm/test_gemm_triton.py", "tests/llm/test_moe_layer.py",
    "tests/engine/test_engine.py", "tests/tools/test_builtin_model.py", "tests/scheduler/test_speculative.py",
    "tests/vision/test_vision_passes.py", "tests/parity/test_low_precision.py", "tests/llm/test_lora_kernels.py",
    "tests/llm/test_rowwise_triton.py", "tests/llm/test_decode_syncs.py",
]  # fmt: skip


class Check:
    """Collects a part's results: named pass/fail lines and figures, written to OUT as they come."""

    def __init__(self, out: Path, part: str) -> None:
        self.out, self.part = out, part
        self.results: list[dict] = []

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append({"name": name, "ok": ok, "detail": detail})
        print(f"[{self.part}] {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        (self.out / f"{self.part}.json").write_text(json.dumps(self.results, indent=1))

    def run(self, name: str, fn: Callable[[], str | None]) -> None:
        """`fn()` passes unless it raises; what it returns is the detail."""
        try:
            self.record(name, True, fn() or "")
        except Exception as exc:  # noqa: BLE001 - every failure is a result to report, not a stop
            self.record(name, False, f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
            with open(self.out / f"{self.part}.log", "a") as log:
                log.write(f"---- {name}\n{traceback.format_exc()}\n")


def environment(device: torch.device) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "flashinfer": importlib.util.find_spec("flashinfer") is not None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info.update(cpu=platform.processor() or platform.machine())
    return info


# ---- suite -----------------------------------------------------------------------------------------


def run_suite(check: Check, timeout: int, files: list[str]) -> None:
    """Each test file under pytest on its own, so that each one's failures are on record as it ends."""
    files = [f for f in files if Path(f).is_file()]
    if not files:
        check.record("suite", False, "no tests/ folder here: run the kit from the repository's root")
        return
    for file in files:
        command = [
            sys.executable,
            "-m",
            "pytest",
            file,
            "-q",
            "--tb=line",
            "-rfE",
            "-p",
            "no:cacheprovider",
            f"--timeout={timeout}",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        with open(check.out / "suite.log", "a") as log:
            log.write(f"==== {file}\n{result.stdout[-20000:]}{result.stderr[-5000:]}\n")
        lines = result.stdout.strip().splitlines()
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        check.record(Path(file).stem, result.returncode == 0, "; ".join([*lines[-1:], *failed[:3]])[:1500])


# ---- parity ----------------------------------------------------------------------------------------


def _picture_prompt(engine, seed: int = 1):
    from vlm_serve.testing.media import make_image

    text = {"type": "text", "text": "Describe what you see in a few words."}
    messages = [{"role": "user", "content": [{"type": "image", "image": make_image(96, 64, seed=seed)}, text]}]
    return engine.processor.process_messages(messages, add_generation_prompt=True)


def _transformers_reference(path: Path, arch: str, processed) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """transformers' float32 logits of the prompt and its 16 greedy tokens, and its bfloat16 logits, on
    the CPU."""
    import transformers

    cls = (
        transformers.Qwen3VLMoeForConditionalGeneration
        if arch == "moe"
        else transformers.Qwen3VLForConditionalGeneration
    )
    ids = torch.tensor([processed.input_ids])
    items = processed.mm_items
    outputs = []
    for dtype in (torch.float32, torch.bfloat16):
        hf = cls.from_pretrained(path, dtype=dtype).eval()
        inputs = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.cat([it.pixel_values for it in items]).to(dtype),
            "image_grid_thw": torch.tensor([it.grid_thw for it in items]),
            "mm_token_type_ids": (ids == hf.config.image_token_id).int(),
        }
        with torch.no_grad():
            outputs.append(hf(**inputs).logits[0].float())
            if dtype == torch.float32:
                tokens = hf.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, ids.shape[1] :]
    return outputs[0], tokens.tolist(), outputs[1]


def backends(device: torch.device, dtype: str, head_dim: int) -> list[str]:
    """The attention backends that run `dtype` and `head_dim` on `device` (FlashInfer: half precision, its
    head sizes; the C kernel: float32)."""
    if device.type == "cuda":
        flashinfer = importlib.util.find_spec("flashinfer") and dtype != "float32" and head_dim in FLASHINFER_HEAD_DIMS
        return ["torch", *(["flashinfer"] if flashinfer else [])]
    return ["cpu", "torch"] if dtype == "float32" else ["torch"]


def logits_error(ours: torch.Tensor, reference: torch.Tensor, dtype: str, rounded: torch.Tensor) -> str:
    """How far `ours` is from transformers' float32 `reference`; raises if beyond the dtype's bounds (in
    bfloat16, relative to transformers' own bfloat16 logits, `rounded`)."""
    if dtype == "float32":
        error = ((ours - reference).abs().max() / reference.abs().max()).item()
        if error > FLOAT32_TOLERANCE:
            raise AssertionError(f"logits off by {error:.2e} of the largest (bound {FLOAT32_TOLERANCE})")
        return f"logits within {error:.1e} of the largest"

    def distance(logits: torch.Tensor) -> tuple[float, float]:
        error = ((logits - reference).abs().mean() / reference.std()).item()
        return error, (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()

    (error, agreement), (theirs, their_agreement) = distance(ours), distance(rounded)
    positions = reference.shape[0]
    said = (
        f"mean logit difference {error:.3f} of a standard deviation, argmax agreement {agreement:.0%} of "
        f"{positions} positions (transformers in bfloat16: {theirs:.3f}, {their_agreement:.0%})"
    )
    standard_error = (their_agreement * (1 - their_agreement) / positions) ** 0.5
    if error > BFLOAT16_SLACK * theirs + 0.01 or agreement < their_agreement - BFLOAT16_ARGMAX_ERRORS * standard_error:
        raise AssertionError(said)
    return said


def graphs_as_eager(path: Path, device: torch.device) -> str:
    """Greedy tokens of 5 requests finishing at different lengths (decode batches of 5 down to 1, padded
    to the captured sizes), with decode replayed from CUDA graphs and run eagerly."""
    from vlm_serve.engine import Engine

    answers = {}
    for eager in (True, False):
        with Engine(path, device=device.type, dtype="bfloat16", disable_cuda_graph=eager, vit_dp=0) as engine:
            if not eager and engine.scheduler.runner.cuda_graphs is None:
                raise AssertionError("no CUDA graphs were captured (the log's warning says why)")
            submissions = [
                engine.submit(p, max_tokens=8 + 4 * i, ignore_eos=True, temperature=0)
                for i, p in enumerate(_text_prompts(engine, 5))
            ]
            while not all(s.done for s in submissions):
                engine.step()
            answers[eager] = [engine.result(s).token_ids for s in submissions]
    if answers[True] != answers[False]:
        raise AssertionError(f"graphs {answers[False]} != eager {answers[True]}")
    return "identical greedy tokens, 5 requests of 8 to 24 tokens"


def run_parity(check: Check, device: torch.device) -> None:
    from vlm_serve.builtin.scenes import random_example
    from vlm_serve.engine import Engine
    from vlm_serve.testing.logits import prefill_logits
    from vlm_serve.testing.tiny_model import create_tiny_model
    from vlm_serve.tools.builtin_train import messages

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (TF32 keeps 10 bits)
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    size = "small" if device.type == "cuda" else "tiny"  # small: head size 64, which FlashInfer runs
    for arch in ("moe", "dense"):
        path = create_tiny_model(folder / arch, arch=arch, size=size)
        head_dim = json.loads((path / "config.json").read_text())["text_config"]["head_dim"]
        with Engine(path, device="cpu", dtype="float32", vit_dp=0, max_total_tokens=4096) as cpu_engine:
            processed = _picture_prompt(cpu_engine)
        ref_logits, ref_tokens, rounded = _transformers_reference(path, arch, processed)
        for dtype in ("float32", "bfloat16"):
            for backend in backends(device, dtype, head_dim):

                def compare(backend=backend, dtype=dtype) -> str:
                    options = dict(device=device.type, dtype=dtype, attention_backend=backend, vit_dp=0)
                    with Engine(path, max_total_tokens=4096, **options) as engine:
                        logits = prefill_logits(engine.scheduler, processed.input_ids, processed.mm_items)
                        detail = logits_error(logits, ref_logits, dtype, rounded)
                        if dtype == "float32":
                            out = engine.generate_processed([processed], max_tokens=16, temperature=0, ignore_eos=True)
                            if out[0].token_ids != ref_tokens:
                                raise AssertionError(f"greedy tokens {out[0].token_ids} != transformers' {ref_tokens}")
                    return detail

                check.run(f"{arch} {size} {backend} {dtype} vs transformers", compare)
        if "flashinfer" in backends(device, "bfloat16", head_dim):
            check.run(f"{arch} {size} CUDA graphs vs eager", lambda path=path: graphs_as_eager(path, device))

    examples = [random_example(random.Random(seed)) for seed in range(12)]
    with Engine(None, device="cpu", dtype="float32", vit_dp=0) as cpu_engine:
        expected = [cpu_engine.chat(messages(e), max_tokens=48, temperature=0).text for e in examples]
    for backend in backends(device, "bfloat16", head_dim=32):  # the built-in model's head size

        def builtin(backend=backend) -> str:
            with Engine(None, device=device.type, dtype="bfloat16", attention_backend=backend, vit_dp=0) as engine:
                answers = [engine.chat(messages(e), max_tokens=48, temperature=0).text for e in examples]
            same = sum(a == b for a, b in zip(answers, expected))
            if same != len(examples):
                diff = next((a, b) for a, b in zip(answers, expected) if a != b)
                raise AssertionError(
                    f"{same}/{len(examples)} answers as float32 on CPU; e.g. {diff[0]!r} vs {diff[1]!r}"
                )
            return f"{same}/{len(examples)} answers identical"

        check.run(f"built-in model {backend} bfloat16 answers as float32 on CPU", builtin)


# ---- server ----------------------------------------------------------------------------------------


def run_server(check: Check, device: torch.device) -> None:
    import httpx

    from vlm_serve.builtin.scenes import motion_example, random_example, random_motion
    from vlm_serve.engine import Engine
    from vlm_serve.tools.builtin_train import chat_content, messages

    rng = random.Random(7)
    examples = [random_example(rng) for _ in range(6)] + [motion_example(rng, random_motion(rng))]
    examples.append(examples[0])  # a repeated picture: the second asking is served from the caches
    with Engine(None, device="cpu", dtype="float32", vit_dp=0) as engine:
        expected = [engine.chat(messages(e), max_tokens=48, temperature=0).text for e in examples]
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vlm_serve.cli",
        "serve",
        "--port",
        str(port),
        "--vit-dp",
        "1",
        "--device",
        device.type,
    ]
    log = open(check.out / "server.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def start() -> str:
            began = time.monotonic()
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited during start-up (status {process.returncode})")
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        return f"ready in {time.monotonic() - began:.0f} s"
                except httpx.HTTPError:
                    pass
                if time.monotonic() - began > 300:
                    raise RuntimeError("the server was not ready after 300 s")
                time.sleep(0.5)

        check.run("server starts (built-in model, --vit-dp 1)", start)
        if process.poll() is not None:
            return
        bodies = [
            {"messages": [{"role": "user", "content": chat_content(e)}], "temperature": 0, "max_tokens": 48}
            for e in examples
        ]

        def answers() -> str:
            got = [
                httpx.post(url + "/v1/chat/completions", json=b, timeout=120).json()["choices"][0]["message"]["content"]
                for b in bodies
            ]
            wrong = [(e.kind, a, b) for e, a, b in zip(examples, got, expected) if a != b]
            if wrong:
                raise AssertionError(f"{len(wrong)} answers differ from the engine's on CPU, e.g. {wrong[0]}")
            return f"{len(got)} answers (pictures, a clip, a repeated picture) equal the engine's on CPU"

        def streamed() -> str:
            text = ""
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json=bodies[1] | {"stream": True}, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"]
                        text += "".join(c["delta"].get("content") or "" for c in delta)
            if text != expected[1]:
                raise AssertionError(f"streamed {text!r}, the engine answered {expected[1]!r}")
            return "the streamed answer equals the engine's"

        check.run("answers", answers)
        check.run("streaming", streamed)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


# ---- figures ---------------------------------------------------------------------------------------


def _text_prompts(engine, count: int, first: int = 0, length: int = 32) -> list:
    """`count` distinct text prompts of about `length` tokens (no prefix shared past the template), the
    `first`th on."""
    words = "red green blue circle square star moves left right top bottom small large".split()
    conversations = [
        [{"role": "user", "content": f"{i}: " + " ".join(words[(i * 7 + j) % len(words)] for j in range(length))}]
        for i in range(first, first + count)
    ]
    return [engine.processor.process_messages(c, add_generation_prompt=True) for c in conversations]


def _upload(seed: int, side: int = 1024) -> bytes:
    """A `side` x `side` picture as a user sends it: a JPEG file's bytes."""
    from vlm_serve.testing.media import make_image

    buffer = io.BytesIO()
    make_image(side, side, seed=seed).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _picture(engine, upload: bytes):
    """`upload` asked about: decoded, preprocessed and tokenized as the server does."""
    content = [{"type": "image", "image": upload}, {"type": "text", "text": "Describe it."}]
    return engine.processor.process_messages([{"role": "user", "content": content}], add_generation_prompt=True)


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
        runs = [_text_prompts(engine, batch, first, length) for first in (0, batch, 2 * batch)]
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
        upload = _upload(seed)  # (made before the clock starts: drawing the picture is no part of serving it)
        began = time.perf_counter()
        picture = _picture(engine, upload)
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
    arriving = [_picture(engine, _upload(100 + i)) for i in range(pictures)]
    submissions = [
        engine.submit(p, max_tokens=tokens, ignore_eos=True, temperature=0) for p in _text_prompts(engine, decoding)
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
                engine.generate_processed([_picture(engine, _upload(99))], max_tokens=1, temperature=0)  # warm-up
                figures[f"dense {size} ITL, {name}"] = itl_while_pictures_arrive(engine, tokens=2 * tokens)
            return json.dumps(figures[f"dense {size} ITL, {name}"])

        check.run(f"dense {size}: decode ITL while 1024 px pictures arrive, {name}", itl)
    (check.out / "figures.json").write_text(json.dumps(figures, indent=1))


def decode_timeline(engine, steps: int, activities: list, batch: int = 1) -> tuple[object, float]:
    """Torch's profiler over `steps` decode steps of `batch` requests (their prefill and first token before):
    the trace and the seconds those steps took."""
    from torch.profiler import profile

    submissions = [
        engine.submit(x, max_tokens=steps + 8, ignore_eos=True, temperature=0)
        for x in _text_prompts(engine, batch, 1000 + batch)
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
                engine.generate_processed([_picture(engine, _upload(1))], max_tokens=1, temperature=0)  # warm-up
                prompt = _picture(engine, _upload(2))
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
                engine.generate_processed(_text_prompts(engine, 16), max_tokens=4, ignore_eos=True, temperature=0)
                prompts = _text_prompts(engine, 16, 16)
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


# ---- the command -----------------------------------------------------------------------------------

PARTS = ("suite", "parity", "server", "figures", "profile")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for every record (created)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument(
        "--size", default=None, help="model size preset of the figures (default: large on CUDA, tiny on CPU)"
    )
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds per test of the suite part")
    parser.add_argument(
        "--suite-files",
        default=None,
        help="comma-separated names of the suite part's test files "
        "(e.g. test_engine,test_speculative; default: all of SUITE, in its order)",
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; the parts are {', '.join(PARTS)}")
    suite = SUITE
    if args.suite_files is not None:
        by_name = {Path(f).stem: f for f in SUITE}
        names = [name for name in args.suite_files.split(",") if name]
        unknown = [name for name in names if name not in by_name]
        if unknown:
            parser.error(f"--suite-files: not in the suite: {', '.join(unknown)}; it has {', '.join(by_name)}")
        suite = [by_name[name] for name in names]
    device = (
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if args.device == "auto"
        else torch.device(args.device)
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    (args.out / "environment.json").write_text(json.dumps(env, indent=1))
    print("environment: " + json.dumps(env), flush=True)
    checks = []
    for part in parts:
        check = Check(args.out, part)
        began = time.perf_counter()
        if part == "suite":
            if device.type != "cuda":
                print("[suite] skipped: on CPU the test suite itself runs these files (CI)", flush=True)
                continue
            run_suite(check, args.test_timeout, suite)
        elif part == "parity":
            run_parity(check, device)
        elif part == "server":
            run_server(check, device)
        elif part == "figures":
            run_figures(check, device, args.size or ("large" if device.type == "cuda" else "tiny"))
        else:
            run_profile(check, device, args.size or ("large" if device.type == "cuda" else "tiny"))
        print(f"[{part}] {time.perf_counter() - began:.0f} s", flush=True)
        checks.append(check)
    results = [r for c in checks for r in c.results]
    failed = [f"{c.part}: {r['name']}: {r['detail']}" for c in checks for r in c.results if not r["ok"]]
    summary = [
        f"device: {env.get('gpu', env['device'])}; {len(results) - len(failed)} passed, {len(failed)} failed",
        *(f"FAIL {line}" for line in failed),
    ]
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
