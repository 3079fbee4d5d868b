"""A batch job on Ray Data: rows (`stages.py` says what they hold) through a preprocessing stage on CPUs
and engine replicas as actors, the same code on this machine (`ray.init()`) or a cluster."""

from __future__ import annotations

from typing import Any

import ray.data
import torch

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
    cpus_per_replica: float = 1,
) -> ray.data.Dataset:
    """The answers to `rows`, a row each (`stages.OUTPUT_COLUMNS`). Each of the `replicas` engines holds
    up to `pending_batches` batches of `batch_size` rows in flight at once: enough to keep continuous
    batching full, bounded so that rows do not pile up in one replica. On CUDA a replica takes as many
    GPUs as its `tp_size` setting; on CPU, `cpus_per_replica` CPUs. A replica that dies is restarted by
    Ray and its batches are run again."""
    settings = dict(settings or {})
    gpus = settings.get("tp_size", 1) if torch.cuda.is_available() else 0
    processed = rows.map_batches(
        Preprocess,
        fn_constructor_kwargs={"model": model, "prompt": prompt, "sampling": sampling or {}},
        batch_format="pandas",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=preprocess_workers),
        num_cpus=1,
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
