"""The Gradio demo: the history -> messages conversion, what a model that knows single questions only is
sent, and the page itself driven by headless Chromium (upload a picture drawn as a person draws one, off
the built-in model's grid: a pink circle up and to the right on white; ask its colour: the streamed answer
is the built-in model's, "pink"): two people asking at once are answered in one batch, a stopped answer
ends on the engine, and the page in front of a `vlm-serve serve` answers as the one on the engine. A file
larger than the server takes is refused naming the limit; pictures pasted or dropped in the box are sent;
each turn's pictures and videos keep the settings they were sent with."""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import itertools
import mimetypes
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import requires
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from PIL import Image, ImageDraw

from helpers import free_port, running_server, start_process
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.builtin.scenes import Scene, Shape, render
from vlm_serve.checkpoint import single_turn_only
from vlm_serve.config import MediaLimitSettings
from vlm_serve.demo.chat import LocalChat
from vlm_serve.demo.page import SINGLE_TURN_NOTE, build_demo, launch_demo
from vlm_serve.demo.turns import (
    MediaOptions,
    latest_question,
    media_options_of_turns,
    to_openai_messages,
    user_turns,
    with_media_settings,
)
from vlm_serve.multimodal.video import write_video
from vlm_serve.testing.media import png_stating

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PROMPT = "what colour is the circle?"
ANSWER = "The circle is pink."  # the built-in model's
BOT = "#chatbot [data-testid=bot]"  # an assistant bubble of the page
GREEDY = {"temperature": 0, "max_tokens": 12}
# the page's sampling controls (top_k 0 = off, no seed)
SAMPLING = (GREEDY["max_tokens"], GREEDY["temperature"], 1.0, 0, 1.0, None)
# what the page's handler is given: the options its files were sent with (none: the defaults), then sampling
CONTROLS = ((), *SAMPLING)


@pytest.fixture(scope="module")
def engine():
    from vlm_serve.engine import Engine

    engine = Engine(dtype="float32", vit_dp=0)  # the built-in model; vit_dp=0: no encoder processes
    yield engine
    engine.shutdown()


@pytest.fixture
def chat(engine) -> Iterator[LocalChat]:
    """The page's backend on the engine: its thread owns the engine until the test closes it (or ends)."""
    backend = LocalChat(engine)
    yield backend
    backend.close()


def answer_of(chat, conversation: list[dict]) -> str:
    return "".join(piece for piece in chat.stream(conversation, **GREEDY) if isinstance(piece, str))


def usage_line(chat, conversation: list[dict], shown: str) -> str:
    """The usage line the page should show for `conversation`, by the engine's own counts (its timings and
    cached tokens taken from the `shown` one, which vary)."""
    x = chat.engine.processor.process_messages(conversation, add_generation_prompt=True)
    output = list(chat.thread.stream(x, **GREEDY))[-1].output
    cached = re.search(r"\((\d+) cached\)", shown).group(1)
    timings = shown[shown.index(" · first token ") :]
    picture = x.mm_items[0].num_tokens(chat.engine.model_config.vision.spatial_merge_size)
    counts = f"{output.prompt_tokens} prompt tokens ({cached} cached) · 1 picture ({picture} tokens)"
    return f"{counts} · {len(output.token_ids)} generated{timings}"


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "circle.png"
    picture = Image.new("RGB", (200, 150), "white")
    ImageDraw.Draw(picture).ellipse([120, 30, 170, 80], fill="pink")
    picture.save(path)
    return path


def _conversation(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": PROMPT}]}]


@dataclass
class RecordingChat:
    """Stands in for the page's backend where only what the demo sends matters: it keeps each conversation
    it is sent and answers "ok"."""

    model_dir: Path
    model_name: str = "recording"
    default_sampling: dict = field(default_factory=dict)
    max_media_mb: int = 64
    sent: list[list[dict]] = field(default_factory=list)

    @property
    def single_turn(self) -> bool:
        return single_turn_only(self.model_dir)

    def stream(self, messages: list[dict], **sampling) -> Iterator[str]:
        self.sent.append(messages)
        yield "ok"

    def close(self) -> None:
        pass


def test_history_and_new_message_become_openai_messages():
    history = [
        {"role": "user", "content": [{"type": "file", "file": {"path": "/up/a.png", "mime_type": "image/png"}}]},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}]},  # one turn, two bubbles
        {"role": "assistant", "content": [{"type": "text", "text": " A cat"}, {"type": "text", "text": "."}]},
        {"role": "user", "content": "And this?"},  # a plain string, as Gradio 5 and hand-made histories have
        {"role": "user", "content": {"path": "/up/clip.MP4"}},  # no MIME type: from the extension
    ]
    message = {"text": "Compare them.", "files": ["/up/b.jpg"]}
    assert to_openai_messages(history, message) == [
        {
            "role": "user",
            "content": [{"type": "image", "image": "/up/a.png"}, {"type": "text", "text": "What is this?"}],
        },
        {"role": "assistant", "content": " A cat."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And this?"},
                {"type": "video", "video": "/up/clip.MP4"},
                {"type": "image", "image": "/up/b.jpg"},
                {"type": "text", "text": "Compare them."},
            ],
        },
    ]
    assert to_openai_messages([], {"text": "", "files": []}) == []
    with pytest.raises(ValueError, match="neither an image nor a video"):
        to_openai_messages([], {"text": "Read this.", "files": ["/up/notes.pdf"]})


@pytest.mark.slow
def test_handler_streams_the_answer_and_drops_a_rejected_turn(engine, chat, image, tmp_path):
    pytest.importorskip("gradio")
    from vlm_serve.demo.page import _responder

    respond = _responder(chat)
    history = user_turns({"text": PROMPT, "files": [str(image)]})
    updates = list(respond(history, *CONTROLS))
    *streamed, last = updates
    answers = [h[-1]["content"][0]["text"] for h in streamed]
    assert len(streamed) > 1 and all(h[:-1] == history and h[-1]["role"] == "assistant" for h in streamed)
    assert all(b.startswith(a) for a, b in itertools.pairwise(answers))  # each update extends the last
    assert answers[-1] == answer_of(chat, _conversation(image)) == ANSWER
    # under the answer, its usage as the engine counts it; the picture's stages inside the note
    assert last[:-1] == streamed[-1]
    title, inside = last[-1]["metadata"]["title"], last[-1]["content"][0]["text"]
    assert title == usage_line(chat, _conversation(image), title)
    assert inside.startswith("picture 1: ") and " ms" in inside
    assert to_openai_messages(last) == to_openai_messages(streamed[-1])  # (the note is not sent to the model)

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a PNG")
    history = [*updates[-1], *user_turns({"text": "And this one?", "files": [str(broken)]})]
    with pytest.warns(UserWarning, match="The message was not sent"):  # gr.Warning outside a page
        assert list(respond(history, *CONTROLS)) == [updates[-1]]  # the rejected turn is taken back
    chat.close()
    engine.scheduler.check_memory()


def test_an_oversized_picture_is_refused_with_its_size_the_limit_and_the_flag(engine, chat, tmp_path):
    pytest.importorskip("gradio")
    from vlm_serve.demo.page import _responder

    huge = tmp_path / "huge.png"
    huge.write_bytes(png_stating(20000, 20000))
    respond = _responder(chat)
    message = r"image is 20000 x 20000 = 400000000 pixels, more than the limit of 89478485 \(--max-image-pixels\)"
    with pytest.warns(UserWarning, match=message):
        assert list(respond(user_turns({"text": PROMPT, "files": [str(huge)]}), *CONTROLS)) == [[]]
    chat.close()
    engine.scheduler.check_memory()


def test_a_model_that_knows_single_questions_only_is_sent_the_latest_one_with_the_latest_pictures():
    def user(*parts: str) -> dict:
        return {
            "role": "user",
            "content": [
                {"type": "image", "image": p} if p.endswith(".png") else {"type": "text", "text": p} for p in parts
            ],
        }

    first = [user("a.png", "What colour is the circle?"), {"role": "assistant", "content": "The circle is red."}]
    assert latest_question([*first, user("b.png", "c.png", "Which image has more shapes?")]) == [
        user("b.png", "c.png", "Which image has more shapes?")
    ]
    follow_up = [*first, user("b.png", "Describe this image."), {"role": "assistant", "content": "A star."}]
    assert latest_question([*follow_up, user("How many shapes are there?")]) == [
        user("b.png", "How many shapes are there?")
    ]
    assert latest_question([user("Hello.")]) == [user("Hello.")]


def test_the_built_in_model_is_the_one_marked_as_knowing_single_questions_only(tiny_moe_dir):
    assert single_turn_only(BUILTIN_MODEL)
    assert not single_turn_only(tiny_moe_dir)


def test_a_picture_attached_in_a_later_turn_gets_an_answer_about_that_picture(chat, image, tmp_path):
    pytest.importorskip("gradio")
    from vlm_serve.demo.page import _responder

    star = tmp_path / "star.png"
    render(Scene([Shape("star", "blue", "large", 0, 2)], background_seed=4)).save(star)
    respond = _responder(chat)
    history: list[dict] = []
    for message, answer in [
        ({"text": PROMPT, "files": [str(image)]}, ANSWER),
        ({"text": "Describe this image.", "files": [str(star)]}, "A large blue star at the top right."),
        ({"text": "How many shapes are there?"}, "There is one shape."),  # about the star, the latest picture
    ]:
        history = list(respond([*history, *user_turns(message)], *CONTROLS))[-1]
        assert history[-2]["content"][0]["text"] == answer  # (then the usage note)


def test_the_examples_are_drawn_once_into_a_folder_every_demo_shares(chat, tmp_path, monkeypatch):
    """(Each page drew them into a new temporary folder, never removed: a test run left hundreds.)"""
    from vlm_serve.demo.page import builtin_examples

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    for _ in range(2):
        build_demo(chat)
    assert [f.name for f in (tmp_path / "temp").iterdir() if f.name.startswith("vlm")] == ["vlm-serve-examples"]
    first = builtin_examples(tmp_path / "examples")
    written = {f: (Path(f).read_bytes(), Path(f).stat().st_mtime_ns) for e in first for f in e["files"]}
    again = builtin_examples(tmp_path / "examples")
    assert again == first and sorted(str(f) for f in (tmp_path / "examples").iterdir()) == sorted(written)
    assert all((Path(f).read_bytes(), Path(f).stat().st_mtime_ns) == w for f, w in written.items())  # not redrawn


def test_other_models_are_sent_the_whole_conversation(tiny_moe_dir):
    pytest.importorskip("gradio")
    from vlm_serve.demo.page import _responder

    backend = RecordingChat(tiny_moe_dir)
    history = [
        *user_turns({"text": "What is this?", "files": ["/up/a.png"]}),
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        *user_turns({"text": "And this?", "files": ["/up/b.png"]}),
    ]
    list(_responder(backend)(history, *CONTROLS))
    assert backend.sent == [to_openai_messages(history)] and len(backend.sent[0]) == 3


# ---- the page in a browser ---------------------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"no headless browser: {', '.join(missing)} missing")
    if importlib.util.find_spec("gradio") is None or importlib.util.find_spec("selenium") is None:
        pytest.skip("gradio or selenium is not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # an explicit driver: no Selenium Manager
    driver.set_window_size(1100, 1100)
    try:
        yield driver
    finally:
        driver.quit()


def page_test(test):
    """A test of the page in a browser: it serves the page, takes seconds, and sees Gradio's queue warn (on
    pandas 3)."""
    for mark in (
        pytest.mark.server,
        pytest.mark.slow,
        pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting' is deprecated"),
        pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
    ):
        test = mark(test)
    return test


# dispatches a paste or drop event on the page's textbox: arguments event, text, then a file's name, type, base64
HAND_JS = """
const [event, text, name, type, base64] = arguments;
const data = new DataTransfer();
if (name) data.items.add(new File([Uint8Array.from(atob(base64), c => c.charCodeAt(0))], name, {type}));
if (text) data.setData("text/plain", text);
const init = {bubbles: true, cancelable: true};
document.querySelector("#chat-input textarea").dispatchEvent(
    event === "paste" ? new ClipboardEvent("paste", {...init, clipboardData: data})
                      : new DragEvent("drop", {...init, dataTransfer: data}));
"""


class Page:
    """The demo page in one browser tab: ask, wait for the answer, read it."""

    def __init__(self, driver, url: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        driver.switch_to.new_window("tab")
        self.handle = driver.current_window_handle
        driver.get(url)
        self.wait = WebDriverWait(driver, 60, poll_frequency=0.1)
        self.find("#chat-input textarea")

    def find(self, css: str):
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions as ec

        self.driver.switch_to.window(self.handle)
        return self.wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))

    def ask(self, text: str, *files: Path, send: bool = True) -> None:
        if files:  # (all at once: ChromeDriver adds a file sent to a file input to those it already holds)
            self.find("#chat-input input[type=file]").send_keys("\n".join(map(str, files)))
            self.until(lambda: self.attached() >= len(files))
        self.find("#chat-input textarea").send_keys(text)
        if send:
            self.send()

    def send(self) -> None:
        self.find("#chat-input button.submit-button").click()

    def attached(self) -> int:
        """How many files the textbox holds (shown as thumbnails)."""
        from selenium.webdriver.common.by import By

        return len(self.driver.find_elements(By.CSS_SELECTOR, "#chat-input .thumbnail-item"))

    def hand(self, event: str, file: Path | None = None, text: str = "") -> None:
        """Pastes (`event` "paste") or drops ("drop") in the textbox what a browser hands its page then: a
        DataTransfer holding `file`, or `text`."""
        content = (
            (file.name, mimetypes.guess_type(file)[0], base64.b64encode(file.read_bytes()).decode()) if file else ()
        )
        self.find("#chat-input textarea")
        self.driver.execute_script(HAND_JS, event, text, *content)

    def page_text(self) -> str:
        from selenium.webdriver.common.by import By

        self.driver.switch_to.window(self.handle)
        return self.driver.find_element(By.TAG_NAME, "body").text

    def answers(self) -> list[str]:
        """The answers' raw text (their aria-label: "bot's message: ..."; they render Markdown)."""
        return [label for label, title in self._bubbles() if title is None]

    def notes(self) -> list[tuple[str, str]]:
        """The notes under the answers (usage, thinking): (title, what it holds)."""
        return [(title, label) for label, title in self._bubbles() if title is not None]

    def _bubbles(self) -> list[tuple[str, str | None]]:
        from selenium.webdriver.common.by import By

        self.driver.switch_to.window(self.handle)
        bubbles = []
        for el in self.driver.find_elements(By.CSS_SELECTOR, BOT):
            label = (el.get_attribute("aria-label") or "").removeprefix("bot's message: ")
            titles = el.find_elements(By.CSS_SELECTOR, ".title")
            bubbles.append((label, titles[0].text if titles else None))
        return bubbles

    def answering(self) -> bool:
        """Whether an answer is under way (the textbox is locked until it is done)."""
        return not self.find("#chat-input textarea").is_enabled()

    def until(self, condition) -> None:
        self.driver.switch_to.window(self.handle)
        self.wait.until(lambda _: condition())


SCREENSHOTS_ENV = "VLM_SERVE_DEMO_SCREENSHOTS"  # a folder: the page tests save the docs' screenshots there


def screenshot(browser, name: str) -> None:
    """The page as it is now, as `name`.png in $VLM_SERVE_DEMO_SCREENSHOTS (docs/images/ holds them)."""
    folder = os.environ.get(SCREENSHOTS_ENV)
    if folder:
        time.sleep(0.5)  # (a note unfolds with a transition)
        browser.save_screenshot(str(Path(folder) / f"{name}.png"))


@contextlib.contextmanager
def served(backend) -> Iterator[str]:
    """The page of `backend` on a free port, as `vlm-serve demo` serves it: its URL."""
    port = free_port()
    demo = launch_demo(backend, port=port, settings=GREEDY)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def slow_down(engine, monkeypatch, seconds: float) -> None:
    """Each engine step takes `seconds` more: an answer of a few tokens lasts long enough to be seen under way."""
    step = engine.step

    def slowed() -> None:
        time.sleep(seconds)
        step()

    monkeypatch.setattr(engine, "step", slowed)


@pytest.fixture
def slow_steps(engine, monkeypatch) -> None:
    slow_down(engine, monkeypatch, 0.2)


@page_test
def test_page_streams_the_greedy_answer_to_an_uploaded_image(browser, engine, chat, image, tmp_path):
    from selenium.webdriver.common.by import By

    expected = answer_of(chat, _conversation(image))
    assert expected == ANSWER
    image_hits = engine.processor.cache.hits
    with served(chat) as url:
        page = Page(browser, url)
        page.ask(PROMPT, image)
        # The user's turn shows the image; the answer streams into a bot bubble; the textbox, locked
        # while the answer is generated, unlocks when it is done.
        page.find("#chatbot [data-testid=user] img")
        page.until(lambda: any(page.answers()) and not page.answering())
        assert page.answers() == [expected]
        assert engine.processor.cache.hits == image_hits + 1  # the uploaded bytes reached the processor
        # under it, its usage as the engine counts it (timings the page's own), the picture's stages inside
        ((title, inside),) = page.notes()
        assert title == usage_line(chat, _conversation(image), title)
        assert inside.startswith("picture 1: ")
        page.find("#chatbot [data-testid=bot] .title").click()  # (the note unfolded: the picture's stages)
        screenshot(browser, "demo-answer-and-usage")

        # A file that is no image: a warning, and the turn is taken back; the conversation goes on.
        broken = tmp_path / "broken.png"
        broken.write_bytes(b"not a PNG")
        page.ask("And this one?", broken)
        page.until(lambda: "The message was not sent" in browser.find_element(By.TAG_NAME, "body").text)
        page.until(lambda: not page.answering())
        page.until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#chatbot [data-testid=user]")) == 2)
        assert page.answers() == [expected]
    chat.close()
    engine.scheduler.check_memory()


@page_test
def test_a_file_larger_than_the_server_takes_is_refused_naming_the_limit(browser, tiny_moe_dir, tmp_path):
    noise = tmp_path / "noise.png"  # (noise does not compress: about 1.9 MB)
    Image.frombytes("RGB", (800, 800), random.Random(0).randbytes(800 * 800 * 3)).save(noise)
    assert noise.stat().st_size > 1 << 20
    with served(RecordingChat(tiny_moe_dir, max_media_mb=1)) as url:
        page = Page(browser, url)
        assert "(up to 1 MB each)" in page.page_text()
        page.find("#chat-input input[type=file]").send_keys(str(noise))
        refused = re.compile(r'exceed the maximum allowed size of 1(\.0)? MB: "noise\.png"', re.IGNORECASE)
        page.until(lambda: refused.search(page.page_text()))
        assert page.attached() == 0


@page_test
def test_pictures_pasted_and_dropped_in_the_box_are_sent_and_long_text_pasted_stays_text(
    browser, tiny_moe_dir, image, tmp_path
):
    star = tmp_path / "star.png"
    render(Scene([Shape("star", "blue", "large", 0, 2)], background_seed=4)).save(star)
    backend = RecordingChat(tiny_moe_dir)
    with served(backend) as url:
        page = Page(browser, url)
        page.hand("paste", image)
        page.until(lambda: page.attached() == 1)
        page.hand("drop", star)
        page.until(lambda: page.attached() == 2)
        page.hand("paste", text="Compare these pictures. " * 100)  # (past Gradio's 1000 characters)
        time.sleep(0.5)
        assert page.attached() == 2
        page.ask("Compare them.")
        page.until(lambda: page.answers() == ["ok"] and not page.answering())
    sent = [Path(p["image"]).read_bytes() for p in backend.sent[0][0]["content"] if p["type"] == "image"]
    assert sent == [image.read_bytes(), star.read_bytes()]


@page_test
def test_a_picture_keeps_the_settings_it_was_sent_with_when_the_pages_change(browser, tiny_moe_dir, image):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    backend = RecordingChat(tiny_moe_dir)
    with served(backend) as url:
        page = Page(browser, url)
        browser.find_element(By.XPATH, "//button[contains(., 'Pictures and videos')]").click()
        field = page.find("#max-pixels input")
        for i, (max_pixels, message) in enumerate([(50176, (PROMPT, image)), (100352, ("And now?",))]):
            field.send_keys(Keys.CONTROL, "a")
            field.send_keys(str(max_pixels), Keys.TAB)
            page.ask(*message)
            page.until(lambda i=i: page.answers() == ["ok"] * (i + 1) and not page.answering())
    (picture,) = [p for p in backend.sent[1][0]["content"] if p["type"] == "image"]  # (the first turn, sent again)
    assert picture["max_pixels"] == 50176 and Path(picture["image"]).read_bytes() == image.read_bytes()


@pytest.fixture
def both_asked_first(engine, monkeypatch) -> None:
    """The engine takes no step (for a minute at most) until two questions have reached it: two people who
    ask at once meet in one batch however slowly the browser sends the second tab's."""
    step, deadline, opened = engine.step, time.monotonic() + 60, []

    def gated() -> None:
        asked = len(engine._io.inbox) + len(engine.scheduler.reqs)
        if not opened and asked < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # (the engine's thread takes what arrived, then comes back)
            return
        opened.append(True)
        step()

    monkeypatch.setattr(engine, "step", gated)


@page_test
def test_two_people_asking_at_once_are_answered_together_in_one_batch(browser, engine, chat, image, both_asked_first):
    with served(chat) as url:
        pages = [Page(browser, url), Page(browser, url)]  # two tabs: two sessions
        for page in pages:
            page.ask(PROMPT, image, send=False)
        for page in pages:
            page.send()
        for page in pages:
            page.until(lambda page=page: page.answers() == [ANSWER] and not page.answering())
    chat.close()
    assert engine.scheduler.metrics.peak_decode_batch >= 2  # (both in one decode batch at least once)
    engine.scheduler.check_memory()


@page_test
def test_stop_ends_the_answer_early_and_the_engine_is_left_idle(browser, engine, chat, image, monkeypatch):
    slow_down(engine, monkeypatch, 1.0)  # (the answer's few tokens last seconds: the page sees it under way)
    with served(chat) as url:
        page = Page(browser, url)
        page.ask(PROMPT, image)
        page.until(lambda: any(page.answers()))
        page.find("#chat-input button.stop-button").click()
        page.until(lambda: not page.answering())
        (stopped,) = page.answers()
        assert ANSWER.startswith(stopped) and stopped != ANSWER  # (a part of the answer, then nothing more)
        page.ask(PROMPT, image)  # the conversation goes on
        page.until(lambda: page.answers()[1:] == [ANSWER] and not page.answering())
    chat.close()
    assert not engine.scheduler.reqs and engine.scheduler.is_idle()
    engine.scheduler.check_memory()


@page_test
def test_an_example_clicked_is_asked_and_answered_as_the_model_answers_it(browser, chat, tmp_path):
    from selenium.webdriver.common.by import By

    from vlm_serve.demo.page import builtin_examples

    examples = builtin_examples(tmp_path)
    assert [len(e["files"]) for e in examples] == [1, 1, 1, 2, 1] and examples[-1]["files"][0].endswith(".mp4")
    with served(chat) as url:
        page = Page(browser, url)
        page.find("#chatbot button.example")
        screenshot(browser, "demo-examples")
        for i in (0, 4):  # a picture, and the clip
            page.find("#chatbot button.example")
            browser.find_elements(By.CSS_SELECTOR, "#chatbot button.example")[i].click()
            page.until(lambda: any(page.answers()) and not page.answering())
            kinds = ["video" if f.endswith(".mp4") else "image" for f in examples[i]["files"]]
            parts = [{"type": k, k: f} for k, f in zip(kinds, examples[i]["files"])]
            conversation = [{"role": "user", "content": [*parts, {"type": "text", "text": examples[i]["text"]}]}]
            assert page.answers() == [answer_of(chat, conversation)]
            browser.find_element(By.CSS_SELECTOR, "#chatbot button[aria-label=Clear]").click()
            page.find("#chatbot button.example")  # (an empty conversation offers them again)


@page_test
def test_a_picture_and_a_clip_browsers_do_not_play_in_one_turn_are_shown_and_read_as_sent(
    browser, chat, image, tmp_path
):
    """(A clip in MPEG-4 Part 2, as the README's and many cameras' are, was a grey box in the page: it is
    shown as a copy browsers play, and the model reads the clip itself.)"""
    from vlm_serve.builtin.scenes import VIDEO_FPS, random_motion, render_motion

    clip = tmp_path / "clip.mp4"
    write_video(clip, render_motion(random_motion(random.Random(5))), VIDEO_FPS)  # (MPEG-4 Part 2)
    question = "Describe the video."
    with served(chat) as url:
        page = Page(browser, url)
        page.ask(question, image, clip)
        page.find("#chatbot [data-testid=user] img")
        video = page.find("#chatbot [data-testid=user] video")
        page.until(lambda: browser.execute_script("return arguments[0].videoWidth", video) > 0)  # (it plays)
        page.until(lambda: any(page.answers()) and not page.answering())
        parts = [{"type": "image", "image": str(image)}, {"type": "video", "video": str(clip)}]
        conversation = [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
        assert page.answers() == [answer_of(chat, conversation)]


def test_a_clip_shown_as_a_copy_is_sent_to_the_model_as_itself(tmp_path):
    import av

    clip, h264 = tmp_path / "clip.mp4", tmp_path / "h264.mp4"
    frames = [Image.new("RGB", (64, 48), colour) for colour in ("red", "green", "blue", "white")]
    write_video(clip, frames, 2)
    write_video(h264, frames, 2, codec="libx264")
    turn = user_turns({"text": "Describe the video.", "files": [str(clip), str(h264)]})
    shown = [message["content"][0]["path"] for message in turn[:2]]
    with av.open(shown[0]) as copy:
        assert copy.streams.video[0].codec_context.name == "h264" and copy.streams.video[0].frames == 4
    assert shown[1] == str(h264)  # (one browsers play is shown as it is)
    assert [p["video"] for p in to_openai_messages(turn)[0]["content"][:2]] == [str(clip), str(h264)]


@page_test
def test_an_answer_asked_again_and_a_question_edited_are_answered_anew(browser, engine, chat, image):
    from selenium.webdriver.common.by import By

    question = "How many shapes are there?"
    edited = [{"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": question}]}]
    expected = answer_of(chat, edited)
    with served(chat) as url:
        page = Page(browser, url)
        page.ask(PROMPT, image)
        page.until(lambda: page.answers() == [ANSWER] and not page.answering())
        finished = engine.scheduler.metrics.num_finished
        page.find("#chatbot button[aria-label=Retry]").click()
        page.until(lambda: engine.scheduler.metrics.num_finished > finished and not page.answering())
        assert page.answers() == [ANSWER]  # (greedy: the same answer, in place of the first)
        page.find("#chatbot button[aria-label=Edit]")
        browser.find_elements(By.CSS_SELECTOR, "#chatbot button[aria-label=Edit]")[-1].click()  # (its text's)
        area = page.find("#chatbot textarea.edit-textarea")
        area.clear()
        area.send_keys(question)
        page.find("#chatbot button[aria-label=Submit]").click()
        page.until(lambda: page.answers() == [expected] and not page.answering())
        page.find("#chatbot [data-testid=user] img")  # (the question keeps its picture)
    chat.close()
    engine.scheduler.check_memory()


@pytest.fixture(scope="module")
def thinking_chat(tiny_dense_dir, tmp_path_factory) -> Iterator[LocalChat]:
    """A thinking model's page backend: the tiny checkpoint with a template that opens a think block at the
    start of each answer (as Qwen3-VL's Thinking checkpoints' does), read by the qwen3 reasoning parser."""
    from vlm_serve.engine import Engine
    from vlm_serve.testing.tiny_tokenizer import CHAT_TEMPLATE

    folder = tmp_path_factory.mktemp("thinking")
    shutil.copytree(tiny_dense_dir, folder, dirs_exist_ok=True)
    opening = "{{- '<|im_start|>assistant\\n' -}}"
    assert opening in CHAT_TEMPLATE
    template = CHAT_TEMPLATE.replace(opening, "{{- '<|im_start|>assistant\\n<think>\\n' -}}")
    (folder / "chat_template.jinja").write_text(template)
    with Engine(folder, dtype="float32") as engine:
        raw = engine.chat([{"role": "user", "content": PROMPT}], **GREEDY)
        backend = LocalChat(engine, reasoning_parser="qwen3")
        backend.raw = raw  # (what the model writes, all of it reasoning: it never closes its think block)
        yield backend
        backend.close()


def test_reasoning_is_a_note_open_while_the_model_thinks_and_folded_above_the_answer_after(tiny_moe_dir):
    pytest.importorskip("gradio")
    from vlm_serve.demo.chat import AnswerUsage, Thought
    from vlm_serve.demo.page import _responder

    class Thinker(RecordingChat):
        def stream(self, messages, **sampling):
            yield from (Thought("A pink "), Thought("circle."), "The circle ", "is pink.", AnswerUsage(9, 6, 0))

    history = user_turns({"text": PROMPT})
    *streaming, last = list(_responder(Thinker(tiny_moe_dir))(history, *CONTROLS))
    states = [[(m.get("metadata") or {}).get("status") for m in h[1:]] for h in streaming]
    assert states == [["pending"], ["pending"], ["done", None], ["done", None]]
    thinking, answer, usage = last[1:]
    assert (thinking["metadata"]["title"], thinking["content"][0]["text"]) == ("Thinking", "A pink circle.")
    assert answer["content"][0]["text"] == "The circle is pink."
    assert usage["metadata"]["title"].startswith("9 prompt tokens (0 cached) · 6 generated · ")
    assert to_openai_messages(last) == [
        {"role": "user", "content": [{"type": "text", "text": PROMPT}]},
        {"role": "assistant", "content": "The circle is pink."},  # (the next turn sees the answer alone)
    ]


@page_test
def test_a_thinking_models_reasoning_shows_in_a_block_above_the_answer(browser, thinking_chat):
    raw = thinking_chat.raw
    assert "</think>" not in raw.text
    with served(thinking_chat) as url:
        page = Page(browser, url)
        page.ask(PROMPT)
        page.until(lambda: len(page.notes()) == 2 and not page.answering())
        (thinking, reasoning), (usage, _) = page.notes()
        assert (thinking, reasoning) == ("Thinking", raw.text.strip())
        page.find("#chatbot [data-testid=bot] .title").click()  # (the reasoning unfolded)
        screenshot(browser, "demo-thinking")
        assert page.answers() == []  # (cut short while thinking: no answer yet)
        assert f" · {len(raw.token_ids)} generated · " in usage


@pytest.fixture(scope="module")
def server():
    """`vlm-serve serve` of the built-in model, as the page's --api-base fronts it (with an API key)."""
    flags = ("--dtype", "float32", "--vit-dp", "0", "--api-key", "sesame", "--max-media-mb", "32")
    with running_server(BUILTIN_MODEL, *flags) as server:
        yield server


@page_test
def test_the_page_in_front_of_a_server_answers_as_the_page_on_the_engine(browser, server, chat, image):
    from vlm_serve.demo.chat import RemoteChat
    from vlm_serve.demo.page import _responder

    with pytest.raises(ValueError, match=r"refuses the API key \(give it with --api-key\)"):
        RemoteChat(server.url)
    remote = RemoteChat(server.url, api_key="sesame")
    try:
        assert remote.single_turn and remote.model_name == chat.model_name
        assert remote.max_media_mb == 32  # (the server's --max-media-mb: the page's upload limit)
        for star in (False, True):  # a picture, then a follow-up question about it
            history = user_turns({"text": PROMPT, "files": [str(image)]})
            if star:
                history += [
                    {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
                    *user_turns({"text": "How many shapes are there?"}),
                ]
            ours, theirs = (list(_responder(b)(history, *CONTROLS))[-1] for b in (chat, remote))
            assert ours[:-1] == theirs[:-1]  # (and the usage notes, but for caches, timings and stages:)
            counts = [
                re.sub(r" \(\d+ cached\)", "", h[-1]["metadata"]["title"].split(" · first")[0]) for h in (ours, theirs)
            ]
            assert counts[0] == counts[1]
        with served(remote) as url:
            page = Page(browser, url)
            page.ask(PROMPT, image)
            page.until(lambda: page.answers() == [ANSWER] and not page.answering())
    finally:
        remote.close()


def test_installing_the_demo_keeps_the_pillow_the_package_installed():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    ours = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "pillow").specifier
    theirs = next(Requirement(r) for r in requires("gradio") if Requirement(r).name == "pillow").specifier
    releases = [f"{major}.{minor}.0" for major in range(10, 20) for minor in range(4)]
    assert [v for v in releases if v in ours and v not in theirs] == []  # nothing the demo would downgrade


def test_pictures_and_videos_get_the_pages_settings_and_more_pixels_make_more_tokens(tiny_moe_dir, chat, tmp_path):
    pytest.importorskip("gradio")
    from vlm_serve.demo.chat import AnswerUsage
    from vlm_serve.demo.page import _responder

    history = user_turns({"text": "Compare.", "files": ["/up/a.png", "/up/clip.mp4"]})
    backend = RecordingChat(tiny_moe_dir)
    list(_responder(backend)(history, media_options_of_turns(history, [], 50176, 2.0, 8), *SAMPLING))
    assert backend.sent[0][0]["content"][:2] == [
        {"type": "image", "image": "/up/a.png", "max_pixels": 50176},
        {"type": "video", "video": "/up/clip.mp4", "fps": 2.0, "max_frames": 8},
    ]
    big = tmp_path / "big.png"
    Image.new("RGB", (800, 600), "white").save(big)
    tokens = []
    for max_pixels in (None, 2 * 65536):  # (the built-in model's pictures are 65536 pixels by default)
        pieces = chat.stream(with_media_settings(_conversation(big), [MediaOptions(max_pixels)]), **GREEDY)
        (usage,) = [p for p in pieces if isinstance(p, AnswerUsage)]
        tokens.append(usage.media[0][1])
    assert tokens[1] > tokens[0]


def test_each_turns_files_keep_the_settings_they_were_sent_with(tiny_moe_dir):
    """Settings changed after a turn are those of the next turns' files: the earlier ones are sent as they
    were (processed anew, they would be other tokens, a conversation the prefix cache no longer knows).
    A turn asked again takes the settings of now."""
    pytest.importorskip("gradio")
    from vlm_serve.demo.page import _responder

    backend = RecordingChat(tiny_moe_dir)
    respond = _responder(backend)
    history, sent = [], []
    for message, fields in [
        ({"text": "What is this?", "files": ["/up/a.png"]}, (50176, None, None)),
        ({"text": "And these?", "files": ["/up/b.png", "/up/clip.mp4"]}, (100352, 2.0, 8)),
        ({"text": "Which is larger?"}, (None, None, None)),
    ]:
        history = [*history, *user_turns(message)]
        sent = media_options_of_turns(history, sent, *fields)
        history = list(respond(history, sent, *SAMPLING))[-1]
    media = [p for m in backend.sent[-1] if m["role"] == "user" for p in m["content"] if p["type"] != "text"]
    assert media == [
        {"type": "image", "image": "/up/a.png", "max_pixels": 50176},
        {"type": "image", "image": "/up/b.png", "max_pixels": 100352},
        {"type": "video", "video": "/up/clip.mp4", "fps": 2.0, "max_frames": 8},
    ]
    second = history[:6]  # (up to the second turn, its answer dropped: asked again)
    assert [m["role"] for m in second[-4:]] == ["assistant", "user", "user", "user"]
    assert media_options_of_turns(second, sent, None, 1.0, None) == [
        sent[0],
        MediaOptions(fps=1.0),
        MediaOptions(fps=1.0),
    ]


def test_a_picture_keeps_its_tokens_when_the_settings_change_after_it_was_sent(chat, tmp_path):
    """The built-in model is sent a follow-up question with the picture before it: with the settings it was
    sent with, so it is the same tokens, found in the prefix cache."""
    pytest.importorskip("gradio")
    from vlm_serve.demo.chat import AnswerUsage
    from vlm_serve.demo.page import _responder

    big = tmp_path / "big.png"
    Image.new("RGB", (800, 600), "white").save(big)
    respond = _responder(chat)
    history, sent, notes = [], [], []
    for message, max_pixels in [
        ({"text": PROMPT, "files": [str(big)]}, 2 * 65536),  # (the built-in model's default: 65536 pixels)
        ({"text": "How many shapes are there?"}, 65536),
    ]:
        history = [*history, *user_turns(message)]
        sent = media_options_of_turns(history, sent, max_pixels, None, None)
        history = list(respond(history, sent, *SAMPLING))[-1]
        notes.append(history[-1]["metadata"]["title"])
    (_, first), (cached, second) = ([int(n) for n in re.findall(r"\((\d+) (?:cached|tokens)\)", n)] for n in notes)
    now = chat.stream(with_media_settings(_conversation(big), [MediaOptions(65536)]), **GREEDY)
    (usage,) = [p for p in now if isinstance(p, AnswerUsage)]
    assert first == second != usage.media[0][1]  # (sent with the settings of now, it would be other tokens)
    assert cached > second  # (the prompt's start, the picture's tokens with it)


def test_the_page_takes_uploads_up_to_its_media_limit(engine):
    """`vlm-serve demo --max-media-mb 5` (the limit a server of this engine would set; tests/engine/test_cli.py
    checks the flag reaches it)."""
    default = LocalChat(engine)
    default.close()
    assert default.max_media_mb == MediaLimitSettings.max_media_mb
    backend = LocalChat(engine, max_media_mb=5)
    try:
        assert backend.max_media_mb == 5
        demo = launch_demo(backend, port=free_port())
        try:
            assert demo.max_file_size == 5 << 20
            texts = " ".join(c.value for c in demo.blocks.values() if type(c).__name__ == "Markdown")
            assert "(up to 5 MB each)" in texts
        finally:
            demo.close()
    finally:
        backend.close()


def test_the_page_names_the_model_and_opens_with_256_tokens(engine, chat):
    demo = build_demo(chat)
    texts = [c.value for c in demo.blocks.values() if type(c).__name__ == "Markdown"]
    assert any(engine.model_name in text for text in texts)
    sliders = {c.label: c.value for c in demo.blocks.values() if type(c).__name__ == "Slider"}
    assert sliders["Max tokens"] == 256


def test_the_page_says_when_each_question_is_sent_alone(tiny_moe_dir):
    def page_text(model_dir: Path) -> str:
        demo = build_demo(RecordingChat(model_dir))
        return " ".join(c.value for c in demo.blocks.values() if type(c).__name__ == "Markdown")

    assert SINGLE_TURN_NOTE in page_text(BUILTIN_MODEL)
    assert SINGLE_TURN_NOTE not in page_text(tiny_moe_dir)


@pytest.fixture(params=["engine", "server"])
def demo_source(request, tiny_moe_dir) -> tuple[list[str], str]:
    """What `vlm-serve demo` is given to answer with, and the model name it shows: a checkpoint, or (with
    `--api-base`, loading no model) the server's."""
    if request.param == "server":
        server = request.getfixturevalue("server")
        return ["--api-base", server.url, "--api-key", "sesame"], BUILTIN_MODEL.name
    return ["--model", str(tiny_moe_dir), "--vit-dp", "0"], tiny_moe_dir.name


@pytest.mark.server
def test_vlm_serve_demo_prints_its_address_and_nothing_else_until_stopped(demo_source):
    port = free_port()
    source, name = demo_source
    command = [sys.executable, "-m", "vlm_serve.cli", "demo", *source, "--port", str(port)]
    process = start_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = process.stdout.readline()
        assert first == f"vlm-serve: demo of {name} on http://127.0.0.1:{port}\n"
    finally:
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    assert "share" not in first.lower()
    assert (process.returncode, rest) == (0, "")  # Ctrl-C stops it without a word
