"""A Gradio chat page: images and short videos, streamed answers, for several people at once.

The page talks to a `ChatBackend`: the in-process `Engine` stepped by a thread of its own (`LocalChat`), whose
scheduler batches every session's answers together, or a running `vlm-serve serve` (or a router over many)
through its OpenAI API (`RemoteChat`). `run_demo(backend)` serves the page until stopped, `launch_demo` serves
it and returns, `build_demo(backend)` returns the `gr.Blocks` without launching. A model trained on single
questions only (the built-in one) is sent each question alone (`latest_question`). Gradio is imported on first
use, so importing this module stays cheap.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import logging
import mimetypes
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vlm_serve.checkpoint import single_turn_only
from vlm_serve.config import MediaLimitSettings

if TYPE_CHECKING:
    import gradio as gr
    import httpx

    from vlm_serve.engine import Engine
    from vlm_serve.engine_thread import EngineThread

logger = logging.getLogger(__name__)

# The settings in the page's "Sampling" accordion, OpenAI-named as `Engine.stream` takes them.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_tokens": 256,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,  # 0 on the page = no limit
    "repetition_penalty": 1.0,
    "seed": None,  # None = a random seed per answer
}
CONCURRENCY_LIMIT = 16  # conversations answered at once (Gradio's queue); more wait their turn
SINGLE_TURN_NOTE = (
    "This model knows single questions only, so each message is sent to it alone; a message without an image "
    "or video asks about the last ones sent."
)


# ---- Gradio history <-> OpenAI messages --------------------------------------------------------------


def to_openai_messages(history: Sequence[Mapping[str, Any]], message: Mapping[str, Any] | None = None) -> list[dict]:
    """The Gradio chat `history` (messages format), plus an optional new `MultimodalTextbox` value
    `{"text": ..., "files": [...]}` as the last user turn, as OpenAI-style messages for `Engine.stream`.

    Uploaded files become `{"type": "image" | "video", ...: path}` parts (by MIME type, else by file
    extension); any other file raises ValueError. Consecutive messages of one role are merged, so a
    turn shown as several bubbles is one message. Assistant turns keep their text only; the page's notes
    (messages with a title) are left out.
    """
    # (notes the page shows, an answer's usage or its thinking, are not part of the conversation)
    turns = [(m["role"], _parts(m["content"])) for m in history if not (m.get("metadata") or {}).get("title")]
    if message is not None:
        turns += [("user", _parts(m["content"])) for m in user_turns(message)]
    messages: list[dict] = []
    for role, parts in turns:
        if role == "assistant":
            parts = [p for p in parts if p["type"] == "text"]
        if not parts:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(parts)
        else:
            messages.append({"role": role, "content": parts})
    for m in messages:
        if m["role"] != "user":  # plain strings, as chat templates expect for system / assistant turns
            m["content"] = "".join(p["text"] for p in m["content"])
    return messages


def user_turns(message: Mapping[str, Any]) -> list[dict]:
    """A `MultimodalTextbox` value as the Chatbot's user messages of one turn: a message per file (a video
    the browser cannot play as a copy it can, `playable`), then one of its text (which the page can edit:
    Gradio edits a message of text alone)."""
    turns = [{"role": "user", "content": [{"path": playable(_file_path(f))}]} for f in message.get("files") or []]
    if message.get("text"):
        turns.append({"role": "user", "content": [{"type": "text", "text": message["text"]}]})
    return turns


def latest_question(messages: list[dict]) -> list[dict]:
    """What a model that knows single questions only is sent of a conversation (OpenAI messages): its last
    user message alone, after the images and videos of the latest user message that had any if it has none
    (a follow-up question about the same picture)."""
    contents = [m["content"] for m in messages if m["role"] == "user"]
    if not contents:
        return []
    last = contents[-1]
    if not _media(last):
        last = next((_media(c) for c in reversed(contents) if _media(c)), []) + last
    return [{"role": "user", "content": last}]


def _media(content: list[dict]) -> list[dict]:
    return [p for p in content if p["type"] != "text"]


def _parts(content: Any) -> list[dict]:
    """One chat message's content (a string, a content item or a list of them) as OpenAI parts."""
    parts: list[dict] = []
    for item in _items(content):
        if isinstance(item, str):
            text = item
        elif isinstance(item, Mapping) and item.get("type") == "text":
            text = item["text"]
        elif _is_file(item):
            info = item.get("file") or item
            path = _file_path(info)
            kind = _media_kind(path, info.get("mime_type"))
            parts.append({"type": kind, kind: path})
            continue
        else:  # components embedded in the chat (plots, HTML, ...) are not shown to the model
            continue
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def _items(content: Any) -> list:
    return content if isinstance(content, list) else [content]


def _is_file(item: Any) -> bool:
    return isinstance(item, Mapping) and ("file" in item or "path" in item)


def _file_path(f: Any) -> str:
    return shown_file(str(f["path"] if isinstance(f, Mapping) else f))


# ---- videos the browser can play -----------------------------------------------------------------------

BROWSER_CODECS = {"h264", "vp8", "vp9", "av1"}  # what browsers play (in MP4 or WebM)
EXAMPLES_FOLDER = "vlm-serve-examples"  # under the temp folder: the same files for every demo, drawn once
SHOWN_PREFIX = "playable-"  # a display copy's name: the prefix, the key of the file it shows, ".mp4"
_shown: dict[str, str] = {}  # display copy key -> the file it shows (what the model is sent)
_shown_lock = threading.Lock()


def playable(path: str) -> str:
    """`path`, or for a video the browser cannot play (the MPEG-4 Part 2 most cameras and tools write, ...)
    an H.264 copy of it to show in the conversation; the model is still sent the file itself (`shown_file`).
    A file that is no video PyAV reads is left as it is (the processor says what is wrong with it)."""
    import av

    if _media_kind_or_none(path) != "video":
        return path
    try:
        with av.open(path) as source:
            stream = source.streams.video[0]
            if stream.codec_context.name in BROWSER_CODECS:
                return path
            key = hashlib.blake2b(Path(path).read_bytes(), digest_size=8).hexdigest()
            copy = Path(tempfile.gettempdir()) / "vlm-serve-playable" / f"{SHOWN_PREFIX}{key}.mp4"
            if not copy.exists():
                _transcode(source, stream, copy)
    except (av.FFmpegError, IndexError, OSError):
        return path
    with _shown_lock:
        _shown[key] = path
    return str(copy)


def _transcode(source, stream, target: Path) -> None:
    """The video `stream` of `source` as H.264 at `target`, written whole or not at all."""
    from vlm_serve.multimodal.video import write_video

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part.mp4")
    frames = [frame.to_image() for frame in source.decode(stream)]
    write_video(partial, frames, stream.average_rate or 2, codec="libx264")
    partial.replace(target)


def shown_file(path: str) -> str:
    """The file a conversation's `path` shows: a display copy's original, else `path` itself."""
    name = Path(path).name
    if name.startswith(SHOWN_PREFIX) and name.endswith(".mp4"):
        with _shown_lock:
            return _shown.get(name[len(SHOWN_PREFIX) : -len(".mp4")], path)
    return path


def _media_kind_or_none(path: str) -> str | None:
    try:
        return _media_kind(path)
    except ValueError:
        return None


def _media_kind(path: str, mime_type: str | None = None) -> str:
    mime = mime_type or mimetypes.guess_type(path)[0] or ""
    for kind in ("image", "video"):
        if mime.startswith(kind + "/"):
            return kind
    raise ValueError(f"{Path(path).name} is neither an image nor a video")


# ---- what the page talks to ---------------------------------------------------------------------------

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


# ---- sampling settings -------------------------------------------------------------------------------


def initial_settings(backend: ChatBackend, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings the page opens with: `SAMPLING_DEFAULTS`, the checkpoint's generation defaults,
    then `overrides` (OpenAI names, the keys of `SAMPLING_DEFAULTS`)."""
    unknown = set(overrides or {}) - set(SAMPLING_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown demo setting(s): {', '.join(sorted(unknown))}")
    settings = dict(SAMPLING_DEFAULTS)
    settings.update({k: v for k, v in backend.default_sampling.items() if k in settings})
    settings.update(overrides or {})
    if settings["top_k"] is None or settings["top_k"] < 0:
        settings["top_k"] = 0
    return settings


def sampling_kwargs(
    max_tokens: float, temperature: float, top_p: float, top_k: float, repetition_penalty: float, seed: float | None
) -> dict[str, Any]:
    """The page's slider values as `Engine.stream` keywords (sliders give floats; top_k 0 = no limit)."""
    return {
        "max_tokens": int(max_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k) if top_k and top_k > 0 else -1,
        "repetition_penalty": float(repetition_penalty),
        "seed": None if seed is None else int(seed),
    }


@dataclass(frozen=True)
class MediaOptions:
    """The page's "Pictures and videos" settings a file was sent with (None: the model's default):
    `max_pixels` per picture, a video's sampling `fps` and `max_frames`."""

    max_pixels: int | None = None
    fps: float | None = None
    max_frames: int | None = None

    @classmethod
    def of_page(cls, max_pixels: float | None, fps: float | None, max_frames: float | None) -> MediaOptions:
        """The page's fields as Gradio gives them (numbers as floats; empty or 0: the default)."""
        return cls(
            int(max_pixels) if max_pixels else None,
            float(fps) if fps else None,
            int(max_frames) if max_frames else None,
        )

    def of(self, kind: str) -> dict[str, int | float]:
        """Those given that apply to a file of `kind` (image | video), as the file's content part carries them."""
        names = ("max_pixels",) if kind == "image" else ("fps", "max_frames")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def media_options_of_turns(
    history: Sequence[Mapping[str, Any]],
    sent: Sequence[MediaOptions],
    max_pixels: float | None,
    fps: float | None,
    max_frames: float | None,
) -> list[MediaOptions]:
    """The options of each file of the conversation `history`, in order: its earlier turns' files keep those
    they were sent with (`sent`: what this gave for an earlier turn), the last turn's (new, or asked again or
    edited) take the page's fields.
    (An earlier picture processed anew with other settings would be other tokens: a different conversation,
    which the prefix cache no longer matches.)"""
    turn = _turn_start(history)
    earlier = _file_count(history[:turn])
    now = MediaOptions.of_page(max_pixels, fps, max_frames)
    return [*sent[:earlier], *[now] * (_file_count(history) - earlier)]


def with_media_settings(messages: list[dict], options: Sequence[MediaOptions]) -> list[dict]:
    """`messages` with each of their images and videos given its options, in order (`options[i]` the i-th's;
    those past its end: the model's defaults)."""
    remaining = iter(options)
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            m = {**m, "content": [_with_options(p, remaining) for p in m["content"]]}
        out.append(m)
    return out


def _with_options(part: dict, remaining: Iterator[MediaOptions]) -> dict:
    if part["type"] == "text":
        return part
    return part | next(remaining, MediaOptions()).of(part["type"])


def _turn_start(history: Sequence[Mapping[str, Any]]) -> int:
    """Where the last turn's user messages (its files, its text) start in `history`."""
    turn = len(history)
    while turn and history[turn - 1]["role"] == "user":
        turn -= 1
    return turn


def _file_count(history: Sequence[Mapping[str, Any]]) -> int:
    """How many files the user messages of `history` hold (those `to_openai_messages` sends, in order)."""
    return sum(_is_file(item) for m in history if m["role"] == "user" for item in _items(m["content"]))


# ---- examples ----------------------------------------------------------------------------------------

EXAMPLE_SEED = 3  # which of the built-in model's scenes the page offers (the same on every start)


def builtin_examples(folder: Path) -> list[dict]:
    """Questions the built-in model answers well, about pictures and a clip of the kind it was trained on
    (drawn into `folder`): each a Chatbot example, `{"text", "files", "display_text"}`."""
    import random

    from vlm_serve.builtin.scenes import (
        VIDEO_FPS,
        compare_example,
        motion_example,
        random_motion,
        random_scene,
        render,
        scene_example,
    )
    from vlm_serve.multimodal.video import write_video

    rng = random.Random(EXAMPLE_SEED)
    scenes = [random_scene(rng, count) for count in (1, 2, 3, 1, 2)]
    examples = [scene_example(rng, kind, scene, render(scene)) for kind, scene in zip(("caption", "count"), scenes)]
    examples.append(scene_example(rng, "colour", scenes[3], render(scenes[3])))
    examples.append(compare_example(rng, scenes[2], scenes[4], [render(scenes[2]), render(scenes[4])]))
    examples.append(motion_example(rng, random_motion(rng)))
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, example in enumerate(examples):
        files = []
        for j, image in enumerate(example.images):
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            files.append(_write_if_changed(folder / f"example-{i}-{j}.png", buffer.getvalue()))
        if example.video is not None:
            buffer = io.BytesIO()
            write_video(buffer, example.video, VIDEO_FPS, codec="libx264")  # (H.264: browsers play it)
            files.append(_write_if_changed(folder / f"example-{i}.mp4", buffer.getvalue()))
        media = f"{len(files)} pictures" if len(files) > 1 else "a clip" if example.video else "a picture"
        out.append({"text": example.question, "files": files, "display_text": f"{example.question} ({media})"})
    return out


def _write_if_changed(path: Path, data: bytes) -> str:
    """`path` (as a string), holding `data`: written whole, so that a page reading it never sees a part, unless
    it already holds it (the examples' folder is shared by every demo on the machine)."""
    if not (path.exists() and path.read_bytes() == data):
        partial = path.with_name(f".{path.name}.{os.getpid()}.part")
        partial.write_bytes(data)
        os.replace(partial, path)
    return str(path)


# ---- the page ----------------------------------------------------------------------------------------


def build_demo(
    backend: ChatBackend, settings: Mapping[str, Any] | None = None, concurrency_limit: int = CONCURRENCY_LIMIT
) -> gr.Blocks:
    """The chat page for `backend`, answering up to `concurrency_limit` conversations at once (each browser
    session has its own). `settings` sets the sampling controls' initial values (see `initial_settings`).
    An empty conversation offers `builtin_examples` to click."""
    import gradio as gr

    init = initial_settings(backend, settings)
    examples = builtin_examples(Path(tempfile.gettempdir()) / EXAMPLES_FOLDER)
    stream_turn = _responder(backend)
    with gr.Blocks(title="vlm-serve", fill_height=True, analytics_enabled=False) as demo:
        gr.Markdown(
            f"## vlm-serve: {html.escape(backend.model_name)}\n"
            "Chat with the model; attach images or short videos (up to "
            f"{backend.max_media_mb} MB each) with the paperclip, drop them on the box or paste a picture."
            + (" " + SINGLE_TURN_NOTE if backend.single_turn else "")
        )
        chatbot = gr.Chatbot(
            elem_id="chatbot",
            label="Conversation",
            scale=1,
            height=480,
            buttons=["copy"],
            examples=examples,
            editable="user",
            group_consecutive_messages=False,  # (Gradio edits no message of a group)
        )
        box = gr.MultimodalTextbox(
            elem_id="chat-input",
            file_types=["image", "video"],
            file_count="multiple",
            sources=["upload"],  # (the paperclip, and files dropped on the box or pictures pasted in it)
            max_plain_text_length=1 << 20,  # (past it Gradio makes pasted text a .txt file, which is refused)
            placeholder="Type a message, attach images or videos, press Enter",
            show_label=False,
            stop_btn=False,
        )
        with gr.Accordion("Sampling", open=False):
            with gr.Row():
                max_tokens = gr.Slider(1, 8192, init["max_tokens"], step=1, label="Max tokens")
                temperature = gr.Slider(0, 2, init["temperature"], step=0.05, label="Temperature (0 = greedy)")
                top_p = gr.Slider(0.01, 1, init["top_p"], step=0.01, label="Top p")
            with gr.Row():
                top_k = gr.Slider(0, 200, init["top_k"], step=1, label="Top k (0 = off)")
                repetition = gr.Slider(0.5, 2, init["repetition_penalty"], step=0.01, label="Repetition penalty")
                seed = gr.Number(init["seed"], precision=0, label="Seed (empty = random)")
        with gr.Accordion("Pictures and videos", open=False):
            gr.Markdown("For the next message's pictures and videos (those sent before keep the settings they had).")
            # (empty, or the 0 Gradio makes of a field a person empties: the model's defaults, hence no `minimum`,
            # which would refuse that 0; the server's limits still hold, and the warning names a value it refuses)
            with gr.Row():
                max_pixels = gr.Number(
                    None, precision=0, label="Max pixels per picture (empty = default)", elem_id="max-pixels"
                )
                fps = gr.Number(None, label="Video frames per second (empty = default)")
                max_frames = gr.Number(None, precision=0, label="Max video frames (empty = default)")
        clear = gr.Button("Clear conversation", variant="secondary")
        sent = gr.State([])  # the options the conversation's files were sent with (`media_options_of_turns`)

        sampling = [max_tokens, temperature, top_p, top_k, repetition, seed]
        # (Gradio hands an event's data by these hints, which the module's postponed annotations leave strings)
        _example_turn.__annotations__["selected"] = gr.SelectData
        _retry_turn.__annotations__["retried"] = gr.RetryData
        _edit_turn.__annotations__["edited"] = gr.EditData
        answers = []
        for asked in (  # a message sent, an example clicked, an answer asked again, a question edited
            box.submit(_add_user_turn, [chatbot, box], [chatbot, box], queue=False),
            chatbot.example_select(_example_turn, None, [chatbot, box], queue=False),
            chatbot.retry(_retry_turn, chatbot, [chatbot, box], queue=False),
            chatbot.edit(_edit_turn, chatbot, [chatbot, box], queue=False),
        ):
            options = asked.then(
                media_options_of_turns, [chatbot, sent, max_pixels, fps, max_frames], sent, queue=False
            )
            answers.append(
                options.then(stream_turn, [chatbot, sent, *sampling], chatbot, concurrency_limit=concurrency_limit)
            )
            answers[-1].then(_unlock, None, box, queue=False)  # (also after a stop or a failure)
        box.stop(None, None, None, cancels=answers, queue=False)
        clear.click(_reset, None, [chatbot, box], cancels=answers, queue=False)
        chatbot.clear(_reset, None, [chatbot, box], cancels=answers, queue=False)  # the chat's own bin icon
    return demo.queue(default_concurrency_limit=concurrency_limit)


def launch_demo(
    backend: ChatBackend,
    host: str = "127.0.0.1",
    port: int = 7860,
    settings: Mapping[str, Any] | None = None,
    concurrency_limit: int = CONCURRENCY_LIMIT,
) -> gr.Blocks:
    """`build_demo`'s page served on http://host:port by threads of Gradio's (no public share link), taking
    uploads up to the backend's `max_media_mb` (Gradio refuses a larger file, naming the limit)."""
    demo = build_demo(backend, settings, concurrency_limit)
    demo.launch(
        server_name=host,
        server_port=port,
        show_error=True,
        max_file_size=backend.max_media_mb << 20,  # (MiB, as the server counts them)
        quiet=True,  # (Gradio's own lines suggest public share links)
        prevent_thread_lock=True,
        share=False,
    )
    return demo


def run_demo(
    backend: ChatBackend, host: str = "127.0.0.1", port: int = 7860, concurrency_limit: int = CONCURRENCY_LIMIT
) -> None:
    """Serves the page on http://host:port until Ctrl-C or SIGTERM (no public share link)."""
    signal.signal(signal.SIGTERM, _interrupt)  # Gradio stops on KeyboardInterrupt only
    demo = launch_demo(backend, host, port, concurrency_limit=concurrency_limit)
    try:  # (not Gradio's block_thread, which prints a line of its own when stopped)
        # a Ctrl-C sent the moment this line is read lands in this try
        print(f"vlm-serve: demo of {backend.model_name} on http://{host}:{port}", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        demo.close(verbose=False)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _add_user_turn(history: list[dict], message: dict | None) -> tuple[list[dict], Any]:
    """Shows the new message in the chat at once; until the answer is done the textbox takes nothing and
    shows a stop button in place of its send button."""
    if message and (message.get("text") or message.get("files")):
        history = [*history, *user_turns(message)]
    return history, _locked()


def _example_turn(selected: gr.SelectData) -> tuple[list[dict], Any]:
    """A clicked example as the conversation's first message (examples show in an empty one)."""
    return _add_user_turn([], selected.value)


def _retry_turn(history: list[dict], retried: gr.RetryData) -> tuple[list[dict], Any]:
    """The conversation up to the question asked again, its answer dropped."""
    return _add_user_turn(history[: _index(retried.index) + 1], None)


def _edit_turn(history: list[dict], edited: gr.EditData) -> tuple[list[dict], Any]:
    """The conversation up to the edited question, which now says what the person wrote (its pictures and
    videos, messages of their own before it, kept), its answer dropped."""
    i = _index(edited.index)
    text = edited.value if isinstance(edited.value, str) else _text_of(edited.value)
    return [*history[:i], *user_turns({"text": text})], _locked()


def _index(index: int | tuple[int, int]) -> int:
    return index[0] if isinstance(index, tuple | list) else index


def _text_of(content: Any) -> str:
    return "".join(p["text"] for p in _parts(content) if p["type"] == "text")


def _locked() -> Any:
    import gradio as gr

    return gr.MultimodalTextbox(value=None, interactive=False, submit_btn=False, stop_btn=True)


def _unlock() -> Any:
    import gradio as gr

    return gr.MultimodalTextbox(interactive=True, submit_btn=True, stop_btn=False)


def _reset() -> tuple[list[dict], Any]:
    """Clears the conversation (stopping an answer under way) and unlocks the textbox."""
    import gradio as gr

    return [], gr.MultimodalTextbox(value=None, interactive=True, submit_btn=True, stop_btn=False)


def _responder(backend: ChatBackend):
    """The streaming handler: answers the last user turn of the history, one chunk per yield. The model
    sees the whole conversation, or where it knows single questions only its `latest_question` alone.
    Gradio closes the generator when the answer is stopped, which stops it on the engine too."""
    import gradio as gr

    def stream_turn(history: list[dict], sent: Sequence[MediaOptions], *controls: Any) -> Iterator[list[dict]]:
        """`sent`: the options of the history's files (`media_options_of_turns`); `controls`: the sampling
        settings (`sampling_kwargs`)."""
        if not history or history[-1]["role"] != "user":
            return  # an empty message was sent: nothing to answer
        turn = _turn_start(history)
        try:
            messages = with_media_settings(to_openai_messages(history), sent)
            if backend.single_turn:
                messages = latest_question(messages)
            sampling = sampling_kwargs(*controls)
            answer, reasoning, started, first_token = "", "", time.perf_counter(), None
            for piece in backend.stream(messages, **sampling):
                if isinstance(piece, AnswerUsage):
                    seconds = time.perf_counter() - started
                    thought = [_thinking(reasoning, done=True)] if reasoning else []
                    said = [_text(answer)] if answer or not reasoning else []  # (cut short while thinking: none)
                    yield [*history, *thought, *said, _usage_note(piece, first_token or seconds, seconds)]
                    continue
                first_token = first_token or time.perf_counter() - started
                if isinstance(piece, Thought):
                    reasoning += piece.text
                else:
                    answer += piece
                thought = [_thinking(reasoning, done=bool(answer))] if reasoning else []
                yield [*history, *thought, *([_text(answer)] if answer or not reasoning else [])]
        except ValueError as exc:  # bad media (MediaError), a prompt too long, bad settings
            gr.Warning(html.escape(f"The message was not sent: {exc}"))  # Gradio renders it as HTML
            yield history[:turn]
        except Exception as exc:  # also an image the server could not encode (ServiceUnavailable, InternalError)
            logger.exception("the demo's request failed")
            yield history[:turn]
            raise gr.Error(html.escape(f"The engine failed: {exc}")) from exc

    return stream_turn


def _text(answer: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": answer}]}


def _thinking(reasoning: str, done: bool) -> dict:
    """A thinking model's reasoning above its answer: a note open while it thinks, folded once it answers."""
    metadata = {"title": "Thinking", "status": "done" if done else "pending"}
    return {"role": "assistant", "content": [{"type": "text", "text": reasoning}], "metadata": metadata}


def _usage_note(usage: AnswerUsage, first_token: float, seconds: float) -> dict:
    """The line under an answer: a collapsed note titled with its usage, its media items' stages inside."""
    title = usage.summary(first_token, seconds)
    return {
        "role": "assistant",
        "content": [{"type": "text", "text": usage.details()}],
        "metadata": {"title": title, "status": "done"},
    }
