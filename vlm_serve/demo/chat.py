"""What the chat page talks to (`ChatBackend`): the in-process engine on a thread of its own (`LocalChat`),
or a running server through its OpenAI API (`RemoteChat`); an answer streams as text, a thinking model's
reasoning (`Thought`) and at its end what it cost (`AnswerUsage`)."""

from __future__ import annotations

import base64
import json
import mimetypes
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vlm_serve.checkpoint import single_turn_only
from vlm_serve.config import MediaLimitSettings

if TYPE_CHECKING:
    import httpx

    from vlm_serve.engine import Engine
    from vlm_serve.engine_thread import EngineThread

STAGES = {"fetch": "fetch", "decode": "decode", "preprocess": "preprocess", "vit": "vision tower"}
SOURCES = {"cache": "embeddings from the cache", "prefix": "KV from the prefix cache"}  # (else the tower ran)


@dataclass
class AnswerUsage:
    """What an answer cost, as its backend reports it: shown under the answer with the page's own timings."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    media: list[tuple[str, int]] = field(default_factory=list)  # (image | video, its tokens), in prompt order
    # per media item, where known (the in-process engine): seconds by stage, and where its embeddings came from
    stages: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, first_token: float, seconds: float) -> str:
        """One line: tokens, cache, time to first token and decode speed (`seconds`: to the last token)."""
        counts = {kind: [n for k, n in self.media if k == kind] for kind in ("image", "video")}
        media = [
            f"{len(ns)} {'picture' if kind == 'image' else 'video'}{'s' * (len(ns) > 1)} ({sum(ns)} tokens)"
            for kind, ns in counts.items()
            if ns
        ]
        rate = (self.completion_tokens - 1) / (seconds - first_token) if seconds > first_token else 0.0
        return " · ".join(
            [
                f"{self.prompt_tokens} prompt tokens ({self.cached_tokens} cached)",
                *media,
                f"{self.completion_tokens} generated",
                f"first token {first_token:.2f} s",
                f"{rate:.1f} tokens/s",
            ]
        )

    def details(self) -> str:
        """A line per picture and video: its tokens and where its time went."""
        lines = []
        for i, (kind, tokens) in enumerate(self.media):
            line = f"{'picture' if kind == 'image' else 'video'} {i + 1}: {tokens} tokens"
            if i < len(self.stages):
                stages = self.stages[i]
                notes = [f"{name} {1000 * stages[key]:.0f} ms" for key, name in STAGES.items() if stages[key] >= 5e-4]
                if stages["source"] in SOURCES:
                    notes.append(SOURCES[stages["source"]])
                line += "; " + ", ".join(notes)
            lines.append(line)
        return "\n".join(lines) or "no pictures or videos"


@dataclass
class Thought:
    """A piece of a thinking model's reasoning (what it writes before `</think>`)."""

    text: str


class ChatBackend(Protocol):
    """What answers the page: `stream` yields an answer's text piece by piece (`str`; a thinking model's
    reasoning as `Thought`s), then its `AnswerUsage` (closing it early stops the answer)."""

    model_name: str
    default_sampling: dict[str, Any]  # the checkpoint's generation defaults, OpenAI-named (may be empty)
    single_turn: bool  # the model knows single questions only (`latest_question`)
    max_media_mb: int  # the largest picture or video file it takes (the server's --max-media-mb)

    def stream(self, messages: list[dict], **sampling: Any) -> Iterator[str | Thought | AnswerUsage]: ...

    def close(self) -> None: ...


class LocalChat:
    """The in-process engine, stepped by a thread of its own (`EngineThread`): every session's answers are
    generated together by its scheduler. Prompts are preprocessed on the caller's (Gradio's) thread. With
    `reasoning_parser` (`--reasoning-parser`), a thinking model's reasoning comes apart from its answer;
    uploads are bounded by `max_media_mb` (`--max-media-mb`: the limit a server of this engine would set)."""

    def __init__(
        self, engine: Engine, reasoning_parser: str | None = None, max_media_mb: int = MediaLimitSettings.max_media_mb
    ) -> None:
        from vlm_serve.engine_thread import EngineThread

        self.engine = engine
        self.reasoning_parser = reasoning_parser
        self.thread: EngineThread = EngineThread(engine)
        self.model_name, self.default_sampling = engine.model_name, engine.default_sampling
        self.single_turn = single_turn_only(Path(engine.server_args.model))
        self.max_media_mb = max_media_mb

    def stream(self, messages: list[dict], **sampling: Any) -> Iterator[str | Thought | AnswerUsage]:
        from vlm_serve.server.reasoning_parser import REASONING_PARSERS

        x = self.engine.processor.process_messages(messages, add_generation_prompt=True)
        merge = self.engine.model_config.vision.spatial_merge_size
        parser = REASONING_PARSERS[self.reasoning_parser]() if self.reasoning_parser else None
        for chunk in self.thread.stream(x, **sampling):
            pieces = [("", chunk.text)] if parser is None else [parser.feed(chunk.text)]
            if parser is not None and chunk.output is not None:
                pieces.append(parser.finish())
            for reasoning, content in pieces:
                if reasoning:
                    yield Thought(reasoning)
                if content:
                    yield content
            if (out := chunk.output) is not None:
                stages = [
                    {key: getattr(t, key) for key in STAGES} | {"source": t.embedding_source} for t in out.media_timings
                ]
                media = [(item.modality, item.num_tokens(merge)) for item in x.mm_items]
                yield AnswerUsage(out.prompt_tokens, len(out.token_ids), out.cached_tokens, media, stages)

    def close(self) -> None:
        """Stops the thread once what is in flight is done (the engine stays the caller's)."""
        self.thread.close()


class RemoteChat:
    """A running `vlm-serve serve`, or a router over many, through its OpenAI API at `api_base` (with
    `api_key` where the server asks one): pictures and videos go as data URLs."""

    def __init__(self, api_base: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client: httpx.Client = httpx.Client(base_url=api_base.rstrip("/"), headers=headers, timeout=timeout)
        try:
            models = self._get("/v1/models")["data"]
            info = self._get("/model_info")
        except httpx.HTTPError as exc:
            self.client.close()
            status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
            if status == 401:
                raise ValueError(f"the server at {api_base} refuses the API key (give it with --api-key)") from None
            raise ValueError(f"no vlm-serve server answers at {api_base}: {exc}") from None
        self.model_name = models[0]["id"]
        self.default_sampling: dict[str, Any] = {}
        self.single_turn = bool(info.get("single_turn"))
        self.max_media_mb = int(info.get("max_media_mb", MediaLimitSettings.max_media_mb))  # (unsaid: the default)

    def _get(self, path: str) -> dict:
        response = self.client.get(path)
        response.raise_for_status()
        return response.json()

    def stream(self, messages: list[dict], **sampling: Any) -> Iterator[str | Thought | AnswerUsage]:
        body = {"model": self.model_name, "messages": [_inline_media(m) for m in messages], "stream": True}
        body["stream_options"] = {"include_usage": True}
        body |= {k: v for k, v in sampling.items() if v is not None}
        with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                error = _error_message(response)
                raise (ValueError if response.status_code < 500 else RuntimeError)(error)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", str(event["error"])))
                for choice in event.get("choices", []):
                    if choice["delta"].get("reasoning_content"):  # (a server with --reasoning-parser)
                        yield Thought(choice["delta"]["reasoning_content"])
                    if choice["delta"].get("content"):
                        yield choice["delta"]["content"]
                if usage := event.get("usage"):
                    details = usage.get("prompt_tokens_details") or {}
                    media = [(m["type"], m["tokens"]) for m in details.get("media", [])]
                    tokens = usage["prompt_tokens"], usage["completion_tokens"], details.get("cached_tokens", 0)
                    yield AnswerUsage(*tokens, media)

    def close(self) -> None:
        self.client.close()


def _inline_media(message: dict) -> dict:
    """An OpenAI message with its local image and video files as data URLs (what a remote server reads)."""
    if isinstance(message["content"], str):
        return message
    parts = []
    for part in message["content"]:
        kind = part["type"]
        if kind in ("image", "video"):
            path = Path(part[kind])
            mime = mimetypes.guess_type(path.name)[0] or f"{kind}/*"
            url = f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"
            settings = {k: v for k, v in part.items() if k not in ("type", kind)}  # (max_pixels, fps, ...)
            part = {"type": f"{kind}_url", f"{kind}_url": {"url": url}, **settings}
        parts.append(part)
    return {"role": message["role"], "content": parts}


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"
