"""`vlm-serve caption`: a caption for every image of some files, folders and lists of paths.

The in-process engine does the work. Images are preprocessed one by one and submitted as they are
ready, keeping up to `batch_size` in flight, so the scheduler batches them continuously. Each finished
image becomes one JSON line: `{"path", "caption", "tokens", "time"}` (the image's absolute path), plus
`"error"` when it could not be captioned (an unreadable image is reported in its line and the run goes
on). What a run will do is decided before a model loads (`plan_captions`): an output that holds captions
is never written over unless asked (`overwrite`); with `resume`, images already in it (by resolved path,
however they were named) are skipped and new lines are appended; `retry_failed` resumes too, and
captions again the images whose line holds an error, replacing that line.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from vlm_serve.engine import Engine, Submission
from vlm_serve.errors import ApiError, MediaError

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
DEFAULT_PROMPT = "Describe this image in one sentence."


@dataclass
class CaptionSummary:
    captioned: int = 0
    failed: int = 0
    skipped: int = 0  # already in the output (resume)


@dataclass
class CaptionPlan:
    """What a caption run will do, decided before a model loads: the images left to caption, and the
    earlier run's lines that stay in `output` (with `resume`)."""

    output: Path
    todo: list[Path]
    kept: list[dict] = field(default_factory=list)
    skipped: int = 0
    resume: bool = False


def collect_images(inputs: Sequence[str]) -> list[Path]:
    """Image files as given, the images under folders (recursively, by extension, sorted) and the paths
    listed in other files (one per line; blank lines and `#` comments ignored), each path once."""
    paths: list[Path] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            paths += sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
        elif path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS:
            paths.append(path)
        elif path.is_file():
            lines = (line.strip() for line in path.read_text().splitlines())
            paths += [Path(line) for line in lines if line and not line.startswith("#")]
        else:
            raise FileNotFoundError(f"{raw}: no such file or folder")
    return list(dict.fromkeys(paths))


def read_lines(output: Path) -> list[dict]:
    """The complete records of an earlier run's `output` (none if there is no such file)."""
    if not output.is_file():
        return []
    records = []
    for line in output.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("path"), str):
            records.append(record)
    return records


def plan_captions(
    paths: Sequence[Path], output: Path, resume: bool = False, retry_failed: bool = False, overwrite: bool = False
) -> CaptionPlan:
    """The images of `paths` left to caption into `output`. An output that holds captions is refused
    unless the run resumes from it or `overwrite` starts it again: a run repeated by mistake must not
    lose what the first one did."""
    if output.is_dir():
        raise FileExistsError(f"{output} is a folder (a --ray job's output?), not the JSON-lines file captions go to")
    paths = list(dict.fromkeys(p.resolve() for p in paths))
    resume = resume or retry_failed
    records = read_lines(output) if resume or not overwrite else []
    if records and not resume:
        raise FileExistsError(
            f"{output} already holds {len(records)} captions: --resume goes on from them, --overwrite starts again"
        )
    kept = [r for r in records if not (retry_failed and "error" in r)]
    done = {Path(r["path"]).resolve() for r in kept}
    todo = [p for p in paths if p not in done]
    return CaptionPlan(output, todo, kept, len(paths) - len(todo), resume)


def caption_images(
    engine: Engine,
    plan: CaptionPlan,
    prompt: str = DEFAULT_PROMPT,
    batch_size: int = 64,
    progress: bool = True,
    **sampling: Any,
) -> CaptionSummary:
    """Captions the images of `plan` into its output (see the module docstring)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, not {batch_size}")
    engine.sampling_params(**sampling)  # bad sampling arguments fail before any work
    if plan.resume:  # the earlier lines kept: whole ones only (an interrupted run may have cut the last one)
        _rewrite(plan.output, plan.kept)
    summary = CaptionSummary(skipped=plan.skipped)
    pending: dict[Submission, tuple[Path, float]] = {}
    with plan.output.open("a" if plan.resume else "w") as out, progress_bar(len(plan.todo), progress) as bar:

        def write(path: Path, start: float, caption: str | None, tokens: int, error: str | None) -> None:
            seconds = round(time.perf_counter() - start, 4)
            record = {"path": str(path), "caption": caption, "tokens": tokens, "time": seconds}
            if error is not None:
                record["error"] = error
                summary.failed += 1
            else:
                summary.captioned += 1
            _write_line(out, record)
            bar.update(1)

        def drain(limit: int) -> None:
            while len(pending) > limit:
                engine.step()
                for submission in [s for s in pending if s.done]:
                    path, start = pending.pop(submission)
                    try:
                        result = engine.result(submission)
                    except ApiError as exc:  # refused (e.g. too long for the context), or the image failed to encode
                        write(path, start, None, 0, str(exc))
                        continue
                    write(path, start, result.text, len(result.token_ids), None)

        for path in plan.todo:
            drain(batch_size - 1)
            start = time.perf_counter()
            content = [{"type": "image", "image": str(path)}, {"type": "text", "text": prompt}]
            try:
                x = engine.processor.process_messages([{"role": "user", "content": content}])
                pending[engine.submit(x, **sampling)] = (path, start)
            except (MediaError, ValueError, OSError) as exc:
                write(path, start, None, 0, str(exc))
        drain(0)
    return summary


def progress_bar(total: int, enabled: bool = True, every: float = 10.0):
    """tqdm's bar (rate, ETA) on a terminal; elsewhere (a log file, a job's output) a plain line every
    `every` seconds and at the end, as a bar's redraws would be noise there."""
    if enabled and sys.stderr.isatty():
        return tqdm(total=total, unit="img")
    return ProgressLines(total, enabled, every)


class ProgressLines:
    """Progress as plain lines on stderr: done/total, the rate and the time left."""

    def __init__(self, total: int, enabled: bool, every: float) -> None:
        self.total, self.enabled, self.every = total, enabled, every
        self.done, self.start = 0, time.monotonic()
        self.last = self.start

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.done:
            self.line()

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last >= self.every:
            self.line()

    def line(self) -> None:
        self.last = time.monotonic()
        if not self.enabled:
            return
        rate = self.done / max(self.last - self.start, 1e-9)
        left = (self.total - self.done) / rate if rate else float("inf")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left != float("inf") else "?"
        print(f"{self.done}/{self.total} images, {rate:.2f} img/s, {eta} left", file=sys.stderr, flush=True)


def _rewrite(output: Path, records: list[dict]) -> None:
    """`output` holding just `records`, replaced in one step (an interruption leaves the old file)."""
    if not output.is_file():
        return
    partial = output.with_name(output.name + ".partial")
    with partial.open("w") as out:
        for record in records:
            _write_line(out, record)
    partial.replace(output)


def _write_line(out: TextIO, record: dict) -> None:
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()  # a line per finished image survives an interruption, for --resume
