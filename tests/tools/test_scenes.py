"""The synthetic scenes the built-in model learns from: what is drawn is what the texts say, in the first
model's distribution (kept as it was: the old held-out set) and in the wide one (shapes anywhere, of any
size and shade, many phrasings, questions outside its skills)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from PIL import ImageColor
from safetensors.torch import load_file

from vlm_serve.builtin.scenes import (
    COLOURS,
    DIAGONALS,
    DIRECTIONS,
    EDGE_MARGIN,
    EXTENTS,
    GREETING_ANSWER,
    KIND_WEIGHTS,
    KINDS,
    OTHER_ANSWER,
    SIZES,
    Example,
    Motion,
    Scene,
    Shape,
    caption,
    colour_answer,
    colour_name,
    comparison_answer,
    count_answer,
    motion_caption,
    place_answer,
    presence_answer,
    random_example,
    random_motion,
    random_scene,
    random_shade,
    render,
    render_motion,
    scene_example,
    shape_answer,
)
from vlm_serve.tools.builtin_train import (
    IGNORE,
    Batches,
    CellProbe,
    Pictures,
    TrainingArgs,
    answer_loss,
    cell_labels,
    exact_match,
    messages,
    parameter_groups,
    patches_as_matmul,
    published_layout,
    train_tower,
    training_layout,
)

SCENE = Scene([Shape("circle", "red", "large", 1, 0), Shape("triangle", "blue", "small", 2, 2)], background_seed=3)


def _training_model(model_dir) -> torch.nn.Module:
    """transformers' model of the checkpoint at `model_dir`, in float32, as the trainer trains it."""
    import transformers

    return transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)


def test_the_texts_name_each_shape_its_colour_size_and_place():
    assert caption(SCENE) == "A large red circle on the left and a small blue triangle at the bottom right."
    assert count_answer(SCENE) == "There are two shapes."
    assert colour_answer(SCENE, "circle") == "The circle is red."
    assert colour_answer(SCENE, "star") == "There is no star."
    assert presence_answer(SCENE, "triangle") == "Yes, a small blue triangle at the bottom right."
    assert presence_answer(SCENE, "square") == "No, there is no square."
    one = Scene([Shape("star", "green", "small", 0, 1)])
    assert caption(one) == "A small green star at the top." and count_answer(one) == "There is one shape."
    assert comparison_answer(SCENE, one) == (
        "The first image has two shapes and the second has one, so the first has more."
    )
    assert comparison_answer(one, SCENE).endswith("one shape and the second has two, so the second has more.")
    assert comparison_answer(one, one).endswith("one shape and the second has one, so neither has more.")


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


def test_the_first_models_distribution_is_kept_as_it_was():
    """(The old held-out set of bench_quality.py is drawn from it: its questions must stay the same.)"""
    drawn = [random_example(random.Random(seed)) for seed in (1, 2, 5, 6)]
    assert [(e.kind, e.question, e.answer) for e in drawn] == [
        ("caption", "What shapes are in this image?", "A large brown star in the center."),
        (
            "compare",
            "Compare the number of shapes in the two images.",
            "The first image has one shape and the second has two, so the second has more.",
        ),
        ("presence", "Is there a square in the picture?", "Yes, there are two squares."),
        ("presence", "Is there a star in the picture?", "No, there is no star."),
    ]
    assert all(s.x is None and s.rgb is None for e in drawn for scene in e.scenes for s in scene.shapes)


def test_named_colours_map_to_the_nearest_of_the_eight_names_and_greys_to_none():
    named = {
        "pink": "pink",
        "hotpink": "pink",
        "lightpink": "pink",
        "brown": "brown",
        "saddlebrown": "brown",
        "sienna": "brown",
        "red": "red",
        "crimson": "red",
        "orange": "orange",
        "gold": "yellow",
        "yellow": "yellow",
        "lime": "green",
        "darkgreen": "green",
        "navy": "blue",
        "royalblue": "blue",
        "purple": "purple",
        "indigo": "purple",
        "white": None,
        "black": None,
        "gray": None,
        "silver": None,
    }
    assert {name: colour_name(ImageColor.getrgb(name)) for name in named} == named
    assert all(colour_name(rgb) == name for name, rgb in COLOURS.items())
    assert colour_name((255, 190, 0)) is None  # (halfway between orange and gold: a boundary shade, never drawn)
    rng = random.Random(0)
    for name in COLOURS:
        shades = {random_shade(rng, name) for _ in range(30)}
        assert len(shades) > 20 and all(colour_name(rgb) == name for rgb in shades)


def test_wide_scenes_put_shapes_of_any_size_anywhere_each_centre_clear_of_the_cells_edges():
    rng = random.Random(0)
    scenes = [random_scene(rng, wide=True) for _ in range(300)]
    shapes = [(scene, s) for scene in scenes for s in scene.shapes]
    assert {len(scene.shapes) for scene in scenes} == {1, 2, 3, 4}
    for scene, s in shapes:
        assert (s.row, s.column) == (int(s.y * 3), int(s.x * 3))
        assert all(abs(v - edge) >= EDGE_MARGIN for v in (s.x, s.y) for edge in (1 / 3, 2 / 3))
        low, high = EXTENTS[s.size]
        assert low <= s.extent <= high and colour_name(s.rgb) == s.colour
        short = min(scene.width, scene.height)
        assert s.extent * short <= s.x * scene.width <= scene.width - s.extent * short  # (inside the picture)
        assert [(t.row, t.column) for t in scene.shapes] == sorted({(t.row, t.column) for t in scene.shapes})
    xs = [s.x for _, s in shapes]
    assert min(xs) < 0.12 and max(xs) > 0.88 and any(0.4 < x < 0.45 for x in xs)  # (not only cell centres)
    assert {scene.width != scene.height for scene in scenes} == {True, False}
    assert any(scene.jpeg_quality for scene in scenes) and any(scene.noise for scene in scenes)


def test_each_wide_shape_is_drawn_where_it_is_in_its_shade():
    rng = random.Random(4)
    for _ in range(20):
        scene = random_scene(rng, wide=True)
        image = render(scene)
        assert image.size == (scene.width, scene.height)
        for s in scene.shapes:
            pixel = image.getpixel((int(s.x * scene.width), int(s.y * scene.height)))
            assert all(abs(a - b) < 60 for a, b in zip(pixel, s.rgb)), (s, pixel)


def test_wide_clips_move_in_eight_directions_the_way_their_captions_say():
    rng = random.Random(2)
    motions = [random_motion(rng, wide=True) for _ in range(200)]
    assert {m.direction for m in motions} == {*DIRECTIONS, *DIAGONALS}
    motion = next(m for m in motions if m.direction == "from the bottom left to the top right")
    assert motion_caption(motion).endswith(f"{motion.shape.kind} moves from the bottom left to the top right.")

    def centre(frame, shade: torch.Tensor) -> tuple[float, float]:
        mask = (torch.tensor(np.array(frame), dtype=torch.int32) - shade).abs().max(-1).values < 30
        ys, xs = mask.nonzero().float().mean(0).tolist()
        return xs, ys

    for direction, ((r0, c0), (r1, c1)) in {**DIRECTIONS, **DIAGONALS}.items():
        for clip in [m for m in motions if m.direction == direction][:3]:
            frames = render_motion(clip)
            shade = torch.tensor(clip.shape.rgb)
            (x0, y0), (x1, y1) = centre(frames[0], shade), centre(frames[-1], shade)
            for moved, step in ((x1 - x0, c1 - c0), (y1 - y0, r1 - r0)):  # across (a third or more) or along
                assert moved * step > clip.size / 3 if step else abs(moved) < clip.size / 10, (direction, moved)


def test_the_wide_distribution_asks_what_shape_and_where_and_answers_off_skill_questions_with_its_skills():
    two = Scene([Shape("circle", "orange", "large", 0, 0), Shape("circle", "blue", "small", 1, 2)])
    assert shape_answer(Scene(two.shapes[:1])) == "An orange circle."
    assert shape_answer(two) == "There are two shapes: an orange circle and a blue circle."
    assert place_answer(two, "circle") == "There are two circles: at the top left and on the right."
    assert place_answer(SCENE, "triangle") == "The triangle is at the bottom right."
    assert place_answer(SCENE, "star") == "There is no star."
    examples = [random_example(random.Random(seed), wide=True) for seed in range(400)]
    kinds = {e.kind for e in examples}
    assert kinds == {
        "caption",
        "shape",
        "count",
        "colour",
        "presence",
        "place",
        "motion",
        "compare",
        "greeting",
        "other",
    }
    other = [e for e in examples if e.kind == "other"]
    assert all(e.answer == OTHER_ANSWER for e in other) and len({e.question for e in other}) > 10
    assert any(e.images for e in other) and any(not e.images for e in other)
    assert any(e.question.isupper() for e in examples) and any(e.question.islower() for e in examples)


def test_examples_are_reproducible_from_a_seed():
    for wide in (False, True):
        a, b = random_example(random.Random(7), wide=wide), random_example(random.Random(7), wide=wide)
        assert (a.kind, a.question, a.answer) == (b.kind, b.question, b.answer)
        assert [np.asarray(i).tolist() for i in a.images] == [np.asarray(i).tolist() for i in b.images]


def test_trained_weights_are_written_in_the_published_layout(tiny_moe_dir):
    model = _training_model(tiny_moe_dir)
    written = published_layout(model)
    published = load_file(str(tiny_moe_dir / "model.safetensors"))
    assert written.keys() == published.keys()
    assert all(torch.equal(written[name], published[name]) for name in published)


def test_training_goes_on_from_the_published_weights_it_wrote(tiny_moe_dir):
    """`--init-from`: the published layout read back into a fresh model gives every weight again."""
    import transformers

    model = _training_model(tiny_moe_dir)
    fresh = transformers.Qwen3VLMoeForConditionalGeneration(model.config).float()
    fresh.load_state_dict(training_layout(fresh, published_layout(model)))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_the_curriculum_can_keep_pictures_to_one_shape():
    rng = random.Random(0)
    assert {len(random_scene(rng, most=1).shapes) for _ in range(50)} == {1}
    assert {len(random_scene(rng).shapes) for _ in range(200)} == {1, 2, 3, 4}


def test_a_share_of_the_training_examples_come_from_the_first_models_distribution(tiny_moe_dir, monkeypatch):
    import vlm_serve.tools.builtin_train as train

    drawn: list[tuple[bool, dict | None]] = []

    def recorded(rng, most=4, wide=False, weights=None):
        drawn.append((wide, weights))
        return random_example(rng, most, wide, weights)

    monkeypatch.setattr(train, "random_example", recorded)
    wide_weights = TrainingArgs(kind_weights="caption=40").wide_weights()
    for old_share in (0.0, 0.5):
        drawn.clear()
        batches = list(
            Batches(
                tiny_moe_dir,
                seed=0,
                steps=2,
                single_steps=0,
                batch_size=16,
                old_share=old_share,
                wide_weights=wide_weights,
            )
        )
        assert len(batches) == 2 and all(len(batch["input_ids"]) == 16 for batch in batches)
        assert len(drawn) == 32
        old = [weights for wide, weights in drawn if not wide]
        assert len(old) == 0 if old_share == 0 else 8 <= len(old) <= 24
        assert old == [None] * len(old)  # the first distribution keeps its own weights (its held-out set's)
        assert all(weights is wide_weights for wide, weights in drawn if wide)


def test_kind_weights_change_how_often_the_wide_examples_ask_each_kind():
    weights = TrainingArgs(kind_weights="caption=40, compare=0").wide_weights()
    assert weights == {**KIND_WEIGHTS[True], "caption": 40, "compare": 0}
    rng = random.Random(0)
    kinds = [random_example(rng, wide=True, weights=weights).kind for _ in range(300)]
    usual_share = KIND_WEIGHTS[True]["caption"] / sum(KIND_WEIGHTS[True].values())  # 20%; now 31%
    assert "compare" not in kinds and kinds.count("caption") > 300 * usual_share * 1.3
    assert TrainingArgs().wide_weights() == KIND_WEIGHTS[True]
    all_zero = ",".join(f"{kind}=0" for kind in KIND_WEIGHTS[True])
    for wrong, named in (
        ("captoin=3", "no question kind 'captoin'"),
        ("caption=many", "weight 'many'"),
        ("caption=-1", "must be 0 or more"),
        ("caption=nan", "must be 0 or more"),
        (all_zero, "every weight is 0"),
    ):
        with pytest.raises(ValueError, match=named):
            TrainingArgs(kind_weights=wrong).wide_weights()


def test_the_trainers_probe_scores_answers_of_any_length_and_nothing_past_them(tiny_moe_dir):
    from vlm_serve.multimodal.processor import MultimodalProcessor
    from vlm_serve.tokenizer import Tokenizer

    processor = MultimodalProcessor.from_pretrained(tiny_moe_dir, Tokenizer.from_pretrained(tiny_moe_dir), cache_mb=0)
    end = processor.tokenizer.token_to_id("<|im_end|>")

    class Answers(torch.nn.Module):
        """Says `text` (as far as it is let), then ends its turn."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.ids = processor.tokenizer.encode(text) + [end]

        def generate(self, input_ids, max_new_tokens, **_):
            return torch.cat([input_ids, torch.tensor([self.ids[:max_new_tokens]])], dim=1)

    greeting = Example("greeting", "Hello", GREETING_ANSWER)
    assert len(processor.tokenizer.encode(GREETING_ANSWER)) > 64
    assert exact_match(Answers(GREETING_ANSWER), processor, [greeting]) == {"greeting": 1.0}
    assert exact_match(Answers(GREETING_ANSWER + " Ask me anything."), processor, [greeting]) == {"greeting": 0.0}


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


def test_each_picture_token_is_taught_what_is_centred_in_its_part_of_the_picture():
    cells = cell_labels(SCENE, 3, 3)
    empty = [len(COLOURS), len(KINDS), len(SIZES)]
    assert cells[3] == [list(COLOURS).index("red"), KINDS.index("circle"), SIZES.index("large")]  # middle left
    assert cells[8] == [list(COLOURS).index("blue"), KINDS.index("triangle"), SIZES.index("small")]  # bottom right
    assert [i for i, c in enumerate(cells) if c == empty] == [0, 1, 2, 4, 5, 6, 7]
    # an oblong picture's 2 x 3 tokens; the shape's centre (not its cell) decides
    star = Shape("star", "green", "small", 0, 2, x=0.9, y=0.45, extent=0.06, rgb=COLOURS["green"])
    cells = cell_labels(Scene([star]), 2, 3)
    assert [i for i, c in enumerate(cells) if c != empty] == [2]


def test_the_patch_embedding_trains_as_the_matrix_product_it_is(tiny_moe_dir):
    model = _training_model(tiny_moe_dir)
    embed = model.model.visual.patch_embed
    patches = torch.randn(12, embed.proj.weight[0].numel())
    want = embed(patches)
    patches_as_matmul(embed)
    torch.testing.assert_close(embed(patches), want, rtol=1e-5, atol=1e-5)


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


def _probe_reading_its_tokens(model_dir) -> tuple[CellProbe, torch.Tensor, torch.Tensor]:
    """A cell probe whose read-out is the identity on the first classes, two shapes' tokens and an empty
    one's (their features: the presence logit, then their labels one-hot), and the tokens' cells."""
    model = _training_model(model_dir)
    probe = CellProbe(model)
    classes = probe.head.out_features
    cells = torch.tensor([[0, 1, 0], [2, 3, 1], [len(COLOURS), len(KINDS), len(SIZES)]])
    tokens = torch.zeros(3, model.config.get_text_config().hidden_size)
    for row, (colour, kind, size) in enumerate(cells.tolist()[:2]):
        tokens[row, 0] = 4.0
        for offset, label in zip((1, 1 + len(COLOURS), 1 + len(COLOURS) + len(KINDS)), (colour, kind, size)):
            tokens[row, offset + label] = 4.0
    tokens[2, 0] = -4.0
    with torch.no_grad():
        probe.head.weight.zero_()
        probe.head.weight[:, :classes] = torch.eye(classes)
        probe.head.bias.zero_()
    return probe, tokens, cells


def _probe_loss(probe: CellProbe, tokens: torch.Tensor, cells: torch.Tensor) -> float:
    grid = torch.tensor([[1, 2, 2]])
    probe.seen = [(grid, tokens)]
    return probe.loss(grid, cells).item()


def test_the_cell_probe_reports_what_it_reads_right_of_the_tokens_holding_a_shape(tiny_moe_dir):
    probe, tokens, cells = _probe_reading_its_tokens(tiny_moe_dir)
    kind = 1 + len(COLOURS)
    tokens[1, kind + 3], tokens[1, kind + 4] = 0.0, 4.0  # the second shape's kind read wrong
    _probe_loss(probe, tokens, cells)
    assert probe.accuracy == {"colour": 1.0, "kind": 0.5, "size": 1.0}


def test_the_cell_probe_teaches_an_empty_token_only_that_nothing_is_centred_there(tiny_moe_dir):
    probe, tokens, cells = _probe_reading_its_tokens(tiny_moe_dir)
    loss = _probe_loss(probe, tokens, cells)
    tokens[2, 1:] = torch.randn(tokens.shape[1] - 1)  # whatever colour, kind and size it reads
    assert _probe_loss(probe, tokens, cells) == pytest.approx(loss)
    tokens[2, 0] = 4.0  # ... but not that a shape is centred there
    assert _probe_loss(probe, tokens, cells) > loss + 0.1


def test_the_cell_probe_weighs_a_wrong_kind_more_than_a_wrong_colour_or_size(tiny_moe_dir):
    def loss_with_second_read(part_offset: int, wrong: int, right: int) -> float:
        probe, tokens, cells = _probe_reading_its_tokens(tiny_moe_dir)
        tokens[1, part_offset + right], tokens[1, part_offset + wrong] = 0.0, 4.0
        return _probe_loss(probe, tokens, cells)

    colour = loss_with_second_read(1, 0, 2) - loss_with_second_read(1, 2, 2)
    kind = loss_with_second_read(1 + len(COLOURS), 0, 3) - loss_with_second_read(1 + len(COLOURS), 3, 3)
    assert kind == pytest.approx(CellProbe.KIND_WEIGHT * colour, rel=1e-4)


def test_pictures_come_with_what_each_of_their_tokens_is_taught(tiny_moe_dir):
    batch = next(iter(Pictures(tiny_moe_dir, seed=0, steps=1, batch_size=3)))
    grid = batch["image_grid_thw"]
    assert len(grid) == 3 and batch["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    assert batch["cell_labels"].shape == (int(grid.prod(-1).sum()) // 4, 3)  # one row per merged token
    assert (batch["cell_labels"][:, 1] != len(KINDS)).sum() >= 3  # each picture holds a shape


@pytest.mark.server
def test_the_vision_tower_can_train_alone_first_leaving_the_language_model_as_it_was(tiny_moe_dir):
    model = _training_model(tiny_moe_dir)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    probe = CellProbe(model)
    model.train()
    train_tower(model, probe, tiny_moe_dir, TrainingArgs(vision_steps=2, vision_batch_size=2))
    changed = {name for name, t in model.state_dict().items() if not torch.equal(t, before[name])}
    assert "model.visual.patch_embed.proj.weight" in changed and "model.visual.merger.linear_fc2.weight" in changed
    assert all(name.startswith("model.visual.") for name in changed)
    assert set(probe.accuracy) == {"colour", "kind", "size"}


def test_the_whole_models_steps_can_train_the_vision_tower_at_a_lower_rate(tiny_moe_dir):
    model = _training_model(tiny_moe_dir)
    probe = CellProbe(model)
    rest, tower = parameter_groups(model, probe, TrainingArgs(lr=1e-3, tower_lr_scale=0.1))
    assert tower["lr"] == pytest.approx(1e-4) and "lr" not in rest  # (the optimizer's own: 1e-3)
    assert {id(p) for p in tower["params"]} == {id(p) for p in model.model.visual.parameters()}
    every = [*model.parameters(), *probe.parameters()]
    assert sorted(map(id, rest["params"] + tower["params"])) == sorted(map(id, every))  # each once


@pytest.mark.server
def test_a_run_that_goes_on_from_another_records_the_runs_it_came_from(tmp_path):
    """A shipped model trained in parts (runs longer than a session) says every part's settings."""
    from vlm_serve.tools.builtin_train import train

    first, second = tmp_path / "first", tmp_path / "second"
    train(first, TrainingArgs(steps=1, batch_size=2, eval_every=0))
    train(second, TrainingArgs(steps=1, batch_size=2, eval_every=0, seed=1, init_from=first))
    record = json.loads((second / "training.json").read_text())
    assert record["init_from_training"] == json.loads((first / "training.json").read_text())
    assert "init_from_training" not in record["init_from_training"]  # the first began from a seed
