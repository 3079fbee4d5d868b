"""Does serving keep meaning? The built-in model's greedy answers on held-out synthetic scenes, scored by
exact match, through the real server and through transformers' `generate` on the same weights.

The held-out set is drawn from its own seed (training draws from seed 0, its probe from seed 1):
`--scenes` items, each asked twice with different questions. The first asking puts the media before
the question; the second does too for even items, whose media the prefix cache then holds, and puts the
question first for odd ones, whose media then come from the embedding cache:
  * pictures of 1-4 shapes, asked two of: a caption, the count, a shape's colour, is there a shape;
  * clips of one moving shape (one in eight items), asked two ways which way it moves;
  * pairs of pictures (one in twelve), asked two ways which has more shapes.
All first askings go out before the second ones.

The server runs as `vlm-serve serve --vit-dp 2 --chunked-prefill-size 16` (prompts of 30-80 tokens go
in chunks of 16), taking `--concurrency` requests at a time, temperature 0, up to 64 tokens each.
transformers runs each question alone, in float32. The table gives each kind's exact match for both,
and how many answers differ between them; then the server's cache counters.

    python benchmarks/bench_quality.py [--scenes 500] [--concurrency 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import torch

from compare_peer import our_server, running  # benchmarks/, next to this script
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.builtin.scenes import (
    Example,
    compare_example,
    motion_example,
    random_motion,
    random_scene,
    render,
    render_motion,
    scene_example,
)
from vlm_serve.builtin.train import greedy_answer, messages
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.processor import MultimodalProcessor

SCENE_KINDS = ("caption", "count", "colour", "presence")
HELD_OUT_SEED = 1000
MAX_TOKENS = 64


def held_out(scenes: int, seed: int = HELD_OUT_SEED) -> list[tuple[Example, Example]]:
    """`scenes` items, each as two questions about the same media."""
    rng = random.Random(seed)
    items = []
    for i in range(scenes):
        if i % 8 == 7:
            motion = random_motion(rng)
            frames = render_motion(motion)
            items.append((motion_example(rng, motion, frames), motion_example(rng, motion, frames)))
        elif i % 12 == 5:
            first, second = random_scene(rng), random_scene(rng)
            images = [render(first), render(second)]
            items.append((compare_example(rng, first, second, images), compare_example(rng, first, second, images)))
        else:
            scene = random_scene(rng)
            image = render(scene)
            kinds = rng.sample(SCENE_KINDS, 2)
            items.append((scene_example(rng, kinds[0], scene, image), scene_example(rng, kinds[1], scene, image)))
        items[-1][1].question_first = i % 2 == 1
    return items


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_content(example: Example) -> list[dict]:
    """The OpenAI message content of `example`, as training put it (`messages`), with the pictures as PNG
    and the clip as MPEG-4 data URLs."""
    content = []
    for part in messages(example)[0]["content"]:
        if part["type"] == "image":
            buffer = io.BytesIO()
            part["image"].save(buffer, format="PNG")
            part = {"type": "image_url", "image_url": {"url": data_url("image/png", buffer.getvalue())}}
        elif part["type"] == "video":
            part = {"type": "video_url", "video_url": {"url": data_url("video/mp4", part["video"])}}
        content.append(part)
    return content


async def ask_server(url: str, name: str, examples: list[Example], concurrency: int) -> list[str]:
    """Every example's answer from the server, `concurrency` requests in flight."""
    bodies = [
        {"model": name, "messages": [{"role": "user", "content": chat_content(e)}],
         "temperature": 0, "max_tokens": MAX_TOKENS}
        for e in examples
    ]  # fmt: skip
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(body: dict) -> str:
            async with gate:
                response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["message"]["content"]

        return await asyncio.gather(*(one(b) for b in bodies))


def server_counters(url: str) -> dict[str, float]:
    """The cache counters of the server's /metrics."""
    wanted = ("prefix_cache_hit_rate", "embedding_cache_hits_total", "embedding_cache_misses_total",
              "embedding_cache_inflight_hits_total", "media_items_total", "vit_items_total")  # fmt: skip
    found = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        for name in wanted:
            if key.endswith(name):
                found[name] = float(value)
    return found


def ask_transformers(model_dir: Path, examples: list[Example]) -> list[str]:
    import transformers

    tokenizer = Tokenizer.from_pretrained(model_dir)
    processor = MultimodalProcessor.from_pretrained(model_dir, tokenizer, cache_mb=0)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [greedy_answer(model, processor, e, MAX_TOKENS) for e in examples]


def table(examples: list[Example], server: list[str], reference: list[str]) -> str:
    rows: dict[str, list[tuple[bool, bool, bool]]] = defaultdict(list)
    for e, ours, theirs in zip(examples, server, reference, strict=True):
        rows[e.kind].append((ours == e.answer, theirs == e.answer, ours != theirs))
    lines = [f"{'kind':<10} {'asked':>6} {'server':>8} {'transformers':>13} {'answers differ':>15}"]
    for kind in sorted(rows) + ["all"]:
        marks = [m for k in rows for m in rows[k]] if kind == "all" else rows[kind]
        n = len(marks)
        lines.append(f"{kind:<10} {n:>6} {100 * sum(m[0] for m in marks) / n:>7.1f}% "
                     f"{100 * sum(m[1] for m in marks) / n:>12.1f}% {sum(m[2] for m in marks):>15}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenes", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", type=Path, default=BUILTIN_MODEL, help="checkpoint (default: the built-in model)")
    parser.add_argument("--server-args", default="--vit-dp 2 --chunked-prefill-size 16")
    parser.add_argument("--show-misses", type=int, default=10, help="wrong server answers to print")
    args = parser.parse_args()

    items = held_out(args.scenes)
    examples = [first for first, _ in items] + [second for _, second in items]  # all first askings first
    print(f"{len(items)} held-out items (seed {HELD_OUT_SEED}), {len(examples)} questions, model {args.model}")

    server = our_server(args.model, "builtin", args.server_args)
    log = Path(tempfile.mkdtemp(prefix="bench-quality-")) / "server.log"
    with running(server, log, timeout=300):
        began = time.perf_counter()
        answers = asyncio.run(ask_server(server.url, "builtin", examples, args.concurrency))
        served = time.perf_counter() - began
        counters = server_counters(server.url)
    print(f"server ({shlex.join(server.command[3:])}): {served:.1f} s at concurrency {args.concurrency}")

    began = time.perf_counter()
    reference = ask_transformers(args.model, examples)
    print(f"transformers generate, one question at a time: {time.perf_counter() - began:.1f} s\n")

    print(table(examples, answers, reference))
    print("\nserver caches: " + ", ".join(f"{k} {v:g}" for k, v in counters.items()))
    misses = [(e, a) for e, a in zip(examples, answers) if a != e.answer]
    for e, a in misses[: args.show_misses]:
        print(f"  {e.kind}: {e.question!r}\n    expected {e.answer!r}\n    server   {a!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
