"""The built-in model, as shipped with the package: a Qwen3-VL checkpoint in the published layout that
answers truly about simple scenes, through the real server: the scenes it was trained on, and pictures
drawn the way a person tries it (Pillow's named colours on white, anywhere, of any size; a clip made frame
by frame). Its accuracy over held-out questions is benchmarks/bench_quality.py's."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors import safe_open

from helpers import openai_client, running_server
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.builtin.scenes import OTHER_ANSWER, VIDEO_FPS, Motion, Scene, Shape, render, render_motion
from vlm_serve.multimodal.video import write_video

RED_CIRCLE = Scene([Shape("circle", "red", "large", 1, 1)], background_seed=3)
THREE_SHAPES = Scene(
    [
        Shape("square", "blue", "large", 0, 0),
        Shape("star", "yellow", "small", 1, 1),
        Shape("triangle", "green", "large", 2, 2),
    ],
    background_seed=11,
)
TO_THE_RIGHT = Motion(Shape("square", "green", "large", 1, 0), "from left to right", frames=6, background_seed=5)


def drawn(width: int, height: int, *shapes: tuple[str, str, tuple[int, int, int, int]]) -> Image.Image:
    """A picture as a person draws one: each (kind, Pillow colour name, box) filled on white."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for kind, colour, (left, top, right, bottom) in shapes:
        middle, centre = (left + right) / 2, (top + bottom) / 2
        if kind == "circle":
            draw.ellipse([left, top, right, bottom], fill=colour)
        elif kind == "square":
            draw.rectangle([left, top, right, bottom], fill=colour)
        elif kind == "triangle":
            draw.polygon([(middle, top), (right, bottom), (left, bottom)], fill=colour)
        else:
            draw.polygon([(middle, top), (right, centre), (middle, bottom), (left, centre)], fill=colour)
    return image


PINK_CIRCLE = drawn(200, 150, ("circle", "pink", (120, 30, 170, 80)))
BROWN_TRIANGLE = drawn(300, 300, ("triangle", "brown", (20, 180, 110, 270)))
TWO_DRAWN = drawn(256, 256, ("circle", "blue", (30, 30, 110, 110)), ("square", "orange", (160, 150, 230, 220)))
DIAMOND_AND_CIRCLE = drawn(320, 200, ("diamond", "green", (200, 70, 260, 130)), ("circle", "red", (40, 60, 100, 120)))
SLIDING_SQUARE = [drawn(192, 192, ("square", "green", (10 + 20 * i, 70, 60 + 20 * i, 120))) for i in range(7)]
RISING_BALL = [drawn(192, 192, ("circle", "blue", (110, 130 - 15 * i, 156, 176 - 15 * i))) for i in range(8)]  # (right)


def png_url(picture: Scene | Image.Image) -> str:
    buffer = io.BytesIO()
    (render(picture) if isinstance(picture, Scene) else picture).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def mp4_url(clip: Motion | list[Image.Image]) -> str:
    buffer = io.BytesIO()
    write_video(buffer, render_motion(clip) if isinstance(clip, Motion) else clip, VIDEO_FPS)
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_checkpoint_is_a_published_qwen3_vl_moe_layout_of_a_few_megabytes():
    config = json.loads((BUILTIN_MODEL / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    weights = BUILTIN_MODEL / "model.safetensors"
    assert weights.stat().st_size < 10 * 2**20
    with safe_open(str(weights), "pt") as f:
        experts = f.get_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj")
        hidden = config["text_config"]["hidden_size"]
        assert experts.shape[1] == hidden  # [experts, hidden, 2 x intermediate], as published
    training = json.loads((BUILTIN_MODEL / "training.json").read_text())
    assert {"steps", "batch_size", "seed", "lr"} <= training.keys()  # how to reproduce it with train.py


@pytest.fixture(scope="module")
def builtin_server():
    with running_server(BUILTIN_MODEL) as server:
        yield server


def ask(server, media: dict, question: str) -> str:
    ((kind, url),) = media.items()
    content = [{"type": kind, kind: {"url": url}}, {"type": "text", "text": question}]
    reply = openai_client(server).chat.completions.create(
        model=BUILTIN_MODEL.name, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=64
    )
    return reply.choices[0].message.content


@pytest.mark.server
@pytest.mark.parametrize(
    "media, question, answer",
    [
        ({"image_url": png_url(RED_CIRCLE)}, "Describe this image.", "A large red circle in the center."),
        ({"image_url": png_url(RED_CIRCLE)}, "what colour is the circle?", "The circle is red."),
        ({"image_url": png_url(THREE_SHAPES)}, "How many shapes are there?", "There are three shapes."),
        ({"image_url": png_url(THREE_SHAPES)}, "What colour is the star?", "The star is yellow."),
        ({"image_url": png_url(THREE_SHAPES)}, "Is there a circle?", "No, there is no circle."),
        ({"video_url": mp4_url(TO_THE_RIGHT)}, "Describe the video.", "A green square moves from left to right."),
    ],
    ids=["caption", "colour", "count", "colour-among-three", "absent-kind", "motion"],
)
def test_the_server_answers_truly_about_simple_scenes(builtin_server, media, question, answer):
    assert ask(builtin_server, media, question) == answer


@pytest.mark.server
@pytest.mark.parametrize(
    "media, question, answer",
    [
        ({"image_url": png_url(PINK_CIRCLE)}, "what colour is the circle?", "The circle is pink."),
        ({"image_url": png_url(PINK_CIRCLE)}, "What shape is in the image?", "A pink circle."),
        ({"image_url": png_url(BROWN_TRIANGLE)}, "What color is the triangle", "The triangle is brown."),
        ({"image_url": png_url(BROWN_TRIANGLE)}, "Which shape do you see?", "A brown triangle."),
        (
            {"image_url": png_url(TWO_DRAWN)},
            "Describe this image.",
            "A large blue circle at the top left and a large orange square at the bottom right.",
        ),
        ({"image_url": png_url(DIAMOND_AND_CIRCLE)}, "Where is the diamond?", "The diamond is on the right."),
        ({"image_url": png_url(DIAMOND_AND_CIRCLE)}, "What is the capital of France?", OTHER_ANSWER),
        ({"video_url": mp4_url(SLIDING_SQUARE)}, "Describe the video.", "A green square moves from left to right."),
        (
            {"video_url": mp4_url(RISING_BALL)},
            "Which way does the ball move?",
            "A blue circle moves from bottom to top.",
        ),
    ],
    ids=["pink", "one-shape", "brown", "which-shape", "caption", "place", "outside-its-skills", "motion", "motion-up"],
)
def test_the_server_answers_truly_about_pictures_drawn_off_its_grid(builtin_server, media, question, answer):
    assert ask(builtin_server, media, question) == answer


def test_it_is_served_in_its_bfloat16_by_default():
    """`--dtype auto`: the weights stay as shipped (where the CPU kernels take them, their panels are
    bfloat16), activations and the KV cache float32 on CPU and bfloat16 on a GPU."""
    from vlm_serve.engine import Engine
    from vlm_serve.llm.layers.linear import LinearBase
    from vlm_serve.llm.layers.moe import SparseMoeBlock

    with Engine(BUILTIN_MODEL, vit_dp=0) as engine:
        runner = engine.scheduler.runner
        linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
        experts = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert linears and experts
        assert {(m.weight if m.panels is None else m.panels.weight).dtype for m in linears} == {torch.bfloat16}
        assert {(m.w13 if m.packed is None else m.packed.w13).dtype for m in experts} == {torch.bfloat16}
        assert runner.token_to_kv_pool.dtype == (torch.float32 if runner.device.type == "cpu" else torch.bfloat16)
