"""A batch job on Ray Data: rows (`stages.py` says what they hold) through a preprocessing stage on CPUs
and engine replicas as actors, the same code on this machine (`ray.init()`) or a cluster; the answers
written through Ray's sinks, and a job resumed by `id` through Ray's own checkpointing."""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pyarrow.json
import pyarrow.parquet
import ray.data
import torch
from ray.data.checkpoint import CheckpointConfig

from vlm_serve.batch.stages import DEFAULT_PROMPT, Generate, Preprocess

IO_CPUS = 0.25  # a task reading or writing rows: light beside the stages
FILTER_CPUS = 1  # Ray's checkpoint filter, an actor of its own in a resumed job (Ray asks 1 CPU for it)


def stage_cpus(cluster_cpus: float, actors: int) -> float:
    """The CPUs each of `actors` stage actors asks for (at most 1) so that together they leave room for
    a read task, Ray's checkpoint filter and a write task: the stages' actors hold their CPUs for the
    whole job, and a job whose reads or writes find no CPU left waits forever."""
    spare = cluster_cpus - FILTER_CPUS - 2 * IO_CPUS
    if spare < 0.05 * actors:
        raise ValueError(
            f"the Ray cluster has {cluster_cpus:g} CPUs: {actors} stage actors need more than "
            f"{FILTER_CPUS + 2 * IO_CPUS:g} CPUs beside them for reading, resuming and writing"
        )
    return min(1.0, spare / actors)


def answer_rows(
    rows: ray.data.Dataset,
    model: str | None = None,
    *,
    replicas: int = 1,
    prompt: str = DEFAULT_PROMPT,
    sampling: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    batch_size: int = 16,
    pending_batches: int = 4,
    preprocess_workers: int = 1,
    preprocess_cpus: float | None = None,
    cpus_per_replica: float | None = None,
    threads_per_replica: int | None = None,
) -> ray.data.Dataset:
    """The answers to `rows`, a row each (`stages.OUTPUT_COLUMNS`). Each of the `replicas` engines holds
    up to `pending_batches` batches of `batch_size` rows in flight at once: enough to keep continuous
    batching full, bounded so that rows do not pile up in one replica. On CUDA a replica takes as many
    GPUs as its `tp_size` setting. The CPUs that Ray reserves for a replica (`cpus_per_replica`) and a
    preprocessing worker (`preprocess_cpus`) default to a share of the cluster's (`stage_cpus`); on
    CPU a replica's engine runs `threads_per_replica` threads (default: every core of its machine, as
    one engine alone would). A replica that dies is restarted by Ray and its batches are run again."""
    settings = dict(settings or {})
    gpus = settings.get("tp_size", 1) if torch.cuda.is_available() else 0
    if preprocess_cpus is None or cpus_per_replica is None:
        share = stage_cpus(ray.cluster_resources().get("CPU", 0), replicas + preprocess_workers)
        preprocess_cpus = share if preprocess_cpus is None else preprocess_cpus
        cpus_per_replica = share if cpus_per_replica is None else cpus_per_replica
    media = {
        name: settings[name] for name in ("max_image_pixels",) if settings.get(name) is not None
    }  # as the engine's
    # a block per batch: each is a task of its own, so that the engines hold several at once and begin on
    # the first while the CPU stage prepares the next (a file is read as one block, a task of the whole file)
    rows = rows.repartition(target_num_rows_per_block=batch_size)
    processed = rows.map_batches(
        Preprocess,
        fn_constructor_kwargs={"model": model, "prompt": prompt, "sampling": sampling or {}, **media},
        batch_format="pandas",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=preprocess_workers),
        num_cpus=preprocess_cpus,
    )
    return processed.map_batches(
        Generate,
        fn_constructor_kwargs={"model": model, "threads": threads_per_replica, **settings},
        batch_format="pandas",
        batch_size=batch_size,
        # (Ray starts a replica that dies again, and runs its batches again: its actors' default)
        compute=ray.data.ActorPoolStrategy(
            size=replicas, max_concurrent_calls_per_actor=pending_batches, max_tasks_in_flight_per_actor=pending_batches
        ),
        num_cpus=cpus_per_replica,
        num_gpus=gpus,
    )


SINKS = {".jsonl": "JSON lines", ".json": "JSON lines", ".parquet": "Parquet", ".tar": "WebDataset shards"}


def check_output(output: str | Path, resume: bool = False, overwrite: bool = False) -> Path:
    """`output` if a job may write into it (see `write_answers`), else the error saying why not."""
    output = Path(output)
    if output.suffix not in SINKS:
        raise ValueError(f"the output must end in one of {', '.join(SINKS)} (its format), not {output.name!r}")
    if output.is_file():
        raise FileExistsError(f"{output} is a file, not the folder of files a Ray job writes")
    if output.exists() and not (resume or overwrite):
        raise FileExistsError(f"{output} exists: --resume goes on from it, --overwrite starts again")
    return output


def write_answers(
    rows: ray.data.Dataset, output: str | Path, *, resume: bool = False, overwrite: bool = False, **options: Any
) -> None:
    """Answers `rows` (`answer_rows`'s `options`) into `output`, a folder of files in the format its
    extension names (`SINKS`; a WebDataset shard holds each row as `<key>.json`, `shard_key`); `rows` must be read from
    files (`ray.data.read_json`, `read_parquet`, ...), as Ray checkpoints only reads. An existing output is
    refused unless the job resumes from it or `overwrite` starts it again. Every written block is
    recorded by id in `<output>.checkpoint` (Ray's checkpointing; on a cluster both must be on storage
    every node reaches): with `resume`, rows already written are not read again, so a job stopped midway
    goes on with no id written twice and none lost."""
    output = check_output(output, resume, overwrite)
    checkpoint = output.with_name(output.name + ".checkpoint")
    if output.exists() and not resume:
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
    light = {"ray_remote_args": {"num_cpus": IO_CPUS}}
    if output.suffix == ".parquet":
        answers.write_parquet(str(output), **light)
    elif output.suffix == ".tar":
        shards = answers.map(
            lambda row: {"__key__": shard_key(row["id"]), "id": row["id"], "json": row}, num_cpus=IO_CPUS
        )
        shards.write_webdataset(str(output), **light)
    else:
        answers.write_json(str(output), **light)


def shard_key(row_id: Any) -> str:
    """A row's key in a WebDataset shard: its id's digest, as a key may hold no dot or slash (WebDataset
    splits a member's name at the first dot of its base name; ids are often paths)."""
    return hashlib.sha256(str(row_id).encode()).hexdigest()[:32]


def count_answers(output: str | Path) -> tuple[int, int]:
    """The rows a job wrote into `output` (any of `SINKS`) and how many of them hold an error, read
    from its files here: a Ray job to count them would take longer than reading them."""
    errors = [error for file in sorted(Path(output).iterdir()) if file.is_file() for error in _errors(file)]
    return len(errors), sum(error is not None for error in errors)


def _errors(file: Path) -> list[str | None]:
    """The `error` of each row in one file a job wrote."""
    if file.suffix == ".tar":
        with tarfile.open(file) as shard:
            return [json.load(shard.extractfile(member))["error"] for member in shard if member.name.endswith(".json")]
    if file.suffix == ".parquet":
        return pyarrow.parquet.read_table(file, columns=["error"]).column("error").to_pylist()
    return pyarrow.json.read_json(file).column("error").to_pylist()
