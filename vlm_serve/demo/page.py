"""The chat page itself: its layout, the sampling settings it opens with, the handlers of its events (a
message sent, an example clicked, an answer asked again, a question edited) and the answer streamed into the
conversation; `build_demo` makes it, `launch_demo` serves it and returns, `run_demo` serves it until stopped."""

from __future__ import annotations

import html
import io
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlm_serve.demo.chat import AnswerUsage, ChatBackend, Thought
from vlm_serve.demo.turns import (
    MediaOptions,
    latest_question,
    media_options_of_turns,
    text_of,
    to_openai_messages,
    turn_start,
    user_turns,
    with_media_settings,
)

if TYPE_CHECKING:
    import gradio as gr

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


# ---- examples ----------------------------------------------------------------------------------------

EXAMPLE_SEED = 3  # which of the built-in model's scenes the page offers (the same on every start)
EXAMPLES_FOLDER = "vlm-serve-examples"  # under the temp folder: the same files for every demo, drawn once


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
    text = edited.value if isinstance(edited.value, str) else text_of(edited.value)
    return [*history[:i], *user_turns({"text": text})], _locked()


def _index(index: int | tuple[int, int]) -> int:
    return index[0] if isinstance(index, tuple | list) else index


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
        turn = turn_start(history)
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
