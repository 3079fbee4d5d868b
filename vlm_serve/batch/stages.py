"""The two stages of a batch job, as Ray Data callable classes (each actor builds one and calls it on
batches of rows; nothing here imports Ray).

Rows in: an `id`; an `image` or a `video` (a path, URL or bytes) or whole chat `messages` (a list, or
its JSON); optionally a `prompt` (the question about the image or video) and `sampling` (OpenAI-named
settings such as `max_tokens`, `temperature`, `seed`: a dict, or its JSON). Rows out (`OUTPUT_COLUMNS`):
the `id`, the `answer`, its token counts, the time of each stage, and an `error`, None when it worked. A
row that fails gets its error and the job goes on.

`Preprocess` runs on CPUs of its own (fetch, decode, resize, patchify, hash), so that engines never
wait on image decoding; its rows carry the processed prompt, pickled. `Generate` holds an in-process
`Engine` driven by its own thread (`EngineThread`): its `__call__` is a coroutine, so an actor given
several batches at once (Ray's `max_concurrency`) keeps all their rows in flight together, and the
scheduler's continuous batching stays full between batches.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from pathlib import Path
from typing import Any

import pandas as pd

from vlm_serve.engine import Engine
from vlm_serve.engine_thread import EngineThread
from vlm_serve.errors import ApiError, MediaError
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.tokenizer import Tokenizer

DEFAULT_PROMPT = "Describe this image in one sentence."
COUNTS = ["prompt_tokens", "media_tokens", "completion_tokens"]
OUTPUT_COLUMNS = [
    "id", "answer", "finish_reason", "prompt_tokens", "media_tokens", "completion_tokens",
    "preprocess_s", "generate_s", "error",
]  # fmt: skip


def conversation(row: dict[str, Any], prompt: str = DEFAULT_PROMPT) -> list[dict]:
    """The chat messages a row asks: its own `messages`, or its image or video with its prompt."""
    if _given(row.get("messages")):
        messages = row["messages"]
        return json.loads(messages) if isinstance(messages, str) else list(messages)
    kinds = [kind for kind in ("image", "video") if _given(row.get(kind))]
    if len(kinds) != 1:
        raise ValueError("a row needs one of image, video or messages")
    text = row["prompt"] if _given(row.get("prompt")) else prompt
    return [{"role": "user", "content": [{"type": kinds[0], kinds[0]: row[kinds[0]]}, {"type": "text", "text": text}]}]


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

    def __init__(self, model: str, prompt: str = DEFAULT_PROMPT, sampling: dict | None = None, **media: Any):
        tokenizer = Tokenizer.from_pretrained(Path(model))
        self.processor = MultimodalProcessor.from_pretrained(Path(model), tokenizer, **media)
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
    """Processed prompts to answers (`OUTPUT_COLUMNS`), on one in-process engine made with `settings`."""

    def __init__(self, model: str, **settings: Any) -> None:
        self.engine = Engine(model, **settings)
        self.thread = EngineThread(self.engine)

    async def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        rows = batch.to_dict("records")
        out = pd.DataFrame(await asyncio.gather(*(self.answer(row) for row in rows)), columns=OUTPUT_COLUMNS)
        return out.astype(dict.fromkeys(COUNTS, "Int64"))  # (counts stay integers beside a failed row's None)

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
