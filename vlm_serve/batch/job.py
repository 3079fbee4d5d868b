"""`vlm-serve caption --ray`: the caption job on a Ray cluster, or on one Ray starts on this machine.

Its rows come from dataset files (Parquet or JSON lines with an `id` and an `image`, `video` or
`messages` column: `stages.py`) or from image paths, each its own row with its absolute path as `id`;
Ray resumes only rows it reads from files, so the paths are written as rows beside the output first
(`<output>.rows.jsonl`). The answers go into `output`, a folder in the format its extension names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.data

from vlm_serve.batch.pipeline import IO_CPUS, count_answers, write_answers

READERS = {".parquet": "read_parquet", ".jsonl": "read_json", ".json": "read_json"}


@dataclass
class JobSummary:
    answered: int
    failed: int


def start_ray(address: str, replicas: int) -> None:
    """Joins the cluster at `address` (`auto`: the one started on this machine by `ray start`), or with
    `local` starts one in this process for this job, with a CPU of Ray's for each replica and
    preprocessing worker and for reading, resuming and writing beside them (the cores themselves go to
    the replicas' engines: `threads_per_replica`)."""
    if address == "local":
        ray.init(num_cpus=2 * replicas + 2, include_dashboard=False)
    else:
        ray.init(address=address)


def row_files(datasets: Sequence[Path], images: Sequence[Path], output: Path) -> list[Path]:
    """The files holding the job's rows: `datasets` (files of one format), or a file beside `output` with
    one row per image of `images`. Checked before Ray starts."""
    if datasets and images:
        raise ValueError("give dataset files (.parquet, .jsonl) or images, not both: their rows differ")
    if images:
        datasets = [output.with_name(output.name + ".rows.jsonl")]
        rows = ({"id": str(path.resolve()), "image": str(path.resolve())} for path in images)
        datasets[0].write_text("".join(json.dumps(row) + "\n" for row in rows))
    if len({READERS[path.suffix] for path in datasets}) != 1:
        raise ValueError("the dataset files must all be Parquet or all JSON lines")
    missing = [str(path) for path in datasets if not path.exists()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)}: no such file or folder")
    return list(datasets)


def caption_dataset(
    files: Sequence[Path],
    output: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    **options: Any,
) -> JobSummary:
    """Runs the job over the rows of `files` (`row_files`) on the connected cluster (`start_ray`) and
    counts what its output holds."""
    reader = getattr(ray.data, READERS[files[0].suffix])
    rows = reader([str(path) for path in files], num_cpus=IO_CPUS)
    write_answers(rows, output, resume=resume, overwrite=overwrite, **options)
    total, failed = count_answers(output)
    return JobSummary(answered=total - failed, failed=failed)
