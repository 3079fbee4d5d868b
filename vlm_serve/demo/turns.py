"""The page's conversation as OpenAI messages: Gradio's chat history (messages format) and a new
`MultimodalTextbox` value to the messages a backend is sent, videos the browser cannot play shown as copies
it can, and the "Pictures and videos" settings each turn's files were sent with (`MediaOptions`)."""

from __future__ import annotations

import hashlib
import mimetypes
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def text_of(content: Any) -> str:
    """The text of one chat message's content (a string, a content item or a list of them)."""
    return "".join(p["text"] for p in _parts(content) if p["type"] == "text")


# ---- videos the browser can play -----------------------------------------------------------------------

BROWSER_CODECS = {"h264", "vp8", "vp9", "av1"}  # what browsers play (in MP4 or WebM)
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


# ---- the settings of each turn's pictures and videos -----------------------------------------------


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
    turn = turn_start(history)
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


def turn_start(history: Sequence[Mapping[str, Any]]) -> int:
    """Where the last turn's user messages (its files, its text) start in `history`."""
    turn = len(history)
    while turn and history[turn - 1]["role"] == "user":
        turn -= 1
    return turn


def _file_count(history: Sequence[Mapping[str, Any]]) -> int:
    """How many files the user messages of `history` hold (those `to_openai_messages` sends, in order)."""
    return sum(_is_file(item) for m in history if m["role"] == "user" for item in _items(m["content"]))
