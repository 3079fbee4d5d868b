"""Content hashes of media items, the byte-budgeted LRU cache, and the processed-input cache in the
multimodal processor."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vlm_serve.multimodal.processor as processor_module
from vlm_serve.cli import build_parser
from vlm_serve.config import ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.mm_cache.cache import MultimodalCache
from vlm_serve.mm_cache.hashing import media_hash
from vlm_serve.multimodal.items import MultimodalItem
from vlm_serve.multimodal.processor import MediaInput, MultimodalProcessor
from vlm_serve.testing.media import make_image, make_video
from vlm_serve.tokenizer import Tokenizer

ONE_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def tokenizer(tiny_dense_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dense_dir)


@pytest.fixture
def uncached(tiny_dense_dir, tokenizer) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(tiny_dense_dir, tokenizer)


@pytest.fixture
def cached(tiny_dense_dir, tokenizer) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(tiny_dense_dir, tokenizer, cache_mb=64)


@pytest.fixture(scope="module")
def png_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("images") / "picture.png"
    make_image(120, 90, seed=1).save(path)
    return path


@pytest.fixture(scope="module")
def video_file(tmp_path_factory) -> Path:
    return make_video(tmp_path_factory.mktemp("videos") / "clip.mp4", num_frames=20, fps=10, size=(64, 48))


def image_hash(processor: MultimodalProcessor, source, **options) -> int:
    (item,) = processor.process(ONE_IMAGE, images=[MediaInput(source, options)]).mm_items
    return item.hash


def video_hash(processor: MultimodalProcessor, source, **options) -> int:
    (item,) = processor.process(ONE_VIDEO, videos=[MediaInput(source, options)]).mm_items
    return item.hash


def assert_same_item(item: MultimodalItem, reference: MultimodalItem) -> None:
    assert item.modality == reference.modality and item.grid_thw == reference.grid_thw
    assert torch.equal(item.pixel_values, reference.pixel_values)
    assert item.spans == reference.spans and item.timestamps == reference.timestamps
    assert item.hash == reference.hash is not None


# -- content hashes ----------------------------------------------------------------------------------


def test_the_same_bytes_hash_equal_from_a_path_a_data_url_and_raw_bytes(uncached, png_file):
    data = png_file.read_bytes()
    hashes = {image_hash(uncached, source) for source in (str(png_file), png_file, data_url(data), data)}
    assert len(hashes) == 1 and hashes.pop().bit_length() > 64  # a 128-bit hash


def test_different_bytes_hash_differently(uncached):
    a, b = png_bytes(make_image(64, 64, seed=1)), png_bytes(make_image(64, 64, seed=2))
    assert image_hash(uncached, a) != image_hash(uncached, b)


def test_the_same_picture_in_another_encoding_is_another_item(uncached):
    image = make_image(64, 64, seed=1)
    jpeg = io.BytesIO()
    image.save(jpeg, "JPEG", quality=100)
    assert image_hash(uncached, png_bytes(image)) != image_hash(uncached, jpeg.getvalue())


def test_image_pixel_limits_are_part_of_the_hash(uncached, png_file):
    default = image_hash(uncached, png_file)
    smaller = image_hash(uncached, png_file, max_pixels=32 * 32 * 4)
    larger = image_hash(uncached, png_file, min_pixels=32 * 32 * 64)
    assert len({default, smaller, larger}) == 3
    # An override equal to the checkpoint's own value changes nothing about the processed item.
    assert image_hash(uncached, png_file, max_pixels=uncached.image_processor.config.max_pixels) == default


def test_video_settings_are_part_of_the_hash(uncached, video_file):
    default = video_hash(uncached, video_file)
    variants = [
        video_hash(uncached, video_file, fps=4.0),
        video_hash(uncached, video_file, max_frames=6),
        video_hash(uncached, video_file, max_pixels=32 * 32 * 16),
        video_hash(uncached, video_file, min_pixels=32 * 32 * 256),
    ]
    assert len({default, *variants}) == 5


def test_the_modality_is_part_of_the_hash(uncached, video_file):
    data, settings = video_file.read_bytes(), uncached.image_processor.config
    assert media_hash(data, "image", settings) != media_hash(data, "video", settings)


def test_pil_images_hash_their_pixels(uncached):
    a = make_image(80, 60, seed=3)
    b = Image.fromarray(np.asarray(a).copy())  # another object, equal pixels
    changed = np.asarray(a).copy()
    changed[0, 0, 0] ^= 1
    assert image_hash(uncached, a) == image_hash(uncached, b)
    assert image_hash(uncached, a) != image_hash(uncached, Image.fromarray(changed))
    assert image_hash(uncached, a) != image_hash(uncached, a.convert("RGBA"))  # mode counts


def test_pil_palette_images_with_equal_indices_but_other_colours_hash_differently(uncached):
    indices = np.arange(64 * 64, dtype=np.uint8).reshape(64, 64) % 16
    a, b = Image.fromarray(indices, "P"), Image.fromarray(indices, "P")
    a.putpalette([v for i in range(256) for v in (i, 0, 0)])
    b.putpalette([v for i in range(256) for v in (0, i, 0)])
    assert image_hash(uncached, a) != image_hash(uncached, b)


# -- the cache ---------------------------------------------------------------------------------------


def test_least_recently_used_entries_are_evicted_first():
    cache: MultimodalCache[str] = MultimodalCache(budget_bytes=30)
    for key in (1, 2, 3):
        assert cache.put(key, f"v{key}", 10)
    assert cache.get(1) == "v1"  # 2 is now the least recently used
    assert cache.put(4, "v4", 10)
    assert 2 not in cache and all(k in cache for k in (1, 3, 4))
    assert cache.put(5, "v5", 20)  # makes room by evicting 3, then 1
    assert sorted(k for k in (1, 2, 3, 4, 5) if k in cache) == [4, 5]
    assert cache.usage_bytes == 30 and cache.evictions == 3


def test_usage_never_exceeds_the_budget():
    rng = random.Random(0)
    cache: MultimodalCache[int] = MultimodalCache(budget_bytes=1000)
    sizes: dict[int, int] = {}
    for _ in range(2000):
        key = rng.randrange(200)
        if rng.random() < 0.5:
            cache.get(key)
        elif cache.put(key, key, sizes.setdefault(key, rng.randrange(1, 400))):
            assert key in cache
        assert cache.usage_bytes <= 1000
        assert cache.usage_bytes == sum(sizes[k] for k in sizes if k in cache)


def test_putting_a_stored_key_again_keeps_one_entry_and_refreshes_it():
    cache: MultimodalCache[str] = MultimodalCache(budget_bytes=20)
    cache.put(1, "a", 10)
    cache.put(2, "b", 10)
    assert cache.put(1, "a", 10)
    assert cache.usage_bytes == 20 and len(cache) == 2
    cache.put(3, "c", 10)
    assert 1 in cache and 2 not in cache


def test_pinned_entries_survive_eviction_pressure_until_unpinned():
    cache: MultimodalCache[str] = MultimodalCache(budget_bytes=30)
    cache.put(1, "pinned", 10)
    cache.pin(1)
    cache.pin(1)
    for key in range(2, 12):
        assert cache.put(key, "filler", 10)
    assert 1 in cache and cache.usage_bytes <= 30
    cache.unpin(1)  # pinned twice: still pinned
    cache.put(12, "filler", 10)
    cache.put(13, "filler", 10)
    assert 1 in cache
    cache.unpin(1)
    cache.put(14, "filler", 10)
    cache.put(15, "filler", 10)
    assert 1 not in cache


def test_an_entry_that_cannot_fit_beside_the_pinned_ones_is_not_stored_and_evicts_nothing():
    cache: MultimodalCache[str] = MultimodalCache(budget_bytes=30)
    cache.put(1, "pinned", 20)
    cache.pin(1)
    cache.put(2, "other", 10)
    assert not cache.put(3, "too big", 11)
    assert not cache.put(4, "larger than the budget", 31)
    assert 3 not in cache and 4 not in cache and 2 in cache
    assert cache.usage_bytes == 30 and cache.evictions == 0


def test_pin_and_unpin_reject_keys_they_do_not_know():
    cache: MultimodalCache[str] = MultimodalCache(budget_bytes=30)
    with pytest.raises(KeyError):
        cache.pin(1)
    cache.put(1, "a", 10)
    with pytest.raises(KeyError):
        cache.unpin(1)


def test_a_zero_budget_disables_the_cache():
    cache: MultimodalCache[str] = MultimodalCache(budget_bytes=0)
    assert not cache.put(1, "a", 1) and not cache.put(2, "empty", 0)
    assert cache.get(1) is None and cache.get(2) is None
    assert len(cache) == 0 and cache.usage_bytes == 0 and cache.misses == 2
    with pytest.raises(ValueError):
        MultimodalCache(budget_bytes=-1)


def test_hit_miss_and_eviction_counters():
    cache: MultimodalCache[str] = MultimodalCache(budget_bytes=20)
    cache.get(1)
    cache.put(1, "a", 10)
    cache.get(1)
    cache.get(1)
    cache.put(2, "b", 10)
    cache.put(3, "c", 10)
    cache.get(2)
    cache.get(1)  # evicted by 3
    assert (cache.hits, cache.misses, cache.evictions, cache.usage_bytes) == (3, 2, 1, 20)


def test_the_cache_holds_any_value_such_as_embeddings_with_deepstack_features():
    cache: MultimodalCache[tuple[torch.Tensor, list[torch.Tensor]]] = MultimodalCache(budget_bytes=1 << 20)
    embeddings, deepstack = torch.randn(16, 32), [torch.randn(16, 32) for _ in range(3)]
    assert cache.put(7, (embeddings, deepstack), embeddings.nbytes * 4)
    stored_embeddings, stored_deepstack = cache.get(7)
    assert stored_embeddings is embeddings and stored_deepstack is deepstack


# -- the processed-input cache in the processor ------------------------------------------------------


def test_a_repeated_image_skips_decoding_and_equals_fresh_processing(cached, uncached, png_file, monkeypatch):
    decodes = []
    real_decode_image = processor_module.decode_image
    monkeypatch.setattr(processor_module, "decode_image", lambda *a: decodes.append(a) or real_decode_image(*a))
    first = cached.process(ONE_IMAGE + "Describe.", images=[str(png_file)])
    prompt = "Earlier text shifts the image." + ONE_IMAGE + "Again."
    second = cached.process(prompt, images=[data_url(png_file.read_bytes())])
    assert len(decodes) == 1
    assert (cached.cache.hits, cached.cache.misses) == (1, 1)
    assert cached.cache.usage_bytes == first.mm_items[0].pixels.nbytes
    reference = uncached.process(prompt, images=[str(png_file)])
    assert second.input_ids == reference.input_ids
    assert_same_item(second.mm_items[0], reference.mm_items[0])
    assert second.mm_items[0].spans != first.mm_items[0].spans  # its own position in the new prompt
    assert uncached.cache.hits == 0 and len(uncached.cache) == 0


def test_a_repeated_pil_image_skips_preprocessing(cached, uncached, monkeypatch):
    calls = []
    real_preprocess = cached.image_processor.preprocess
    monkeypatch.setattr(
        cached.image_processor, "preprocess", lambda *a, **k: calls.append(a) or real_preprocess(*a, **k)
    )
    image = make_image(100, 70, seed=5)
    cached.process(ONE_IMAGE, images=[image])
    repeat = cached.process(ONE_IMAGE + ONE_IMAGE, images=[Image.fromarray(np.asarray(image).copy()), image])
    assert len(calls) == 1 and cached.cache.hits == 2
    reference = uncached.process(ONE_IMAGE + ONE_IMAGE, images=[image, image])
    for item, expected in zip(repeat.mm_items, reference.mm_items):
        assert_same_item(item, expected)


def test_other_settings_for_the_same_image_miss_the_cache(cached, png_file):
    cached.process(ONE_IMAGE, images=[png_file])
    cached.process(ONE_IMAGE, images=[MediaInput(png_file, {"max_pixels": 32 * 32 * 4})])
    assert (cached.cache.hits, cached.cache.misses, len(cached.cache)) == (0, 2, 2)


def test_a_repeated_video_skips_decoding_and_equals_fresh_processing(cached, uncached, video_file, monkeypatch):
    calls = []
    real_preprocess = cached.video_processor.preprocess
    monkeypatch.setattr(
        cached.video_processor, "preprocess", lambda *a, **k: calls.append(a) or real_preprocess(*a, **k)
    )
    cached.process(ONE_VIDEO, videos=[str(video_file)])
    prompt = "Watch:" + ONE_VIDEO + "What happens?"
    repeat = cached.process(prompt, videos=[video_file.read_bytes()])
    assert len(calls) == 1 and cached.cache.hits == 1
    reference = uncached.process(prompt, videos=[str(video_file)])
    assert repeat.input_ids == reference.input_ids
    assert_same_item(repeat.mm_items[0], reference.mm_items[0])


def test_a_tiny_budget_keeps_the_processor_cache_within_it(tiny_dense_dir, tokenizer):
    processor = MultimodalProcessor.from_pretrained(tiny_dense_dir, tokenizer, cache_mb=1)
    for seed in range(6):
        item = processor.process(ONE_IMAGE, images=[make_image(384, 384, seed=seed)]).mm_items[0]
        assert item.pixels.nbytes > 300_000  # so that three do not fit in 1 MB
        assert processor.cache.usage_bytes <= 1 << 20
    assert processor.cache.evictions == 4 and len(processor.cache) == 2


# -- the setting -------------------------------------------------------------------------------------


def test_mm_cache_mb_is_a_validated_flag_that_the_engine_passes_on(tiny_moe_dir):
    assert ServerArgs().mm_cache_mb == 512
    ns = build_parser().parse_args(["generate", "--prompt", "hi", "--mm-cache-mb", "0"])
    assert ns.mm_cache_mb == 0
    with pytest.raises(ValueError, match="mm_cache_mb"):
        ServerArgs(mm_cache_mb=-1)
    engine = Engine(tiny_moe_dir, mm_cache_mb=3)
    assert engine.processor.cache.budget_bytes == 3 << 20
    engine.shutdown()
