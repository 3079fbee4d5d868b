"""A batch job on Ray Data: rows (`stages.py` says what they hold) through a preprocessing stage on CPUs
and engine replicas as actors, the same code on this machine (`ray.init()`) or a cluster; the answers
written through Ray's sinks, and a job resumed by `id` through Ray's own checkpointing."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import ray.data
import torch
from ray.data.checkpoint import CheckpointConfig

from vlm_serve.batch.stages import DEFAULT_PROMPT, Generate, Preprocess


def answer_rows(
    rows: ray.data.Dataset,
    model: str,
    *,
    replicas: int = 1,
    prompt: str = DEFAULT_PROMPT,
    sampling: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    batch_size: int = 16,
    pending_batches: int = 4,
    preprocess_workers: int = 1,
    preprocess_cpus: float = 1,
    cpus_per_replica: float = 1,
) -> ray.data.Dataset:
    """The answers to `rows`, a row each (`stages.OUTPUT_COLUMNS`). Each of the `replicas` engines holds
    up to `pending_batches` batches of `batch_size` rows in flight at once: enough to keep continuous
    batching full, bounded so that rows do not pile up in one replica. On CUDA a replica takes as many
    GPUs as its `tp_size` setting; on CPU, `cpus_per_replica` CPUs, and a preprocessing worker
    `preprocess_cpus` (Ray's reading and writing tasks need a CPU left beside them, or the job waits
    for one forever). A replica that dies is restarted by Ray and its batches are run again."""
    settings = dict(settings or {})
    gpus = settings.get("tp_size", 1) if torch.cuda.is_available() else 0
    processed = rows.map_batches(
        Preprocess,
        fn_constructor_kwargs={"model": model, "prompt": prompt, "sampling": sampling or {}},
        batch_format="pandas",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=preprocess_workers),
        num_cpus=preprocess_cpus,
    )
    return processed.map_batches(
        Generate,
        fn_constructor_kwargs={"model": model, **settings},
        batch_format="pandas",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=replicas),
        num_cpus=cpus_per_replica,
        num_gpus=gpus,
        max_concurrency=pending_batches,
        max_restarts=-1,  # (a replica that dies is started again, and its batches run again)
        max_task_retries=-1,
    )


SINKS = {".jsonl": "JSON lines", ".json": "JSON lines", ".parquet": "Parquet", ".tar": "WebDataset shards"}


def write_answers(
    rows: ray.data.Dataset, output: str | Path, *, resume: bool = False, overwrite: bool = False, **options: Any
) -> None:
    """Answers `rows` (`answer_rows`'s `options`) into `output`, a folder of files in the format its
    extension names (`SINKS`; a WebDataset shard holds each row as `<id>.json`); `rows` must be read from
    files (`ray.data.read_json`, `read_parquet`, ...), as Ray checkpoints only reads. An existing output is
    refused unless the job resumes from it or `overwrite` starts it again. Every written block is
    recorded by id in `<output>.checkpoint` (Ray's checkpointing; on a cluster both must be on storage
    every node reaches): with `resume`, rows already written are not read again, so a job stopped midway
    goes on with no id written twice and none lost."""
    output = Path(output)
    if output.suffix not in SINKS:
        raise ValueError(f"the output must end in one of {', '.join(SINKS)} (its format), not {output.name!r}")
    checkpoint = output.with_name(output.name + ".checkpoint")
    if output.exists() and not resume:
        if not overwrite:
            raise FileExistsError(f"{output} exists: --resume goes on from it, --overwrite starts again")
        shutil.rmtree(output)
        shutil.rmtree(checkpoint, ignore_errors=True)
    if not rows.input_files():  # (Ray would write without a checkpoint, and a resume would redo every row)
        raise ValueError(
            "the rows must be read from files (ray.data.read_json, read_parquet, ...): Ray's checkpointing, "
            "which resuming relies on, filters only what a job reads"
        )
    answers = answer_rows(rows, **options)
    answers.context.checkpoint_config = CheckpointConfig(  # (this job's own: Ray's global context is left alone)
        id_column="id", checkpoint_path=str(checkpoint.resolve()), delete_checkpoint_on_success=False
    )
    _write(answers, output)


def _write(answers: ray.data.Dataset, output: Path) -> None:
    if output.suffix == ".parquet":
        answers.write_parquet(str(output))
    elif output.suffix == ".tar":
        answers.map(lambda row: {"__key__": str(row["id"]), "id": row["id"], "json": row}).write_webdataset(str(output))
    else:
        answers.write_json(str(output))
