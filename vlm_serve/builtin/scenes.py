"""Synthetic scenes the built-in model is trained and measured on: 1-4 shapes on a background, a short
clip of one moving shape, and the questions and answers about them.

An image is cut into thirds each way, and each shape sits in one of the nine cells: so its place has a
name ("at the top left", "in the center") whatever the picture's size. The built-in model sees a picture
as 3 x 3 tokens (its processor brings every image to at most 96 x 96 pixels, and a token covers 32 x 32),
one per cell. Every text is made by the functions here from the scene alone, so answers can be scored by
exact match.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

KINDS = ("circle", "square", "triangle", "star", "diamond")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 135, 20),
    "yellow": (240, 215, 20),
    "green": (30, 170, 50),
    "blue": (30, 70, 220),
    "purple": (140, 40, 180),
    "pink": (250, 120, 190),
    "brown": (125, 75, 30),
}
SIZES = ("small", "large")
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
PLACES = {  # (row, column) -> where a shape in that cell is said to be
    (0, 0): "at the top left", (0, 1): "at the top", (0, 2): "at the top right",
    (1, 0): "on the left", (1, 1): "in the center", (1, 2): "on the right",
    (2, 0): "at the bottom left", (2, 1): "at the bottom", (2, 2): "at the bottom right",
}  # fmt: skip
NUMBERS = ("no", "one", "two", "three", "four")
DIRECTIONS = {  # direction -> (start cell, end cell) along the middle row or column
    "from left to right": ((1, 0), (1, 2)),
    "from right to left": ((1, 2), (1, 0)),
    "from top to bottom": ((0, 1), (2, 1)),
    "from bottom to top": ((2, 1), (0, 1)),
}


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    size: str
    row: int
    column: int

    def describe(self) -> str:
        return f"a {self.size} {self.colour} {self.kind}"


@dataclass
class Scene:
    """Shapes in distinct cells, in reading order, on a background drawn from `background_seed`."""

    shapes: list[Shape]
    background_seed: int = 0
    width: int = 96
    height: int = 96


@dataclass
class Motion:
    """One shape moving straight across a clip of `frames` frames."""

    shape: Shape
    direction: str
    frames: int = 8
    background_seed: int = 0
    size: int = 96
    jitter: list[tuple[float, float]] = field(default_factory=list)


# -- making scenes ----------------------------------------------------------------------------------------


def random_shape(rng: random.Random, row: int, column: int) -> Shape:
    return Shape(rng.choice(KINDS), rng.choice(list(COLOURS)), rng.choice(SIZES), row, column)


def random_scene(rng: random.Random, count: int | None = None, most: int = 4) -> Scene:
    """1 to `most` shapes (or `count`) in random cells, the picture 96 px square or, now and then, larger or
    oblong (the processor brings it back to 3 x 3 tokens or near)."""
    count = count if count is not None else rng.randint(1, most)
    cells = sorted(rng.sample([(r, c) for r in range(3) for c in range(3)], count))
    width, height = rng.choice([(96, 96)] * 6 + [(192, 192), (288, 288), (384, 384), (480, 360), (360, 480)])
    return Scene([random_shape(rng, r, c) for r, c in cells], rng.randrange(1 << 30), width, height)


def random_motion(rng: random.Random) -> Motion:
    direction = rng.choice(list(DIRECTIONS))
    shape = Shape(rng.choice(KINDS), rng.choice(list(COLOURS)), "large", *DIRECTIONS[direction][0])
    frames = rng.choice([4, 6, 8])
    jitter = [(rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1)) for _ in range(frames)]
    return Motion(shape, direction, frames, rng.randrange(1 << 30), rng.choice([96, 96, 192]), jitter)


# -- drawing ----------------------------------------------------------------------------------------------


def render(scene: Scene) -> Image.Image:
    rng = random.Random(scene.background_seed)
    image = background(rng, scene.width, scene.height)
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        cx, cy = (shape.column + 0.5 + rng.uniform(-0.12, 0.12)) / 3, (shape.row + 0.5 + rng.uniform(-0.12, 0.12)) / 3
        draw_shape(draw, shape, cx * scene.width, cy * scene.height, cell_extent(shape, rng, scene.width, scene.height))
    return image


def render_motion(motion: Motion) -> list[Image.Image]:
    """The clip's frames: the shape's centre goes from its start cell to its end cell at even steps."""
    rng = random.Random(motion.background_seed)
    back = background(rng, motion.size, motion.size)
    (r0, c0), (r1, c1) = DIRECTIONS[motion.direction]
    extent = cell_extent(motion.shape, rng, motion.size, motion.size)
    frames = []
    for i in range(motion.frames):
        t = i / (motion.frames - 1)
        dx, dy = motion.jitter[i] if motion.jitter else (0.0, 0.0)
        cx = (c0 + (c1 - c0) * t + 0.5 + dx) / 3 * motion.size
        cy = (r0 + (r1 - r0) * t + 0.5 + dy) / 3 * motion.size
        frame = back.copy()
        draw_shape(ImageDraw.Draw(frame), motion.shape, cx, cy, extent)
        frames.append(frame)
    return frames


def background(rng: random.Random, width: int, height: int) -> Image.Image:
    """A grey-toned background, white to black (plain, a gradient or blotches, more or less noisy): never one
    of `COLOURS`."""
    low, high = sorted(rng.randint(0, 255) for _ in range(2))
    tint = [rng.randint(-12, 12) for _ in range(3)]
    style = rng.choice(("plain", "gradient", "blotches"))
    image = Image.new("RGB", (width, height), tuple(max(0, min(255, high + t)) for t in tint))
    draw = ImageDraw.Draw(image)
    if style == "gradient":
        vertical = rng.random() < 0.5
        steps = height if vertical else width
        for i in range(steps):
            v = round(low + (high - low) * i / max(steps - 1, 1))
            colour = tuple(max(0, min(255, v + t)) for t in tint)
            draw.line([(0, i), (width, i)] if vertical else [(i, 0), (i, height)], fill=colour)
    elif style == "blotches":
        for _ in range(rng.randint(3, 8)):
            x, y, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(0.1, 0.4) * min(width, height)
            v = rng.randint(low, high)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(max(0, min(255, v + t)) for t in tint))
        image = image.filter(ImageFilter.GaussianBlur(min(width, height) / 24))
    noise = np.random.default_rng(rng.randrange(1 << 32)).normal(128, rng.uniform(0, 120), (height, width))
    return Image.blend(image, Image.fromarray(noise.clip(0, 255).astype(np.uint8)).convert("RGB"), 0.08)


def cell_extent(shape: Shape, rng: random.Random, width: int, height: int) -> float:
    """Half the shape's width in pixels: large ones fill most of their cell, small ones about a third."""
    cell = min(width, height) / 3
    return cell * (rng.uniform(0.36, 0.44) if shape.size == "large" else rng.uniform(0.16, 0.22))


def draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, cx: float, cy: float, r: float) -> None:
    colour = COLOURS[shape.colour]
    if shape.kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape.kind == "square":
        s = r * 0.88
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=colour)
    elif shape.kind == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=colour)
    elif shape.kind == "diamond":
        draw.polygon([(cx, cy - r), (cx + r * 0.75, cy), (cx, cy + r), (cx - r * 0.75, cy)], fill=colour)
    elif shape.kind == "star":
        points = []
        for i in range(10):
            radius = r if i % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + i * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=colour)
    else:
        raise ValueError(f"unknown shape {shape.kind!r}")


# -- what is said about them ------------------------------------------------------------------------------


def caption(scene: Scene) -> str:
    """'A large red circle on the left and a small blue triangle at the bottom right.'"""
    parts = [f"{shape.describe()} {PLACES[shape.row, shape.column]}" for shape in scene.shapes]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return text[0].upper() + text[1:] + "."


def count_answer(scene: Scene) -> str:
    n = len(scene.shapes)
    return f"There {'is' if n == 1 else 'are'} {NUMBERS[n]} shape{'' if n == 1 else 's'}."


def colour_answer(scene: Scene, kind: str) -> str:
    colours = [s.colour for s in scene.shapes if s.kind == kind]
    if not colours:
        return f"There is no {kind}."
    if len(colours) == 1:
        return f"The {kind} is {colours[0]}."
    listed = ", ".join(colours[:-1]) + " and " + colours[-1]
    return f"There are {NUMBERS[len(colours)]} {kind}s: {listed}."


def presence_answer(scene: Scene, kind: str) -> str:
    found = [s for s in scene.shapes if s.kind == kind]
    if not found:
        return f"No, there is no {kind}."
    return f"Yes, {found[0].describe()} {PLACES[found[0].row, found[0].column]}." if len(found) == 1 else (
        f"Yes, there are {NUMBERS[len(found)]} {kind}s."
    )


def motion_caption(motion: Motion) -> str:
    return f"A {motion.shape.colour} {motion.shape.kind} moves {motion.direction}."


def comparison_answer(first: Scene, second: Scene) -> str:
    a, b = len(first.shapes), len(second.shapes)
    if a == b:
        return f"Both images have {NUMBERS[a]} shape{'' if a == 1 else 's'}."
    more = "first" if a > b else "second"
    return f"The {more} image has more shapes: {NUMBERS[max(a, b)]} against {NUMBERS[min(a, b)]}."


CAPTION_PROMPTS = (
    "Describe this image.", "Describe the picture.", "What is in this picture?", "What do you see?",
    "Describe this image in one sentence.", "What is in the image?", "What shapes are in this image?",
)  # fmt: skip
COUNT_PROMPTS = ("How many shapes are there?", "How many shapes do you see?", "Count the shapes.")
COLOUR_PROMPTS = ("What colour is the {kind}?", "What color is the {kind}?", "Which colour does the {kind} have?")
PRESENCE_PROMPTS = ("Is there a {kind}?", "Is there a {kind} in the picture?", "Do you see a {kind}?")
MOTION_PROMPTS = ("Describe the video.", "What happens in this video?", "Which way does the shape move?")
COMPARE_PROMPTS = ("Which image has more shapes?", "Compare the number of shapes in the two images.")
GREETINGS = ("Hello", "Hi", "hello!", "Hi there", "Who are you?", "What can you do?")
GREETING_ANSWER = (
    "Hello! I am a small vision-language model trained on pictures of simple shapes. Show me an image of "
    "circles, squares, triangles, stars or diamonds and ask me about it."
)


@dataclass
class Example:
    """One conversation turn: the media (images, or a clip's frames), the question and its answer."""

    kind: str  # caption | count | colour | presence | motion | compare | greeting
    question: str
    answer: str
    images: list[Image.Image] = field(default_factory=list)
    video: list[Image.Image] | None = None
    question_first: bool = False  # the question's text comes before the media (as OpenAI's examples have it)
    scenes: list[Scene] = field(default_factory=list)  # what each picture shows (for training's cell loss)


def random_example(rng: random.Random, most: int = 4) -> Example:
    """A training or test example of a kind drawn with the weights below, its pictures holding at most
    `most` shapes; its question before the media one time in three, now and then in lower case."""
    kind = rng.choices(
        ("caption", "count", "colour", "presence", "motion", "compare", "greeting"), (26, 10, 22, 22, 11, 8, 1)
    )[0]
    example = _random_example_of(rng, kind, most)
    example.question_first = rng.random() < 1 / 3
    if rng.random() < 1 / 4:  # people type questions in lower case, or without their question mark
        example.question = example.question[0].lower() + example.question[1:]
    if rng.random() < 1 / 6:
        example.question = example.question.rstrip("?.!")
    return example


def _random_example_of(rng: random.Random, kind: str, most: int) -> Example:
    if kind == "greeting":
        return Example(kind, rng.choice(GREETINGS), GREETING_ANSWER)
    if kind == "motion":
        return motion_example(rng, random_motion(rng))
    if kind == "compare":
        first, second = random_scene(rng, most=most), random_scene(rng, most=most)
        return compare_example(rng, first, second, [render(first), render(second)])
    scene = random_scene(rng, most=most)
    return scene_example(rng, kind, scene, render(scene))


def scene_example(rng: random.Random, kind: str, scene: Scene, image: Image.Image) -> Example:
    """A question of `kind` (caption | count | colour | presence) about `scene`, drawn as `image`."""
    if kind == "caption":
        return Example(kind, rng.choice(CAPTION_PROMPTS), caption(scene), [image], scenes=[scene])
    if kind == "count":
        return Example(kind, rng.choice(COUNT_PROMPTS), count_answer(scene), [image], scenes=[scene])
    present = [s.kind for s in scene.shapes]
    absent = [k for k in KINDS if k not in present]
    # presence is asked as often about an absent kind as a present one, so that "Yes" is never a safe guess
    asks_present = not absent or rng.random() < (0.75 if kind == "colour" else 0.5)
    asked = rng.choice(present if asks_present else absent)
    if kind == "colour":
        question, answer = rng.choice(COLOUR_PROMPTS).format(kind=asked), colour_answer(scene, asked)
    else:
        question, answer = rng.choice(PRESENCE_PROMPTS).format(kind=asked), presence_answer(scene, asked)
    return Example(kind, question, answer, [image], scenes=[scene])


def motion_example(rng: random.Random, motion: Motion, frames: list[Image.Image] | None = None) -> Example:
    """A question about the clip of `motion` (its frames drawn once by the caller, or here)."""
    question = rng.choice(MOTION_PROMPTS)
    return Example("motion", question, motion_caption(motion), video=frames or render_motion(motion))


def compare_example(rng: random.Random, first: Scene, second: Scene, images: list[Image.Image]) -> Example:
    """Which of two scenes, drawn as `images`, has more shapes."""
    return Example("compare", rng.choice(COMPARE_PROMPTS), comparison_answer(first, second), images,
                   scenes=[first, second])  # fmt: skip
