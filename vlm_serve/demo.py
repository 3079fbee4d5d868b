"""A Gradio chat page for the in-process `Engine`: images and short videos, streamed answers.

`run_demo(Engine(model))` serves it; `build_demo(engine)` returns the `gr.Blocks` without launching.
The engine is single-threaded, so generation runs one conversation at a time: other users queue.
A model trained on single questions only (the built-in one) is sent each question alone (`latest_question`).
Gradio is imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import html
import json
import logging
import mimetypes
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gradio as gr

    from vlm_serve.engine import Engine, StreamChunk

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
_ENGINE = "engine"  # the concurrency group of every event that drives the engine
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
    turn shown as several bubbles is one message. Assistant turns keep their text only.
    """
    turns = [(m["role"], _parts(m["content"])) for m in history]
    if message is not None:
        turns.append(("user", _parts(user_turn(message)["content"])))
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


def user_turn(message: Mapping[str, Any]) -> dict:
    """A `MultimodalTextbox` value as one user message of the Chatbot: its files, then its text."""
    content: list[dict] = [{"path": _file_path(f)} for f in message.get("files") or []]
    if message.get("text"):
        content.append({"type": "text", "text": message["text"]})
    return {"role": "user", "content": content}


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


def single_turn_only(model_dir: Path) -> bool:
    """Whether the checkpoint at `model_dir` was trained on single questions only (`"single_turn": true` in
    its training.json, as the built-in model's): shown a whole conversation, such a model answers about
    every picture in it, or its first question again."""
    record = model_dir / "training.json"
    return record.is_file() and json.loads(record.read_text()).get("single_turn") is True


def _media(content: list[dict]) -> list[dict]:
    return [p for p in content if p["type"] != "text"]


def _parts(content: Any) -> list[dict]:
    """One chat message's content (a string, a content item or a list of them) as OpenAI parts."""
    items = content if isinstance(content, list) else [content]
    parts: list[dict] = []
    for item in items:
        if isinstance(item, str):
            text = item
        elif isinstance(item, Mapping) and item.get("type") == "text":
            text = item["text"]
        elif isinstance(item, Mapping) and ("file" in item or "path" in item):
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


def _file_path(f: Any) -> str:
    return str(f["path"] if isinstance(f, Mapping) else f)


def _media_kind(path: str, mime_type: str | None = None) -> str:
    mime = mime_type or mimetypes.guess_type(path)[0] or ""
    for kind in ("image", "video"):
        if mime.startswith(kind + "/"):
            return kind
    raise ValueError(f"{Path(path).name} is neither an image nor a video")


# ---- sampling settings -------------------------------------------------------------------------------


def initial_settings(engine: Engine, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings the page opens with: `SAMPLING_DEFAULTS`, the checkpoint's generation defaults,
    then `overrides` (OpenAI names, the keys of `SAMPLING_DEFAULTS`)."""
    unknown = set(overrides or {}) - set(SAMPLING_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown demo setting(s): {', '.join(sorted(unknown))}")
    settings = dict(SAMPLING_DEFAULTS)
    settings.update({k: v for k, v in engine.default_sampling.items() if k in settings})
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


# ---- the page ----------------------------------------------------------------------------------------


def build_demo(engine: Engine, settings: Mapping[str, Any] | None = None) -> gr.Blocks:
    """The chat page for `engine`, queued so that one answer is generated at a time. `settings` sets
    the sampling controls' initial values (see `initial_settings`)."""
    import gradio as gr

    init = initial_settings(engine, settings)
    single_turn = single_turn_only(Path(engine.server_args.model))
    stream_turn = _responder(engine, threading.Lock(), single_turn)
    with gr.Blocks(title="vlm-serve", fill_height=True, analytics_enabled=False) as demo:
        gr.Markdown(
            f"## vlm-serve: {html.escape(engine.model_name)}\n"
            "Chat with the model; attach images or short videos with the paperclip."
            + (" " + SINGLE_TURN_NOTE if single_turn else "")
        )
        chatbot = gr.Chatbot(elem_id="chatbot", label="Conversation", scale=1, height=480, buttons=["copy"])
        box = gr.MultimodalTextbox(
            elem_id="chat-input",
            file_types=["image", "video"],
            file_count="multiple",
            sources=["upload"],
            placeholder="Type a message, attach images or videos, press Enter",
            show_label=False,
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
        clear = gr.Button("Clear conversation", variant="secondary")

        sent = box.submit(_add_user_turn, [chatbot, box], [chatbot, box], queue=False)
        answer = sent.then(
            stream_turn,
            [chatbot, max_tokens, temperature, top_p, top_k, repetition, seed],
            chatbot,
            concurrency_id=_ENGINE,
            concurrency_limit=1,
        )
        answer.then(lambda: gr.MultimodalTextbox(interactive=True), None, box, queue=False)
        clear.click(_reset, None, [chatbot, box], cancels=[answer], queue=False)
        chatbot.clear(_reset, None, [chatbot, box], cancels=[answer], queue=False)  # the chat's own bin icon
    return demo.queue(default_concurrency_limit=1)


def run_demo(engine: Engine, host: str = "127.0.0.1", port: int = 7860) -> None:
    """Serves the page on http://host:port until Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, _interrupt)  # Gradio stops on KeyboardInterrupt only
    demo = build_demo(engine)
    # quiet: Gradio's own lines (which suggest public share links) are replaced by this one
    demo.launch(
        server_name=host, server_port=port, show_error=True, max_file_size="200mb", quiet=True, prevent_thread_lock=True
    )
    try:  # (not Gradio's block_thread, which prints a line of its own when stopped)
        # a Ctrl-C sent the moment this line is read lands in this try
        print(f"vlm-serve: demo of {engine.model_name} on http://{host}:{port}", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        demo.close(verbose=False)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _add_user_turn(history: list[dict], message: dict | None) -> tuple[list[dict], Any]:
    """Shows the new message in the chat at once and locks the textbox until the answer is done."""
    import gradio as gr

    if message and (message.get("text") or message.get("files")):
        history = [*history, user_turn(message)]
    return history, gr.MultimodalTextbox(value=None, interactive=False)


def _reset() -> tuple[list[dict], Any]:
    """Clears the conversation (stopping an answer under way) and unlocks the textbox."""
    import gradio as gr

    return [], gr.MultimodalTextbox(value=None, interactive=True)


def _responder(engine: Engine, lock: threading.Lock, single_turn: bool):
    """The streaming handler: answers the last user turn of the history, one chunk per yield. The model
    sees the whole conversation, or with `single_turn` its `latest_question` alone."""
    import gradio as gr

    def stream_turn(history: list[dict], *controls: Any) -> Iterator[list[dict]]:
        if not history or history[-1]["role"] != "user":
            return  # an empty message was sent: nothing to answer
        turn = len(history) - 1
        try:
            messages = to_openai_messages(history)
            if single_turn:
                messages = latest_question(messages)
            sampling = sampling_kwargs(*controls)
            answer = ""
            for chunk in _serialised(engine.stream(messages, **sampling), lock):
                answer += chunk.text
                yield [*history, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        except ValueError as exc:  # bad media (MediaError), a prompt too long, bad settings
            gr.Warning(html.escape(f"The message was not sent: {exc}"))  # Gradio renders it as HTML
            yield history[:turn]
        except Exception as exc:  # also an image the server could not encode (ServiceUnavailable, InternalError)
            logger.exception("the demo's request failed")
            yield history[:turn]
            raise gr.Error(html.escape(f"The engine failed: {exc}")) from exc

    return stream_turn


def _serialised(stream: Iterator[StreamChunk], lock: threading.Lock) -> Iterator[StreamChunk]:
    """`stream` with each step, and its closing (which aborts the request), under `lock`: Gradio may
    advance a generator from different worker threads, or close it from its event loop on cancel."""
    try:
        while True:
            with lock:
                chunk = next(stream, None)
            if chunk is None:
                return
            yield chunk
    finally:
        with lock:
            stream.close()
