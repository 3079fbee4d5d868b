"""The engine's model agrees with transformers' Qwen3-VL classes on the same checkpoint and inputs.

Both sides get the same processed inputs (our processor's ids, pixel values and grids; the processor
itself is checked against transformers' in test_preprocess). Prefill logits must agree at every prompt
position and 16 greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import hf_inputs
from vlm_serve.engine import Engine
from vlm_serve.llm.models.loader import load_vision_model
from vlm_serve.testing.logits import prefill_logits
from vlm_serve.testing.media import make_image, make_video

HF_CLASSES = {
    "moe": transformers.Qwen3VLMoeForConditionalGeneration,
    "dense": transformers.Qwen3VLForConditionalGeneration,
}


@pytest.fixture(scope="module", params=["moe", "dense"])
def pair(request, tiny_moe_dir, tiny_dense_dir):
    path = tiny_moe_dir if request.param == "moe" else tiny_dense_dir
    engine = Engine(path, dtype="float32", max_total_tokens=8192, max_running_requests=16)
    hf = HF_CLASSES[request.param].from_pretrained(path, dtype=torch.float32).eval()
    return engine, hf


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    return make_video(tmp_path_factory.mktemp("video") / "clip.mp4", num_frames=12, fps=6, size=(64, 96))


def _conversations(video_path) -> dict[str, list[dict]]:
    def user(*parts):
        return [{"role": "user", "content": list(parts)}]

    text = {"type": "text", "text": "Describe what you see in a few words."}
    return {
        "text": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a story about a cat."},
        ],
        "one_image": user({"type": "image", "image": make_image(96, 64, seed=1)}, text),
        "images_of_different_sizes": user(
            {"type": "image", "image": make_image(64, 64, seed=2)},
            {"type": "image", "image": make_image(160, 96, seed=3)},
            {"type": "image", "image": make_image(48, 200, seed=4)},
            text,
        ),
        "video": user({"type": "video", "video": str(video_path)}, text),
        "image_and_video": user(
            {"type": "image", "image": make_image(80, 120, seed=5)},
            {"type": "video", "video": str(video_path)},
            text,
        ),
    }


CASES = ["text", "one_image", "images_of_different_sizes", "video", "image_and_video"]


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers(pair, video_path, case):
    engine, hf = pair
    processed = engine.processor.process_messages(_conversations(video_path)[case], add_generation_prompt=True)
    inputs = hf_inputs(engine, processed)
    with torch.no_grad():
        ref_logits = hf(**inputs).logits[0]
    ours = prefill_logits(engine.scheduler, processed.input_ids, processed.mm_items)
    scale = ref_logits.abs().max()
    assert (ours - ref_logits).abs().max() < 1e-4 * scale

    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    ref_tokens = ref[0, len(processed.input_ids) :].tolist()
    out = engine.generate_processed([processed], max_tokens=16, temperature=0, ignore_eos=True)[0]
    assert out.token_ids == ref_tokens


def test_vision_embeddings_and_deepstack_match_transformers(pair, video_path):
    """The vision tower as an encoder rank loads it (from the checkpoint's vision weights alone)."""
    engine, hf = pair
    visual = load_vision_model(engine.model_config, torch.device("cpu"), torch.float32)
    conv = _conversations(video_path)["image_and_video"]
    items = engine.processor.process_messages(conv, add_generation_prompt=True).mm_items
    grids = [it.grid_thw for it in items]
    pixels = torch.cat([it.pixel_values for it in items])
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=torch.tensor(grids))
        ours = visual(pixels, grids)
    assert len(ours.deepstack) == len(ref.deepstack_features) > 0
    for a, b in zip([ours.embeds, *ours.deepstack], [ref.pooler_output, *ref.deepstack_features]):
        assert (a - b).abs().max() < 1e-5 * b.abs().max()


def test_batched_requests_match_each_alone(pair, video_path):
    """Several requests of different lengths and media in one batch give each one's solo tokens."""
    engine, _ = pair
    convs = list(_conversations(video_path).values())
    processed = [engine.processor.process_messages(c, add_generation_prompt=True) for c in convs]
    together = engine.generate_processed(processed, max_tokens=8, temperature=0, ignore_eos=True)
    alone = [engine.generate_processed([p], max_tokens=8, temperature=0, ignore_eos=True)[0] for p in processed]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    engine.scheduler.check_memory()
