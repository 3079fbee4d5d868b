"""The Gradio demo: the history -> messages conversion, what a model that knows single questions only is
sent, and the page itself driven by headless Chromium (upload a picture drawn as a person draws one, off
the built-in model's grid: a pink circle up and to the right on white; ask its colour: the streamed answer
is the built-in model's, "pink")."""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import requires
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
from packaging.requirements import Requirement
from PIL import Image, ImageDraw

from helpers import free_port, start_process
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.builtin.scenes import Scene, Shape, render
from vlm_serve.demo import (
    SINGLE_TURN_NOTE,
    build_demo,
    latest_question,
    single_turn_only,
    to_openai_messages,
    user_turn,
)
from vlm_serve.testing.media import png_stating

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PROMPT = "what colour is the circle?"
ANSWER = "The circle is pink."  # the built-in model's
BOT = "#chatbot [data-testid=bot]"  # an assistant bubble of the page
GREEDY = {"temperature": 0, "max_tokens": 12}
CONTROLS = (GREEDY["max_tokens"], GREEDY["temperature"], 1.0, 0, 1.0, None)  # the page's: top_k 0 = off, no seed


@pytest.fixture(scope="module")
def engine():
    from vlm_serve.engine import Engine

    engine = Engine(dtype="float32", vit_dp=0)  # the built-in model; vit_dp=0: no encoder processes
    yield engine
    engine.shutdown()


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
class RecordingEngine:
    """Stands in for `Engine` where only what the demo sends matters: it keeps each conversation it is
    sent and answers "ok"."""

    model_dir: Path
    model_name: str = "recording"
    default_sampling: dict = field(default_factory=dict)
    sent: list[list[dict]] = field(default_factory=list)

    @property
    def server_args(self) -> SimpleNamespace:
        return SimpleNamespace(model=str(self.model_dir))

    def stream(self, messages: list[dict], **sampling) -> Iterator[SimpleNamespace]:
        self.sent.append(messages)
        yield SimpleNamespace(text="ok")


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
def test_handler_streams_the_answer_and_drops_a_rejected_turn(engine, image, tmp_path):
    pytest.importorskip("gradio")
    from vlm_serve.demo import _responder

    respond = _responder(engine, threading.Lock(), single_turn=True)
    history = [user_turn({"text": PROMPT, "files": [str(image)]})]
    updates = list(respond(history, *CONTROLS))
    answers = [h[-1]["content"][0]["text"] for h in updates]
    assert len(updates) > 1 and all(h[:-1] == history and h[-1]["role"] == "assistant" for h in updates)
    assert all(b.startswith(a) for a, b in itertools.pairwise(answers))  # each update extends the last
    assert answers[-1] == engine.chat(_conversation(image), **GREEDY).text == ANSWER

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a PNG")
    history = [*updates[-1], user_turn({"text": "And this one?", "files": [str(broken)]})]
    with pytest.warns(UserWarning, match="The message was not sent"):  # gr.Warning outside a page
        assert list(respond(history, *CONTROLS)) == [updates[-1]]  # the rejected turn is taken back
    engine.scheduler.check_memory()


def test_an_oversized_picture_is_refused_with_its_size_the_limit_and_the_flag(engine, tmp_path):
    pytest.importorskip("gradio")
    from vlm_serve.demo import _responder

    huge = tmp_path / "huge.png"
    huge.write_bytes(png_stating(20000, 20000))
    respond = _responder(engine, threading.Lock(), single_turn=True)
    message = r"image is 20000 x 20000 = 400000000 pixels, more than the limit of 89478485 \(--max-image-pixels\)"
    with pytest.warns(UserWarning, match=message):
        assert list(respond([user_turn({"text": PROMPT, "files": [str(huge)]})], *CONTROLS)) == [[]]
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


def test_a_picture_attached_in_a_later_turn_gets_an_answer_about_that_picture(engine, image, tmp_path):
    pytest.importorskip("gradio")
    from vlm_serve.demo import _responder

    star = tmp_path / "star.png"
    render(Scene([Shape("star", "blue", "large", 0, 2)], background_seed=4)).save(star)
    respond = _responder(engine, threading.Lock(), single_turn_only(BUILTIN_MODEL))
    history: list[dict] = []
    for message, answer in [
        ({"text": PROMPT, "files": [str(image)]}, ANSWER),
        ({"text": "Describe this image.", "files": [str(star)]}, "A large blue star at the top right."),
        ({"text": "How many shapes are there?"}, "There is one shape."),  # about the star, the latest picture
    ]:
        history = list(respond([*history, user_turn(message)], *CONTROLS))[-1]
        assert history[-1]["content"][0]["text"] == answer


def test_other_models_are_sent_the_whole_conversation(tiny_moe_dir):
    pytest.importorskip("gradio")
    from vlm_serve.demo import _responder

    engine = RecordingEngine(tiny_moe_dir)
    history = [
        user_turn({"text": "What is this?", "files": ["/up/a.png"]}),
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        user_turn({"text": "And this?", "files": ["/up/b.png"]}),
    ]
    list(_responder(engine, threading.Lock(), single_turn_only(tiny_moe_dir))(history, *CONTROLS))
    assert engine.sent == [to_openai_messages(history)] and len(engine.sent[0]) == 3


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
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting' is deprecated")  # pandas 3, in Gradio's queue
@pytest.mark.filterwarnings("ignore:The copy keyword is deprecated")
def test_page_streams_the_greedy_answer_to_an_uploaded_image(browser, engine, image, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from vlm_serve.demo import build_demo

    expected = engine.chat(_conversation(image), **GREEDY).text
    assert expected == ANSWER
    image_hits = engine.processor.cache.hits
    demo = build_demo(engine, GREEDY)
    try:
        port = free_port()
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
        browser.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(browser, 60)

        upload = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#chat-input input[type=file]")))
        upload.send_keys(str(image))
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#chat-input .thumbnail-item img")))  # uploaded
        textbox = browser.find_element(By.CSS_SELECTOR, "#chat-input textarea")
        textbox.send_keys(PROMPT)
        browser.find_element(By.CSS_SELECTOR, "#chat-input button.submit-button").click()

        # The user's turn shows the image; the answer streams into a bot bubble; the textbox, locked
        # while the answer is generated, unlocks when it is done.
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#chatbot [data-testid=user] img")))
        wait.until(lambda d: any(el.text.strip() for el in d.find_elements(By.CSS_SELECTOR, BOT)))
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#chat-input textarea").is_enabled())

        bots = browser.find_elements(By.CSS_SELECTOR, BOT)
        assert len(bots) == 1
        # The bubble's aria-label holds the raw text ("bot's message: ..."); its rendering is Markdown.
        label = bots[0].get_attribute("aria-label")
        assert label == "bot's message: " + expected
        assert engine.processor.cache.hits == image_hits + 1  # the uploaded bytes reached the processor

        # A file that is no image: a warning, and the turn is taken back; the conversation goes on.
        broken = tmp_path / "broken.png"
        broken.write_bytes(b"not a PNG")
        browser.find_element(By.CSS_SELECTOR, "#chat-input input[type=file]").send_keys(str(broken))
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#chat-input .thumbnail-item")))
        browser.find_element(By.CSS_SELECTOR, "#chat-input textarea").send_keys("And this one?")
        browser.find_element(By.CSS_SELECTOR, "#chat-input button.submit-button").click()
        wait.until(lambda d: "The message was not sent" in d.find_element(By.TAG_NAME, "body").text)
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#chat-input textarea").is_enabled())
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chatbot [data-testid=user]")) == 2)
        assert len(browser.find_elements(By.CSS_SELECTOR, BOT)) == 1
        engine.scheduler.check_memory()
    finally:
        demo.close()


def test_installing_the_demo_keeps_the_pillow_the_package_installed():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    ours = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "pillow").specifier
    theirs = next(Requirement(r) for r in requires("gradio") if Requirement(r).name == "pillow").specifier
    releases = [f"{major}.{minor}.0" for major in range(10, 20) for minor in range(4)]
    assert [v for v in releases if v in ours and v not in theirs] == []  # nothing the demo would downgrade


def test_the_page_names_the_model_and_opens_with_256_tokens(engine):
    demo = build_demo(engine)
    texts = [c.value for c in demo.blocks.values() if type(c).__name__ == "Markdown"]
    assert any(engine.model_name in text for text in texts)
    sliders = {c.label: c.value for c in demo.blocks.values() if type(c).__name__ == "Slider"}
    assert sliders["Max tokens"] == 256


def test_the_page_says_when_each_question_is_sent_alone(tiny_moe_dir):
    def page_text(model_dir: Path) -> str:
        demo = build_demo(RecordingEngine(model_dir))
        return " ".join(c.value for c in demo.blocks.values() if type(c).__name__ == "Markdown")

    assert SINGLE_TURN_NOTE in page_text(BUILTIN_MODEL)
    assert SINGLE_TURN_NOTE not in page_text(tiny_moe_dir)


@pytest.mark.server
def test_vlm_serve_demo_prints_its_address_and_nothing_else_until_stopped(tiny_moe_dir):
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vlm_serve.cli",
        "demo",
        "--model",
        str(tiny_moe_dir),
        "--port",
        str(port),
        "--vit-dp",
        "0",
    ]
    process = start_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = process.stdout.readline()
        assert first == f"vlm-serve: demo of {tiny_moe_dir.name} on http://127.0.0.1:{port}\n"
    finally:
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    assert "share" not in first.lower()
    assert (process.returncode, rest) == (0, "")  # Ctrl-C stops it without a word
