"""The two stages of a batch job, as Ray Data callable classes (each actor builds one and calls it on
batches of rows; nothing here imports Ray).

Rows in: an `id`; an `image` or a `video` (a path, URL or bytes, or a Hugging Face datasets struct of
`bytes` and `path`) or whole chat `messages` (a list, or its JSON); optionally a `prompt` (the question
about the image or video) and `sampling` (OpenAI-named settings such as `max_tokens`, `temperature`,
`seed`: a dict, or its JSON). Rows out (`OUTPUT_COLUMNS`): the `id`, the `answer`, its token counts, the
time of each stage, and an `error`, None when it worked. A row that fails gets its error and the job goes
on.

`Preprocess` runs on CPUs of its own (fetch, decode, resize, patchify, hash), so that engines never
wait on image decoding; its rows carry the processed prompt, pickled. `Generate` holds an in-process
`Engine` driven by its own thread (`EngineThread`): its `__call__` is a coroutine, so an actor given
several batches at once (Ray's `max_concurrent_calls_per_actor`) keeps all their rows in flight together, and the
scheduler's continuous batching stays full between batches.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import time
from typing import Any

import pandas as pd
import pyarrow as pa
import torch

from vlm_serve.engine import Engine
from vlm_serve.engine_thread import EngineThread
from vlm_serve.errors import ApiError, MediaError
from vlm_serve.model_source import resolve_model
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.tokenizer import Tokenizer

DEFAULT_PROMPT = "Describe this image in one sentence."
# the columns out beside `id` (whose type is the rows'), typed: a batch whose rows all lack a value would
# otherwise write a column of nulls, and Parquet files of one output would not read back as one table
OUTPUT_TYPES = {
    "answer": pa.string(), "finish_reason": pa.string(), "prompt_tokens": pa.int64(), "media_tokens": pa.int64(),
    "completion_tokens": pa.int64(), "preprocess_s": pa.float64(), "generate_s": pa.float64(), "error": pa.string(),
}  # fmt: skip
OUTPUT_COLUMNS = ["id", *OUTPUT_TYPES]


def conversation(row: dict[str, Any], prompt: str = DEFAULT_PROMPT) -> list[dict]:
    """The chat messages a row asks: its own `messages`, or its image or video with its prompt."""
    if _given(row.get("messages")):
        messages = row["messages"]
        return json.loads(messages) if isinstance(messages, str) else list(messages)
    kinds = [kind for kind in ("image", "video") if _given(row.get(kind))]
    if len(kinds) != 1:
        raise ValueError("a row needs one of image, video or messages")
    kind, media = kinds[0], row[kinds[0]]
    if isinstance(media, dict):  # a Hugging Face datasets Image or Video in Parquet: its bytes, else its path
        media = media.get("bytes") or media.get("path")
    text = row["prompt"] if _given(row.get("prompt")) else prompt
    return [{"role": "user", "content": [{"type": kind, kind: media}, {"type": "text", "text": text}]}]


def sampling_of(row: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The job's sampling settings, with the row's own over them."""
    own = row.get("sampling")
    if not _given(own):
        return dict(defaults)
    return {**defaults, **(json.loads(own) if isinstance(own, str) else dict(own))}


def _given(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)  # (pandas' NaN: no value)


class Preprocess:
    """Rows to processed prompts: `id`, `processed` (a pickled `ProcessedInput`), `sampling` (JSON),
    `preprocess_s` and `error`."""

    def __init__(self, model: str | None, prompt: str = DEFAULT_PROMPT, sampling: dict | None = None, **media: Any):
        folder = resolve_model(model, weights=False)  # (None: the built-in model)
        self.processor = MultimodalProcessor.from_pretrained(folder, Tokenizer.from_pretrained(folder), **media)
        self.prompt, self.sampling = prompt, sampling or {}

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        out = []
        for row in batch.to_dict("records"):
            start, processed, error = time.perf_counter(), None, None
            try:
                sampling = sampling_of(row, self.sampling)
                x = self.processor.process_messages(conversation(row, self.prompt), add_generation_prompt=True)
                processed = pickle.dumps(x)
            except (MediaError, ValueError, OSError, TypeError) as exc:
                sampling, error = {}, str(exc)
            out.append(
                {
                    "id": row["id"],
                    "processed": processed,
                    "sampling": json.dumps(sampling),
                    "preprocess_s": round(time.perf_counter() - start, 4),
                    "error": error,
                }
            )
        return pd.DataFrame(out)


class Generate:
    """Processed prompts to answers (`OUTPUT_COLUMNS`), on one in-process engine made with `settings`,
    running `threads` CPU threads (default: every core this process may use, as an engine alone does;
    Ray would leave it one thread per CPU it reserved)."""

    def __init__(self, model: str | None, threads: int | None = None, **settings: Any) -> None:
        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
        self.engine = Engine(model, **settings)
        self.thread = EngineThread(self.engine)

    async def __call__(self, batch: pd.DataFrame) -> pa.Table:
        out = await asyncio.gather(*(self.answer(row) for row in batch.to_dict("records")))
        columns = {"id": pa.array([row["id"] for row in out])}
        columns |= {name: pa.array([row[name] for row in out], kind) for name, kind in OUTPUT_TYPES.items()}
        return pa.table(columns)

    async def answer(self, row: dict[str, Any]) -> dict[str, Any]:
        out = {column: None for column in OUTPUT_COLUMNS}
        out.update(id=row["id"], preprocess_s=row["preprocess_s"], error=row["error"])
        if row["error"] is not None:
            return out
        x = pickle.loads(row["processed"])
        out["media_tokens"] = sum(end - start for item in x.mm_items for start, end in item.spans)
        start = time.perf_counter()
        try:
            result = await asyncio.wrap_future(self.thread.submit(x, **json.loads(row["sampling"])))
        except (ApiError, ValueError) as exc:  # refused (too long for the context, bad sampling), or not encoded
            out["error"] = str(exc)
            return out
        out.update(
            answer=result.text,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=len(result.token_ids),
            generate_s=round(time.perf_counter() - start, 4),
        )
        return out

    def __del__(self) -> None:
        thread = getattr(self, "thread", None)
        if thread is not None:
            thread.close()
            self.engine.shutdown()
