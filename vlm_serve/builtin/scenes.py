"""Synthetic scenes the built-in model is trained and measured on: 1-4 shapes on a background, a short
clip of one moving shape, and the questions and answers about them.

A shape's place is named by the cell of a 3 x 3 grid its centre is in ("at the top left", "in the
center"), whatever the picture's size. Every text is made by the functions here from the scene alone, so
answers can be scored by exact match. Scenes come in two distributions:

- the first model's (`wide=False`, the old held-out set): each shape near the centre of its cell, at most
  a third of the cell wide, in one of eight palette colours (`COLOURS`), asked a few ways;
- the wide one (`wide=True`): shapes anywhere and of any size from a tenth to half of the picture,
  overlapping a little, in any shade that a colour name covers (CSS / Pillow named colours included:
  `SHADES`), on light or dark backgrounds, drawn smooth or jagged, with noise and JPEG artefacts; clips
  moving in eight directions; every question asked many ways, and questions outside the model's skills.
  A shape whose centre lies near a cell's edge, or whose shade lies near the boundary of two colour names
  (or of grey), is not drawn: every answer is decided by the picture.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageColor, ImageDraw, ImageFilter

KINDS = ("circle", "square", "triangle", "star", "diamond")
VIDEO_FPS = 2  # the clips' rate, the processor's sampling rate: every frame is seen
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
# the shades each colour name covers, as anchors: a shade is named by its nearest anchor (COLOURS' and the
# CSS / Pillow colours listed), unless an anchor of another name, or a grey, is nearly as near
SHADES: dict[str | None, tuple[str | tuple[int, int, int], ...]] = {
    "red": ("red", "crimson", "darkred"),
    "orange": ("orange", "darkorange"),
    "yellow": ("yellow", "gold"),
    "green": ("green", "lime", "forestgreen", "limegreen", "darkgreen", "seagreen"),
    "blue": ("blue", "mediumblue", "navy", "royalblue", "dodgerblue"),
    "purple": ("purple", "darkviolet", "blueviolet", "indigo", "darkorchid", "mediumpurple"),
    "pink": ("pink", "hotpink", "deeppink", "lightpink"),
    "brown": ("brown", "saddlebrown", "sienna"),
    None: ((255, 255, 255), (0, 0, 0), (128, 128, 128), (192, 192, 192), (64, 64, 64)),  # no colour name
}
SHADE_MARGIN = 16.0  # how much nearer its own name's anchor than any other a named shade is
SIZES = ("small", "large")
EXTENTS = {"small": (0.05, 0.085), "large": (0.11, 0.25)}  # half a wide scene's shape, of the picture's shorter side
EDGE_MARGIN = 0.035  # a wide scene's shape centres stay this far (of the picture) from the cells' edges
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
DIAGONALS = {  # wide clips also move corner to corner
    "from the top left to the bottom right": ((0, 0), (2, 2)),
    "from the bottom right to the top left": ((2, 2), (0, 0)),
    "from the top right to the bottom left": ((0, 2), (2, 0)),
    "from the bottom left to the top right": ((2, 0), (0, 2)),
}


@dataclass(frozen=True)
class Shape:
    """A shape named by its kind, colour, size and cell. A wide scene's shape also says exactly where and
    how it is drawn; otherwise it is drawn near its cell's centre, in its colour's palette shade."""

    kind: str
    colour: str
    size: str
    row: int
    column: int
    x: float | None = None  # its centre, as a share of the picture's width and height
    y: float | None = None
    extent: float | None = None  # half its width, as a share of the picture's shorter side
    rgb: tuple[int, int, int] | None = None

    def describe(self) -> str:
        return f"a {self.size} {self.colour} {self.kind}"


@dataclass
class Scene:
    """Shapes in distinct cells, in reading order, on a background drawn from `background_seed`; drawn
    smooth (anti-aliased) or not, then with `noise` (its standard deviation) and as a JPEG of
    `jpeg_quality`, where set."""

    shapes: list[Shape]
    background_seed: int = 0
    width: int = 96
    height: int = 96
    smooth: bool = False
    noise: float = 0.0
    jpeg_quality: int | None = None


@dataclass
class Motion:
    """One shape moving straight across a clip of `frames` frames: from its cell to the direction's end
    cell, or (a wide clip's shape, which says where it starts) to `end`."""

    shape: Shape
    direction: str
    frames: int = 8
    background_seed: int = 0
    size: int = 96
    jitter: list[tuple[float, float]] = field(default_factory=list)
    end: tuple[float, float] | None = None


# -- colour names ----------------------------------------------------------------------------------------


def _rgb(anchor: str | tuple[int, int, int]) -> tuple[int, int, int]:
    return anchor if isinstance(anchor, tuple) else ImageColor.getrgb(anchor)


ANCHORS: list[tuple[str | None, tuple[int, int, int]]] = [
    *COLOURS.items(),
    *((name, _rgb(a)) for name, anchors in SHADES.items() for a in anchors),
]


def colour_name(rgb: tuple[int, int, int]) -> str | None:
    """The colour name of a shade: its nearest anchor's, or None for a grey or a shade near the boundary
    of two names (less than SHADE_MARGIN nearer the one than the other)."""
    nearest: dict[str | None, float] = {}
    for name, anchor in ANCHORS:
        nearest[name] = min(nearest.get(name, math.inf), math.dist(rgb, anchor))
    (name, own), (_, other) = sorted(nearest.items(), key=lambda item: item[1])[:2]
    return name if other - own >= SHADE_MARGIN else None


def random_shade(rng: random.Random, name: str) -> tuple[int, int, int]:
    """A shade that `colour_name` names `name`: an anchor of that name, each channel moved up to 40."""
    anchors = [rgb for n, rgb in ANCHORS if n == name]
    while True:
        rgb = tuple(min(255, max(0, c + rng.randint(-40, 40))) for c in rng.choice(anchors))
        if colour_name(rgb) == name:
            return rgb


# -- making scenes ----------------------------------------------------------------------------------------


def random_shape(rng: random.Random, row: int, column: int) -> Shape:
    return Shape(rng.choice(KINDS), rng.choice(list(COLOURS)), rng.choice(SIZES), row, column)


def random_scene(rng: random.Random, count: int | None = None, most: int = 4, wide: bool = False) -> Scene:
    """1 to `most` shapes (or `count`). The first model's scenes: in random cells, the picture 96 px square
    or, now and then, larger or oblong (the processor brings it to 8 x 8 tokens or near). Wide ones:
    see `_wide_scene`."""
    count = count if count is not None else rng.randint(1, most)
    if wide:
        return _wide_scene(rng, count)
    cells = sorted(rng.sample([(r, c) for r in range(3) for c in range(3)], count))
    width, height = rng.choice([(96, 96)] * 6 + [(192, 192), (288, 288), (384, 384), (480, 360), (360, 480)])
    return Scene([random_shape(rng, r, c) for r, c in cells], rng.randrange(1 << 30), width, height)


def _wide_scene(rng: random.Random, count: int) -> Scene:
    """`count` shapes anywhere (their centres in distinct cells, away from the cells' edges), each of
    either size, overlapping a little at most, in a shade of its colour; the picture square half the
    time (96-320 px), else any size up to 320 px of aspect ratio 0.6-1.67 (larger ones, brought to the
    model's 256 x 256 by its processor, would look the same and cost more to draw)."""
    if rng.random() < 0.5:
        width = height = rng.choice((96, 128, 160, 192, 256, 320))
    else:
        width = rng.randint(96, 320)
        height = min(320, max(96, round(width / rng.uniform(0.6, 1.67))))
    short = min(width, height)
    shapes: list[Shape] = []
    tries = 0
    while len(shapes) < count:
        tries += 1
        if tries % 200 == 0:  # (large shapes that leave no room: start again)
            shapes = []
        size = rng.choice(SIZES)
        extent = rng.uniform(*EXTENTS[size])
        x = rng.uniform(extent * short / width, 1 - extent * short / width)
        y = rng.uniform(extent * short / height, 1 - extent * short / height)
        row, column = int(y * 3), int(x * 3)
        if any(abs(v - edge) < EDGE_MARGIN for v in (x, y) for edge in (1 / 3, 2 / 3)):
            continue
        if any((s.row, s.column) == (row, column) for s in shapes):
            continue
        gaps = (math.dist((x * width, y * height), (s.x * width, s.y * height)) / short for s in shapes)
        if any(gap < 0.85 * (extent + s.extent) for gap, s in zip(gaps, shapes)):
            continue
        colour = rng.choice(list(COLOURS))
        shapes.append(Shape(rng.choice(KINDS), colour, size, row, column, x, y, extent, random_shade(rng, colour)))
    shapes.sort(key=lambda s: (s.row, s.column))
    noise = rng.uniform(2, 12) if rng.random() < 0.3 else 0.0
    quality = rng.randint(20, 90) if rng.random() < 0.35 else None
    return Scene(shapes, rng.randrange(1 << 30), width, height, rng.random() < 0.5, noise, quality)


def random_motion(rng: random.Random, wide: bool = False) -> Motion:
    """A clip of one shape moving. The first model's: a large one across the middle row or column. Wide
    ones: of either size and any shade, in eight directions, along any row or column (or corner to
    corner), starting and ending anywhere in the direction's end cells."""
    if not wide:
        direction = rng.choice(list(DIRECTIONS))
        shape = Shape(rng.choice(KINDS), rng.choice(list(COLOURS)), "large", *DIRECTIONS[direction][0])
        frames = rng.choice([4, 6, 8])
        jitter = [(rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1)) for _ in range(frames)]
        return Motion(shape, direction, frames, rng.randrange(1 << 30), rng.choice([96, 96, 192]), jitter)
    direction = rng.choice([*DIRECTIONS, *DIAGONALS])
    (r0, c0), (r1, c1) = {**DIRECTIONS, **DIAGONALS}[direction]
    size = rng.choice(SIZES)
    low, high = EXTENTS[size]
    extent = rng.uniform(low, min(high, 0.16))
    if direction in DIRECTIONS:  # (anywhere across: the row or column it moves along is any)
        if r0 == r1:
            r0 = r1 = rng.randrange(3)
        else:
            c0 = c1 = rng.randrange(3)

    def spot(cell: int) -> float:
        return min(1 - extent, max(extent, (cell + rng.uniform(0.25, 0.75)) / 3))

    x0, y0 = spot(c0), spot(r0)
    x1, y1 = (x0 if c0 == c1 else spot(c1)), (y0 if r0 == r1 else spot(r1))
    colour = rng.choice(list(COLOURS))
    shape = Shape(rng.choice(KINDS), colour, size, r0, c0, x0, y0, extent, random_shade(rng, colour))
    frames = rng.choice([4, 6, 8])
    jitter = [(rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03)) for _ in range(frames)]
    return Motion(shape, direction, frames, rng.randrange(1 << 30), rng.choice([96, 128, 192, 256]), jitter, (x1, y1))


# -- drawing ----------------------------------------------------------------------------------------------


def render(scene: Scene) -> Image.Image:
    rng = random.Random(scene.background_seed)
    wide = [s.rgb for s in scene.shapes if s.rgb is not None]
    image = background(rng, scene.width, scene.height, wide or None)
    if wide:
        image = _draw_wide(image, scene)
    else:
        draw = ImageDraw.Draw(image)
        for shape in scene.shapes:
            cx = (shape.column + 0.5 + rng.uniform(-0.12, 0.12)) / 3
            cy = (shape.row + 0.5 + rng.uniform(-0.12, 0.12)) / 3
            extent = cell_extent(shape, rng, scene.width, scene.height)
            draw_shape(draw, shape, cx * scene.width, cy * scene.height, extent)
    return finish(image, scene.noise, scene.jpeg_quality, rng)


def _draw_wide(image: Image.Image, scene: Scene) -> Image.Image:
    """A wide scene's shapes where they say, the larger first (the smaller stay whole on top); smooth ones
    drawn at twice the size and scaled down (anti-aliased edges, as most drawing programs make them: the
    background, doubled pixel by pixel, comes back as it was)."""
    scale = 2 if scene.smooth else 1
    if scale > 1:
        image = image.resize((scene.width * scale, scene.height * scale), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(image)
    short = min(scene.width, scene.height) * scale
    for shape in sorted(scene.shapes, key=lambda s: -s.extent):
        centre = (shape.x * scene.width * scale, shape.y * scene.height * scale)
        draw_shape(draw, shape, *centre, shape.extent * short)
    return image.reduce(scale) if scale > 1 else image


def finish(image: Image.Image, noise: float, jpeg_quality: int | None, rng: random.Random) -> Image.Image:
    """The picture with pixel noise of standard deviation `noise` and as a JPEG of that quality, if set."""
    if noise:
        pixels = np.asarray(image, dtype=np.float32)
        pixels += np.random.default_rng(rng.randrange(1 << 32)).normal(0, noise, pixels.shape)
        image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    if jpeg_quality is not None:
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=jpeg_quality)
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return image


def render_motion(motion: Motion) -> list[Image.Image]:
    """The clip's frames: the shape's centre goes from its start to its end at even steps."""
    rng = random.Random(motion.background_seed)
    shape = motion.shape
    back = background(rng, motion.size, motion.size, [shape.rgb] if shape.rgb is not None else None)
    if motion.end is None:  # (from cell centre to cell centre, its jitter a share of a cell)
        (r0, c0), (r1, c1) = DIRECTIONS[motion.direction]
        extent = cell_extent(shape, rng, motion.size, motion.size)
    else:
        (x0, y0), (x1, y1), extent = (shape.x, shape.y), motion.end, shape.extent * motion.size
    frames = []
    for i in range(motion.frames):
        t = i / (motion.frames - 1)
        dx, dy = motion.jitter[i] if motion.jitter else (0.0, 0.0)
        if motion.end is None:
            cx = (c0 + (c1 - c0) * t + 0.5 + dx) / 3 * motion.size
            cy = (r0 + (r1 - r0) * t + 0.5 + dy) / 3 * motion.size
        else:
            cx, cy = (x0 + (x1 - x0) * t + dx) * motion.size, (y0 + (y1 - y0) * t + dy) * motion.size
        frame = back.copy()
        draw_shape(ImageDraw.Draw(frame), shape, cx, cy, extent)
        frames.append(frame)
    return frames


def background(
    rng: random.Random, width: int, height: int, avoid: list[tuple[int, int, int]] | None = None
) -> Image.Image:
    """A grey-toned background, white to black (plain, a gradient or blotches, more or less noisy): never one
    of `COLOURS`. With `avoid`, its greys stay clear of those shades (the shapes drawn on it)."""
    low, high = sorted(rng.randint(0, 255) for _ in range(2))
    for _ in range(100 if avoid else 0):  # (greyish shades may leave little room: then it tries no further)
        if min(_grey_distance(rgb, low, high) for rgb in avoid) >= 45:
            break
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


def _grey_distance(rgb: tuple[int, int, int], low: int, high: int) -> float:
    """How far a shade is from the nearest grey between `low` and `high`."""
    grey = min(high, max(low, sum(rgb) / 3))
    return math.dist(rgb, (grey, grey, grey))


def cell_extent(shape: Shape, rng: random.Random, width: int, height: int) -> float:
    """Half the shape's width in pixels: large ones fill most of their cell, small ones about a third."""
    cell = min(width, height) / 3
    return cell * (rng.uniform(0.36, 0.44) if shape.size == "large" else rng.uniform(0.16, 0.22))


def draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, cx: float, cy: float, r: float) -> None:
    colour = shape.rgb or COLOURS[shape.colour]
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


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _listed(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def caption(scene: Scene) -> str:
    """'A large red circle on the left and a small blue triangle at the bottom right.'"""
    text = _listed([f"{shape.describe()} {PLACES[shape.row, shape.column]}" for shape in scene.shapes])
    return text[0].upper() + text[1:] + "."


def shape_answer(scene: Scene) -> str:
    """'A red circle.', or 'There are two shapes: a red circle and a blue triangle.'"""
    named = [f"{_article(shape.colour)} {shape.colour} {shape.kind}" for shape in scene.shapes]
    if len(named) == 1:
        return f"{named[0][0].upper()}{named[0][1:]}."
    return f"There are {NUMBERS[len(named)]} shapes: {_listed(named)}."


def count_answer(scene: Scene) -> str:
    n = len(scene.shapes)
    return f"There {'is' if n == 1 else 'are'} {NUMBERS[n]} shape{'' if n == 1 else 's'}."


def colour_answer(scene: Scene, kind: str) -> str:
    colours = [s.colour for s in scene.shapes if s.kind == kind]
    if not colours:
        return f"There is no {kind}."
    if len(colours) == 1:
        return f"The {kind} is {colours[0]}."
    return f"There are {NUMBERS[len(colours)]} {kind}s: {_listed(colours)}."


def presence_answer(scene: Scene, kind: str) -> str:
    found = [s for s in scene.shapes if s.kind == kind]
    if not found:
        return f"No, there is no {kind}."
    return (
        f"Yes, {found[0].describe()} {PLACES[found[0].row, found[0].column]}."
        if len(found) == 1
        else (f"Yes, there are {NUMBERS[len(found)]} {kind}s.")
    )


def place_answer(scene: Scene, kind: str) -> str:
    """'The circle is at the top left.', or 'There are two circles: at the top left and on the right.'"""
    places = [PLACES[s.row, s.column] for s in scene.shapes if s.kind == kind]
    if not places:
        return f"There is no {kind}."
    if len(places) == 1:
        return f"The {kind} is {places[0]}."
    return f"There are {NUMBERS[len(places)]} {kind}s: {_listed(places)}."


def motion_caption(motion: Motion) -> str:
    colour = motion.shape.colour
    return f"{_article(colour).title()} {colour} {motion.shape.kind} moves {motion.direction}."


def comparison_answer(first: Scene, second: Scene) -> str:
    """'The first image has three shapes and the second has one, so the first has more.'

    Each image's count comes before the verdict: the model answers word by word, so it counts each picture
    (as it does one alone) before it compares. Told the verdict first ("The first image has more shapes:
    three against one."), it had to compare before it had counted, and got 65% of the wide set's pairs
    right while counting 95% of the pictures alone right."""
    a, b = len(first.shapes), len(second.shapes)
    verdict = "neither has more" if a == b else f"the {'first' if a > b else 'second'} has more"
    counts = f"The first image has {NUMBERS[a]} shape{'' if a == 1 else 's'} and the second has {NUMBERS[b]}"
    return f"{counts}, so {verdict}."


PROMPTS = {  # the first model's phrasings of each kind of question
    "caption": (
        "Describe this image.", "Describe the picture.", "What is in this picture?", "What do you see?",
        "Describe this image in one sentence.", "What is in the image?", "What shapes are in this image?",
    ),
    "count": ("How many shapes are there?", "How many shapes do you see?", "Count the shapes."),
    "colour": ("What colour is the {kind}?", "What color is the {kind}?", "Which colour does the {kind} have?"),
    "presence": ("Is there a {kind}?", "Is there a {kind} in the picture?", "Do you see a {kind}?"),
    "motion": ("Describe the video.", "What happens in this video?", "Which way does the shape move?"),
    "compare": ("Which image has more shapes?", "Compare the number of shapes in the two images."),
    "greeting": ("Hello", "Hi", "hello!", "Hi there", "Who are you?", "What can you do?"),
}  # fmt: skip
WIDE_PROMPTS = {  # and the others the wide distribution asks them with
    "caption": (
        "What's in this image?", "Describe what you see.", "Can you describe this picture?",
        "Tell me what is in the image.", "What does this picture show?", "What is in the picture?",
    ),
    "shape": (
        "What shape is in the image?", "What shape is this?", "Which shape do you see?", "What shape do you see?",
        "What kind of shape is it?", "Which shape is in the picture?", "What is the shape?",
    ),
    "count": (
        "How many shapes are in the picture?", "How many objects are there?", "What is the number of shapes?",
        "How many shapes does the image have?",
    ),
    "colour": (
        "What is the colour of the {kind}?", "What is the color of the {kind}?", "Which color is the {kind}?",
        "Tell me the colour of the {kind}.",
    ),
    "colour_one": ("What colour is the shape?", "What color is the shape?", "What colour is it?", "What color is it?"),
    "presence": (
        "Does the image have a {kind}?", "Can you see a {kind}?", "Is there any {kind}?", "Does the picture show a {kind}?",
    ),
    "place": (
        "Where is the {kind}?", "Where is the {kind} in the picture?", "Where do you see the {kind}?",
        "Where's the {kind}?", "In which part of the image is the {kind}?",
    ),
    "motion": (
        "Describe the clip.", "What happens in the clip?", "Which way does it move?", "Where does the shape go?",
        "What moves in the video?",
    ),
    "compare": ("Which picture has more shapes?", "Which of the two images has more shapes?"),
    "greeting": ("Good morning", "Hey", "What are you?", "Help"),
}  # fmt: skip
# questions outside the model's skills, and what it answers them
OTHER_PROMPTS = (
    "What is the capital of {country}?", "Who is the president of {country}?", "What animal is in the picture?",
    "Is this a {thing}?", "What is {a} plus {b}?", "Translate {word} into {language}.", "Write a poem about a {thing}.",
    "What time is it?", "What is the weather like today?", "Tell me a joke.", "How old is the person in the photo?",
    "What does the text say?", "Who painted this?", "What breed is this dog?", "Read the sign for me.",
    "How do I cook {food}?", "Recommend a good book.", "What is your favourite {thing}?", "Summarize this document.",
    "Where was this photo taken?",
)  # fmt: skip
OTHER_FILLERS = {
    "country": ("France", "Japan", "Brazil", "Canada", "Italy", "Kenya", "India", "Spain"),
    "thing": ("cat", "dog", "car", "tree", "house", "bird", "flower", "boat"),
    "word": ("hello", "thank you", "good morning", "water"),
    "language": ("French", "German", "Spanish", "Chinese"),
    "food": ("rice", "pasta", "eggs", "soup"),
}
GREETING_ANSWER = (
    "Hello! I am a small vision-language model trained on pictures of simple shapes. Show me an image of "
    "circles, squares, triangles, stars or diamonds and ask me about it."
)
OTHER_ANSWER = "I can describe shapes: their kinds, colours, number and places, and how they move in a video."
KIND_WEIGHTS = {  # how often each kind of question comes, in each distribution
    False: {"caption": 26, "count": 10, "colour": 22, "presence": 22, "motion": 11, "compare": 8, "greeting": 1},
    True: {"caption": 24, "shape": 14, "count": 8, "colour": 16, "presence": 14, "place": 10, "motion": 18,
           "compare": 6, "greeting": 3, "other": 5},
}  # fmt: skip


@dataclass
class Example:
    """One conversation turn: the media (images, or a clip's frames), the question and its answer."""

    kind: str  # caption | shape | count | colour | presence | place | motion | compare | greeting | other
    question: str
    answer: str
    images: list[Image.Image] = field(default_factory=list)
    video: list[Image.Image] | None = None
    question_first: bool = False  # the question's text comes before the media (as OpenAI's examples have it)
    scenes: list[Scene] = field(default_factory=list)  # what each picture shows (for training's cell loss)


def _prompt(rng: random.Random, kind: str, wide: bool) -> str:
    return rng.choice(PROMPTS.get(kind, ()) + (WIDE_PROMPTS.get(kind, ()) if wide else ()))


def random_example(
    rng: random.Random, most: int = 4, wide: bool = False, weights: dict[str, float] | None = None
) -> Example:
    """A training or test example of a kind drawn with `weights` (the distribution's `KIND_WEIGHTS` unless
    given), its pictures holding at most `most` shapes; its question before the media one time in three, now
    and then in lower case (a wide one's also all in lower or upper case)."""
    weights = weights or KIND_WEIGHTS[wide]
    kind = rng.choices(list(weights), list(weights.values()))[0]
    example = _random_example_of(rng, kind, most, wide)
    example.question_first = rng.random() < 1 / 3
    example.question = typed(rng, example.question, wide)
    return example


def typed(rng: random.Random, question: str, wide: bool = False) -> str:
    """The question as people type it: now and then in lower case, or without its question mark (in the
    wide distribution also all in lower or upper case)."""
    if rng.random() < 1 / 4:
        question = question[0].lower() + question[1:]
    if rng.random() < 1 / 6:
        question = question.rstrip("?.!")
    if wide and rng.random() < 1 / 8:
        question = question.lower() if rng.random() < 0.7 else question.upper()
    return question


def _random_example_of(rng: random.Random, kind: str, most: int, wide: bool) -> Example:
    if kind == "greeting":
        return Example(kind, _prompt(rng, kind, wide), GREETING_ANSWER)
    if kind == "other":
        return other_example(rng, random_scene(rng, most=most, wide=True) if rng.random() < 0.5 else None)
    if kind == "motion":
        return motion_example(rng, random_motion(rng, wide), wide=wide)
    if kind == "compare":
        first, second = random_scene(rng, most=most, wide=wide), random_scene(rng, most=most, wide=wide)
        return compare_example(rng, first, second, [render(first), render(second)], wide)
    scene = random_scene(rng, most=most, wide=wide)
    return scene_example(rng, kind, scene, render(scene), wide)


def scene_example(rng: random.Random, kind: str, scene: Scene, image: Image.Image, wide: bool = False) -> Example:
    """A question of `kind` (caption | shape | count | colour | presence | place) about `scene`, drawn as
    `image`, asked as the first model was (or in any of the wide distribution's ways)."""
    if kind == "caption":
        return Example(kind, _prompt(rng, kind, wide), caption(scene), [image], scenes=[scene])
    if kind == "shape":
        return Example(kind, _prompt(rng, kind, wide), shape_answer(scene), [image], scenes=[scene])
    if kind == "count":
        return Example(kind, _prompt(rng, kind, wide), count_answer(scene), [image], scenes=[scene])
    present = [s.kind for s in scene.shapes]
    absent = [k for k in KINDS if k not in present]
    # presence is asked as often about an absent kind as a present one, so that "Yes" is never a safe guess
    asks_present = not absent or rng.random() < (0.5 if kind == "presence" else 0.75)
    asked = rng.choice(present if asks_present else absent)
    if kind == "colour" and wide and len(present) == 1 and rng.random() < 0.3:
        question = _prompt(rng, "colour_one", wide)  # ("What colour is it?" of the only shape)
        return Example(kind, question, colour_answer(scene, present[0]), [image], scenes=[scene])
    answers = {"colour": colour_answer, "presence": presence_answer, "place": place_answer}
    question = _prompt(rng, kind, wide).format(kind=asked)
    return Example(kind, question, answers[kind](scene, asked), [image], scenes=[scene])


def motion_example(
    rng: random.Random, motion: Motion, frames: list[Image.Image] | None = None, wide: bool = False
) -> Example:
    """A question about the clip of `motion` (its frames drawn once by the caller, or here)."""
    return Example(
        "motion", _prompt(rng, "motion", wide), motion_caption(motion), video=frames or render_motion(motion)
    )


def compare_example(
    rng: random.Random, first: Scene, second: Scene, images: list[Image.Image], wide: bool = False
) -> Example:
    """Which of two scenes, drawn as `images`, has more shapes."""
    return Example(
        "compare", _prompt(rng, "compare", wide), comparison_answer(first, second), images, scenes=[first, second]
    )


def other_example(rng: random.Random, scene: Scene | None) -> Example:
    """A question outside the model's skills (about `scene`'s picture, or with none): it says what it can do."""
    fillers = {name: rng.choice(values) for name, values in OTHER_FILLERS.items()}
    question = rng.choice(OTHER_PROMPTS).format(a=rng.randint(1, 20), b=rng.randint(1, 20), **fillers)
    images, scenes = ([render(scene)], [scene]) if scene is not None else ([], [])
    return Example("other", question, OTHER_ANSWER, images, scenes=scenes)
