"""Does serving keep meaning? The built-in model's greedy answers on held-out synthetic scenes, scored by
exact match, through the real server and through transformers' `generate` on the same weights.

Two held-out sets, each drawn from its own seed (training draws from seed 0, its probe from seed 1):
  * "old": the first model's distribution (shapes near the centres of a 3 x 3 grid, palette colours, a few
    phrasings: `builtin/scenes.py`), as this benchmark has always drawn it;
  * "wide": the distribution the model is trained on now (shapes anywhere, of any size, in any shade,
    with noise and JPEG artefacts; clips in eight directions; many phrasings, typed in any case; and
    questions outside its skills).
Each has `--scenes` items, each asked twice with different questions. The first asking puts the media
before the question; the second does too for even items, whose media the prefix cache then holds, and
puts the question first for odd ones, whose media then come from the embedding cache:
  * pictures of 1-4 shapes, asked two of: a caption, the count, a shape's colour, is there a shape (and
    in the wide set also: what shape, where is a shape);
  * clips of one moving shape (one in eight items), asked two ways which way it moves;
  * pairs of pictures (one in twelve), asked two ways which has more shapes;
  * in the wide set, one item in ten: a question outside its skills, with and without a picture.
All first askings go out before the second ones.

The server runs as `vlm-serve serve --vit-dp 2 --chunked-prefill-size 16` (prompts of 30-80 tokens go
in chunks of 16), taking `--concurrency` requests at a time, temperature 0, up to 64 tokens each.
transformers runs each question alone, in float32. The table gives each kind's exact match for both,
and how many answers differ between them; then the server's cache counters.

    python benchmarks/bench_quality.py [--scenes 500] [--sets old,wide] [--concurrency 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
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
    other_example,
    random_motion,
    random_scene,
    render,
    render_motion,
    scene_example,
    typed,
)
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.tools.builtin_train import chat_content, greedy_answer

SCENE_KINDS = {"old": ("caption", "count", "colour", "presence"),
               "wide": ("caption", "shape", "count", "colour", "presence", "place")}  # fmt: skip
HELD_OUT_SEEDS = {"old": 1000, "wide": 2000}
MAX_TOKENS = 64


def held_out(scenes: int, name: str = "old") -> list[tuple[Example, Example]]:
    """`scenes` items of the held-out set `name`, each as two questions about the same media."""
    rng, wide = random.Random(HELD_OUT_SEEDS[name]), name == "wide"
    items = []
    for i in range(scenes):
        if i % 8 == 7:
            motion = random_motion(rng, wide)
            frames = render_motion(motion)
            items.append(tuple(motion_example(rng, motion, frames, wide) for _ in range(2)))
        elif i % 12 == 5:
            first, second = random_scene(rng, wide=wide), random_scene(rng, wide=wide)
            images = [render(first), render(second)]
            items.append(tuple(compare_example(rng, first, second, images, wide) for _ in range(2)))
        elif wide and i % 10 == 9:
            items.append((other_example(rng, random_scene(rng, wide=True)), other_example(rng, None)))
        else:
            scene = random_scene(rng, wide=wide)
            image = render(scene)
            kinds = rng.sample(SCENE_KINDS[name], 2)
            items.append(tuple(scene_example(rng, kind, scene, image, wide) for kind in kinds))
        if wide:
            for example in items[-1]:
                example.question = typed(rng, example.question, wide)
        items[-1][1].question_first = i % 2 == 1
    return items


async def ask_server(url: str, name: str, examples: list[Example], concurrency: int) -> list[str]:
    """Every example's answer from the server, `concurrency` requests in flight."""
    bodies = [
        {
            "model": name,
            "messages": [{"role": "user", "content": chat_content(e)}],
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        }
        for e in examples
    ]
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
    wanted = (
        "prefix_cache_hit_rate",
        "embedding_cache_hits_total",
        "embedding_cache_misses_total",
        "embedding_cache_inflight_hits_total",
        "media_items_total",
        "vit_items_total",
    )
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
        lines.append(
            f"{kind:<10} {n:>6} {100 * sum(m[0] for m in marks) / n:>7.1f}% "
            f"{100 * sum(m[1] for m in marks) / n:>12.1f}% {sum(m[2] for m in marks):>15}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenes", type=int, default=500, help="items of each held-out set")
    parser.add_argument("--sets", default="old,wide", help="held-out sets: old, wide or both")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", type=Path, default=BUILTIN_MODEL, help="checkpoint (default: the built-in model)")
    parser.add_argument("--server-args", default="--vit-dp 2 --chunked-prefill-size 16")
    parser.add_argument("--show-misses", type=int, default=10, help="wrong server answers to print")
    args = parser.parse_args()

    sets = {}
    for name in args.sets.split(","):
        items = held_out(args.scenes, name)
        sets[name] = [first for first, _ in items] + [second for _, second in items]  # all first askings first
        print(f"{name}: {len(items)} held-out items (seed {HELD_OUT_SEEDS[name]}), {len(sets[name])} questions")
    print(f"model {args.model}")

    server = our_server(args.model, "builtin", args.server_args, "native")
    log = Path(tempfile.mkdtemp(prefix="bench-quality-")) / "server.log"
    answers = {}
    with running(server, log, timeout=300):
        for name, examples in sets.items():
            began = time.perf_counter()
            answers[name] = asyncio.run(ask_server(server.url, "builtin", examples, args.concurrency))
            print(
                f"server ({shlex.join(server.command[3:])}), {name} set: {time.perf_counter() - began:.1f} s "
                f"at concurrency {args.concurrency}"
            )
        counters = server_counters(server.url)

    for name, examples in sets.items():
        began = time.perf_counter()
        reference = ask_transformers(args.model, examples)
        print(f"\n{name} set; transformers generate, one question at a time: {time.perf_counter() - began:.1f} s\n")
        print(table(examples, answers[name], reference))
        misses = [(e, a) for e, a in zip(examples, answers[name]) if a != e.answer]
        for e, a in misses[: args.show_misses]:
            print(f"  {e.kind}: {e.question!r}\n    expected {e.answer!r}\n    server   {a!r}")
    print("\nserver caches: " + ", ".join(f"{k} {v:g}" for k, v in counters.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
