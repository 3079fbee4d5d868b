"""The synthetic scenes the built-in model learns from: what is drawn is what the texts say."""

from __future__ import annotations

import random

import numpy as np
import torch
from safetensors.torch import load_file

from vlm_serve.builtin.scenes import (
    COLOURS, KINDS, SIZES, Motion, Scene, Shape, caption, colour_answer, comparison_answer, count_answer,
    presence_answer, random_example, random_scene, render, render_motion, scene_example,
)  # fmt: skip
from vlm_serve.builtin.train import IGNORE, answer_loss, cell_labels, messages, published_layout

SCENE = Scene([Shape("circle", "red", "large", 1, 0), Shape("triangle", "blue", "small", 2, 2)], background_seed=3)


def test_the_texts_name_each_shape_its_colour_size_and_place():
    assert caption(SCENE) == "A large red circle on the left and a small blue triangle at the bottom right."
    assert count_answer(SCENE) == "There are two shapes."
    assert colour_answer(SCENE, "circle") == "The circle is red."
    assert colour_answer(SCENE, "star") == "There is no star."
    assert presence_answer(SCENE, "triangle") == "Yes, a small blue triangle at the bottom right."
    assert presence_answer(SCENE, "square") == "No, there is no square."
    one = Scene([Shape("star", "green", "small", 0, 1)])
    assert caption(one) == "A small green star at the top." and count_answer(one) == "There is one shape."
    assert comparison_answer(SCENE, one) == "The first image has more shapes: two against one."


def _near(pixel, colour) -> bool:
    return all(abs(a - b) < 40 for a, b in zip(pixel, colour))


def test_each_shape_is_drawn_in_its_cell_in_its_colour():
    for width, height in ((96, 96), (384, 384), (480, 360)):
        image = render(Scene(SCENE.shapes, 3, width, height))
        assert image.size == (width, height)
        assert _near(image.getpixel((width // 6, height // 2)), COLOURS["red"])  # the circle's cell centre
        assert not _near(image.getpixel((width // 2, height // 2)), COLOURS["red"])  # the empty centre cell


def test_a_moving_shape_goes_the_way_its_caption_says():
    frames = render_motion(Motion(Shape("square", "yellow", "large", 1, 0), "from left to right", frames=6))

    def centre_x(frame) -> float:
        pixels = torch.tensor(np.array(frame), dtype=torch.int32)
        mask = (pixels - torch.tensor(COLOURS["yellow"])).abs().max(-1).values < 40
        return mask.nonzero()[:, 1].float().mean().item()

    xs = [centre_x(f) for f in frames]
    assert xs == sorted(xs) and xs[-1] - xs[0] > 40


def test_examples_are_reproducible_from_a_seed():
    a, b = random_example(random.Random(7)), random_example(random.Random(7))
    assert (a.kind, a.question, a.answer) == (b.kind, b.question, b.answer)
    assert [np.asarray(i).tolist() for i in a.images] == [np.asarray(i).tolist() for i in b.images]


def test_trained_weights_are_written_in_the_published_layout(tiny_moe_dir):
    import transformers

    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    written = published_layout(model)
    published = load_file(str(tiny_moe_dir / "model.safetensors"))
    assert written.keys() == published.keys()
    assert all(torch.equal(written[name], published[name]) for name in published)


def test_the_curriculum_can_keep_pictures_to_one_shape():
    rng = random.Random(0)
    assert {len(random_scene(rng, most=1).shapes) for _ in range(50)} == {1}
    assert {len(random_scene(rng).shapes) for _ in range(200)} == {1, 2, 3, 4}


def test_questions_come_as_people_ask_them_text_first_or_last_in_any_case():
    examples = [random_example(random.Random(seed)) for seed in range(300)]
    first = [e for e in examples if e.question_first]
    assert 0.2 < len(first) / len(examples) < 0.45
    assert any(e.question[0].islower() for e in examples) and any(e.question[0].isupper() for e in examples)
    assert any(not e.question.endswith(("?", ".", "!")) for e in examples)
    one_picture = [e for e in examples if len(e.images) == 1]
    for first in (True, False):
        example = next(e for e in one_picture if e.question_first == first)
        parts = [p["type"] for p in messages(example)[0]["content"]]
        assert parts == (["text", "image"] if example.question_first else ["image", "text"])


def test_each_picture_token_is_taught_what_its_cell_holds():
    cells = cell_labels(SCENE)
    empty = [len(COLOURS), len(KINDS), len(SIZES)]
    assert cells[3] == [list(COLOURS).index("red"), KINDS.index("circle"), SIZES.index("large")]  # middle left
    assert cells[8] == [list(COLOURS).index("blue"), KINDS.index("triangle"), SIZES.index("small")]  # bottom right
    assert [i for i, c in enumerate(cells) if c == empty] == [0, 1, 2, 4, 5, 6, 7]


def test_is_there_questions_ask_as_often_about_an_absent_kind_as_a_present_one():
    rng = random.Random(0)
    scenes = [random_scene(rng) for _ in range(400)]
    asked = [scene_example(rng, "presence", scene, None) for scene in scenes]
    absent = sum(e.answer.startswith("No") for e in asked)
    assert 0.4 < absent / len(asked) < 0.6


def test_each_example_weighs_the_same_in_the_answers_loss_whatever_its_length():
    logits = torch.randn(2, 8, 5)
    labels = torch.full((2, 8), IGNORE)
    labels[0, 6:], labels[1, 1:] = torch.tensor([1, 2]), torch.tensor([3, 0, 4, 1, 2, 3, 0])  # 2 and 7 tokens
    per_example = [
        torch.nn.functional.cross_entropy(logits[row, :-1], labels[row, 1:], ignore_index=IGNORE) for row in (0, 1)
    ]
    assert torch.allclose(answer_loss(logits, labels), (per_example[0] + per_example[1]) / 2)
