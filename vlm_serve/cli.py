"""The `vlm-serve` command."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from vlm_serve.config import (
    CHOICES,
    DTYPES,
    ENGINE_SETTINGS,
    FLAG_ALIASES,
    SETTING_GROUPS,
    ServerArgs,
    setting_docs,
)
from vlm_serve.errors import MediaError

_FLAG_TYPES = {"int": int, "float": float, "str": str}
SERVER_SETTINGS = tuple(f.name for f in dataclasses.fields(ServerArgs))


def add_server_args(parser: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """One flag per `ServerArgs` field in `names` (all by default; `--page-size` for `page_size`), its help
    the field's comment, and `--config` (a YAML file of fields; flags given on the command line win)."""
    parser.add_argument("--config", default=None, help="YAML file of settings (flags win over it)")
    parser.set_defaults(settings=names)
    docs = setting_docs()
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    for title, group_names in SETTING_GROUPS.items():
        shown = [name for name in group_names if names is None or name in names]
        if shown:
            group = parser.add_argument_group(f"{title} settings")
            for name in shown:
                _add_setting(group, fields[name], docs[name])


def _add_setting(parser: argparse._ActionsContainer, f: dataclasses.Field, doc: str) -> None:
    """The flag of one `ServerArgs` field."""
    flags = ["--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ())]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    unset = "unset" if "none" in CHOICES.get(f.name, ()) else "none"  # (where "none" is a value of its own)
    shown = "" if f.type == "bool" else f" (default: {unset if default is None else default})"
    options: dict[str, Any] = {"default": default, "dest": f.name, "help": doc + shown}
    if f.type == "bool":
        parser.add_argument(*flags, action="store_true", **options)
    elif str(f.type).startswith("list["):
        parser.add_argument(*flags, nargs="*", metavar="VALUE", **options)
    else:
        kind = _FLAG_TYPES[str(f.type).split("|")[0].strip()]  # annotations are strings: "int | None"
        parser.add_argument(*flags, type=kind, choices=CHOICES.get(f.name), **options)


def load_config(path: str, names: Sequence[str] | None = None) -> dict[str, Any]:
    """`ServerArgs` fields from a YAML mapping (keys may use - or _); with `names`, only those may appear."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read the config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"the config file {path} must hold a mapping of settings")
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    settings = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) in {path}: {', '.join(unknown)}")
    unused = sorted(set(settings) - set(names if names is not None else known))
    if unused:
        raise ValueError(f"setting(s) in {path} that only `vlm-serve serve` takes: {', '.join(unused)}")
    return settings


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags over the `--config` file's settings over the defaults."""
    ns = _parse_known(parser, argv)
    if getattr(ns, "config", None):
        ns.subparser.set_defaults(**load_config(ns.config, ns.settings))
        ns = _parse_known(parser, argv)
    return ns


def _parse_known(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that arguments no subcommand knows are refused by that subcommand's
    parser, with its usage (argparse would show the top level's, which lists no flags)."""
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        ns.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return ns


def server_args_from(ns: argparse.Namespace) -> dict:
    """The `ServerArgs` fields the command took (all but `model`), as keywords."""
    return {name: getattr(ns, name) for name in ns.settings or SERVER_SETTINGS if name != "model"}


def server_args_of(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(model=ns.model, **server_args_from(ns))


def cmd_generate(ns: argparse.Namespace) -> int:
    from vlm_serve.engine import Engine
    from vlm_serve.multimodal.media import read_media

    for kind, sources in (("image", ns.image), ("video", ns.video)):
        for source in sources:  # a missing file is said at once, before the model loads
            if not source.startswith(("http://", "https://", "data:")):
                read_media(source, kind)
    engine = Engine(ns.model, **server_args_from(ns))
    content: list[dict] = [{"type": "image", "image": path} for path in ns.image]
    content += [{"type": "video", "video": path} for path in ns.video]
    content.append({"type": "text", "text": ns.prompt})
    start = time.perf_counter()
    out = engine.chat(
        [{"role": "user", "content": content}], max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.seed
    )
    elapsed = time.perf_counter() - start
    print(out.text)
    print(
        f"[{out.prompt_tokens} prompt tokens, {len(out.token_ids)} generated, finish: {out.finish_reason}, "
        f"{elapsed:.2f}s]",
        file=sys.stderr,
    )
    return 0


DATASET_SUFFIXES = (".parquet", ".jsonl", ".json")  # inputs of `caption --ray` read as rows (`batch.job`)


def cmd_caption(ns: argparse.Namespace) -> int:
    from vlm_serve.caption import DEFAULT_PROMPT, CaptionSummary, caption_images, collect_images, plan_captions
    from vlm_serve.engine import Engine

    if ns.ray is not None:
        return caption_on_ray(ns)
    datasets = [path for path in ns.inputs if Path(path).suffix in DATASET_SUFFIXES]
    if datasets:
        raise ValueError(f"{datasets[0]} is a dataset file: its rows are captioned with --ray (local or a cluster)")
    output = Path(ns.output)
    plan = plan_captions(collect_images(ns.inputs), output, ns.resume, ns.retry_failed, ns.overwrite)
    summary = CaptionSummary(skipped=plan.skipped)
    try:
        if plan.todo:  # (with nothing left, no model loads)
            with Engine(ns.model, **server_args_from(ns)) as engine:
                sampling = {"max_tokens": ns.max_tokens, "temperature": ns.temperature}
                summary = caption_images(engine, plan, ns.prompt or DEFAULT_PROMPT, ns.batch_size, **sampling)
    except KeyboardInterrupt:
        kept = f"the lines in {output} are complete (--resume goes on)" if output.is_file() else "nothing was written"
        print(f"\nvlm-serve: interrupted; {kept}", file=sys.stderr)
        return 130
    print(
        f"{summary.captioned} captioned, {summary.failed} failed, {summary.skipped} already in {output}",
        file=sys.stderr,
    )
    return 0


def caption_on_ray(ns: argparse.Namespace) -> int:
    """`caption --ray`: the job on a Ray cluster (`vlm_serve.batch.job`)."""
    from vlm_serve.batch.job import caption_dataset, row_files, start_ray
    from vlm_serve.batch.pipeline import check_output
    from vlm_serve.caption import DEFAULT_PROMPT, collect_images

    if ns.retry_failed:
        raise ValueError("--retry-failed is for JSON lines written without --ray; a Ray job resumes with --resume")
    if ns.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, not {ns.replicas}")
    output = check_output(ns.output, ns.resume, ns.overwrite)  # (before Ray starts)
    datasets = [Path(path) for path in ns.inputs if Path(path).suffix in DATASET_SUFFIXES]
    images = collect_images([path for path in ns.inputs if Path(path).suffix not in DATASET_SUFFIXES])
    files = row_files(datasets, images, output)
    threads = max(1, len(os.sched_getaffinity(0)) // ns.replicas) if ns.ray == "local" else None
    start_ray(ns.ray, ns.replicas)
    try:
        summary = caption_dataset(
            files,
            output,
            resume=ns.resume,
            overwrite=ns.overwrite,
            model=ns.model,
            replicas=ns.replicas,
            prompt=ns.prompt or DEFAULT_PROMPT,
            sampling={"max_tokens": ns.max_tokens, "temperature": ns.temperature},
            settings=server_args_from(ns),
            batch_size=max(1, ns.batch_size // 4),  # (and 4 batches in flight: --batch-size images in all)
            pending_batches=4,
            preprocess_workers=ns.replicas,
            threads_per_replica=threads,
        )
    except KeyboardInterrupt:
        print(f"\nvlm-serve: interrupted; --resume goes on from what {output} holds", file=sys.stderr)
        return 130
    print(f"{summary.answered} answered, {summary.failed} failed in {output}", file=sys.stderr)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from vlm_serve.process import exit_now
    from vlm_serve.server.launcher import launch_server

    exit_now(launch_server(server_args_of(ns)))  # (its children have stopped; settings it refuses raise)


def cmd_demo(ns: argparse.Namespace) -> int:
    from vlm_serve.demo.chat import LocalChat, RemoteChat
    from vlm_serve.demo.page import run_demo
    from vlm_serve.engine import Engine
    from vlm_serve.server.launcher import bind_http_socket

    bind_http_socket(ns.host, ns.port).close()  # a port in use is refused before the model loads
    if ns.api_base is not None:
        backend = RemoteChat(ns.api_base, ns.api_key)
        try:
            run_demo(backend, ns.host, ns.port, ns.concurrency_limit)
        finally:
            backend.close()
        return 0
    options = server_args_from(ns)
    max_media_mb = options.pop("max_media_mb")  # (the page's; an engine has no uploads)
    with Engine(ns.model, **options) as engine:
        backend = LocalChat(engine, ns.reasoning_parser, max_media_mb)
        try:
            run_demo(backend, ns.host, ns.port, ns.concurrency_limit)
        finally:
            backend.close()
    return 0


def cmd_create_tiny_model(ns: argparse.Namespace) -> int:
    from vlm_serve.testing.tiny_model import create_tiny_model

    path = create_tiny_model(
        ns.out_dir,
        arch=ns.arch,
        seed=ns.seed,
        size=ns.size,
        dtype=ns.dtype,
        quantize=ns.quantize,
        weights=not ns.no_weights,
    )
    print(path)
    return 0


def add_answer_args(parser: argparse.ArgumentParser, what: str) -> None:
    """`--max-tokens` and `--temperature` of an offline command that answers with `what`."""
    parser.add_argument("--max-tokens", type=int, default=64, help=f"longest {what} in tokens (default: %(default)s)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature, 0 = greedy (default: the checkpoint's generation_config.json)",
    )


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, wrapping lines at spaces only (names like sglang-router stay whole)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-serve", description="Serve Qwen3-VL vision-language models.", formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('vlm_serve')}")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=partial(argparse.ArgumentParser, formatter_class=_HelpFormatter)
    )

    serve = sub.add_parser(
        "serve",
        usage="%(prog)s [settings]",
        help="the OpenAI-compatible HTTP server (default http://127.0.0.1:30000)",
        description="The OpenAI-compatible HTTP server (default http://127.0.0.1:30000).",
    )
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve, subparser=serve)

    demo = sub.add_parser(
        "demo",
        usage="%(prog)s [--host HOST] [--port PORT] [settings]",
        help="a Gradio chat page (images, short videos, streamed answers)",
        description="A Gradio chat page (images, short videos, streamed answers).",
    )
    demo.add_argument("--host", default="127.0.0.1", help="address the page is served on (default: %(default)s)")
    demo.add_argument("--port", type=int, default=7860, help="port the page is served on (default: %(default)s)")
    demo.add_argument(
        "--api-base",
        default=None,
        help="front a running `vlm-serve serve` (or a router) at this URL through its OpenAI API instead of "
        "loading the model here (e.g. http://127.0.0.1:30000)",
    )
    demo.add_argument("--api-key", default=None, help="the API key the server at --api-base asks for")
    demo.add_argument(
        "--reasoning-parser",
        choices=CHOICES["reasoning_parser"],
        default=None,
        help="show a thinking model's reasoning apart from its answer (the engine's model; a server at "
        "--api-base parses its own with its --reasoning-parser)",
    )
    demo.add_argument(
        "--concurrency-limit",
        type=int,
        default=16,
        help="conversations answered at once, batched together; more wait their turn (default: %(default)s)",
    )
    # (after its own flags, which --help shows first; --max-media-mb bounds the page's uploads)
    add_server_args(demo, (*ENGINE_SETTINGS, "max_media_mb"))
    demo.set_defaults(func=cmd_demo, subparser=demo)

    gen = sub.add_parser(
        "generate",
        usage="%(prog)s --prompt PROMPT [--image FILE] [--video FILE] [options] [settings]",
        help="answer one prompt (with images/videos) offline and print it",
        description="Answer one prompt (with images/videos) offline and print it.",
    )
    gen.add_argument("--prompt", required=True, help="the question or instruction about the images and videos")
    gen.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    gen.add_argument("--video", action="append", default=[], help="video file (repeatable)")
    add_answer_args(gen, "answer")
    add_server_args(gen, ENGINE_SETTINGS)  # (after its own flags, which --help shows first)
    gen.set_defaults(func=cmd_generate, subparser=gen)

    cap = sub.add_parser(
        "caption",
        usage="%(prog)s --output FILE [options] [settings] INPUT [INPUT ...]",
        help="caption every image of files, folders or path lists into JSON lines",
        description="Caption every image of files, folders or path lists into JSON lines.",
    )
    cap.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="image file, folder (recursive) or text file of paths; with --ray also dataset files (.parquet, "
        ".jsonl) with an id and an image, video or messages column",
    )
    cap.add_argument(
        "--output",
        required=True,
        help="JSON-lines file: path, caption, tokens, time (and error); with --ray a folder of .jsonl, .parquet "
        "or .tar (WebDataset) files, by its extension: id, answer, token counts, stage times, error",
    )
    cap.add_argument(
        "--prompt", default=None, help="what to ask about each image (default: a one-sentence description)"
    )
    cap.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="images in flight at once (with --ray: per replica) (default: %(default)s)",
    )
    add_answer_args(cap, "caption")
    cap.add_argument("--resume", action="store_true", help="skip images already in the output; append the rest")
    cap.add_argument("--retry-failed", action="store_true", help="--resume, and caption failed images again")
    cap.add_argument(
        "--overwrite", action="store_true", help="start the output again (else one with captions is refused)"
    )
    cap.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run the job on Ray Data (pip install vlm_serve[batch]): on the cluster at ADDRESS (auto: the one "
        "`ray start` started here) or, without one, on a Ray started on this machine for the job",
    )
    cap.add_argument(
        "--replicas", type=int, default=1, help="with --ray: engines, each a Ray actor (default: %(default)s)"
    )
    add_server_args(cap, ENGINE_SETTINGS)  # (after its own flags, which --help shows first)
    cap.set_defaults(func=cmd_caption, subparser=cap)

    tiny = sub.add_parser(
        "create-tiny-model",
        help="write a small random Qwen3-VL or Qwen2.5-VL checkpoint",
        description="Write a small random Qwen3-VL or Qwen2.5-VL checkpoint.",
    )
    tiny.add_argument("out_dir", help="folder the checkpoint is written into (made if missing)")
    tiny.add_argument(
        "--arch",
        choices=["moe", "dense", "qwen2.5"],
        default="moe",
        help="Qwen3-VL-MoE (moe), dense Qwen3-VL (dense) or Qwen2.5-VL (qwen2.5, dense) (default: %(default)s)",
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    tiny.add_argument(
        "--size",
        choices=["tiny", "small", "medium", "large"],
        default="tiny",
        help="parameters (fp32) dense / MoE: tiny 0.5M / 0.6M (for tests), small 50M / 233M, medium 261M / 425M "
        "(benchmark models shaped like scaled-down Qwen3-VL-235B-A22B: 128 experts, top-8); large: Qwen3-VL-8B's "
        "shapes / Qwen3-VL-30B-A3B's at 24 of its 48 layers (with --no-weights) (default: %(default)s)",
    )
    tiny.add_argument(
        "--no-weights",
        action="store_true",
        help="write the config, tokenizer and processor only, to serve with --load-format dummy (random weights)",
    )
    tiny.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="dtype of the weights (default: float32, or bfloat16 with --quantize, as the published checkpoints)",
    )
    tiny.add_argument(
        "--quantize",
        choices=["fp8"],
        default=None,
        help="fp8: the layout of Qwen's FP8 checkpoints (128 x 128 block-scaled e4m3 weights, the vision tower, "
        "routers and lm_head in bfloat16) (default: not quantized)",
    )
    tiny.set_defaults(func=cmd_create_tiny_model, subparser=tiny)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        ns = parse_args(parser, argv)
    except ValueError as e:
        print(f"vlm-serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(ns, "log_level", "warning").upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError, FileExistsError, MediaError) as e:
        print(f"vlm-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (while loading, say): the stop needs no traceback
        return 130


if __name__ == "__main__":
    sys.exit(main())
