"""The `parity` part: each attention backend the device has, in float32 and bfloat16, against transformers
(prefill logits, greedy tokens), the built-in model's bfloat16 answers against its float32 ones, and decode
replayed from CUDA graphs against eager decode."""

from __future__ import annotations

import importlib.util
import json
import random
import tempfile
from pathlib import Path

import torch

from vlm_serve.llm.layers.attention import FLASHINFER_HEAD_DIMS
from vlm_serve.tools.gpu_check.check import Check
from vlm_serve.tools.gpu_check.prompts import text_prompts

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


def _parity_prompt(engine, seed: int = 1):
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
                for i, p in enumerate(text_prompts(engine, 5))
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
            processed = _parity_prompt(cpu_engine)
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
