"""The prefix cache's tiers below the KV pool, through the Engine: answers with the host tier and the
storage tier are token for token those without them (pictures, a video, both event loops, every prefetch
policy); a restarted engine finds its prefixes in storage, a LoRA adapter's under its own digest; a
damaged storage file is dropped and its pages computed again; a storage backend that stalls delays no
request past its policy's bound; and no tier ever serves one picture's KV for another (another picture,
or the same one at another max_pixels)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import vlm_serve.kv_cache.factory as kv_cache_factory
import vlm_serve.scheduler.storage_prefetch as storage_prefetch_module
from vlm_serve.engine import Engine
from vlm_serve.kv_cache.hicache_storage import HiCacheFile
from vlm_serve.testing.lora_adapter import make_adapter
from vlm_serve.testing.media import make_image, make_video

MAX_TOKENS = 6
PAGE = 16
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly, in plain words, and precisely."}
LOOPS = {"overlap": {}, "normal": {"disable_overlap_schedule": True}}
POLICIES = ("best_effort", "wait_complete", "timeout")


def chat(*parts: dict) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": list(parts)}]


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(img, **settings) -> dict:
    return {"type": "image", "image": img, **settings}


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> list[list[dict]]:
    clip = make_video(tmp_path_factory.mktemp("video") / "clip.mp4", num_frames=8, fps=4, size=(64, 96))
    cat, dog = make_image(192, 128, seed=1), make_image(128, 160, seed=2)
    return [
        chat(text("Tell me a story about a lighthouse keeper and the sea birds he feeds every morning.")),
        chat(image(cat), text("Describe this image.")),
        chat(image(dog), text("Describe this image.")),
        chat({"type": "video", "video": str(clip)}, text("What happens in the video?")),
        chat(image(cat), image(dog), text("Compare the two pictures.")),
    ]


def _answers(engine: Engine, conversations: list[list[dict]]) -> list:
    """Each conversation alone, one after the other (so each finds the tiers as the ones before left them)."""
    outs = [engine.chat(c, max_tokens=MAX_TOKENS, temperature=0) for c in conversations]
    engine.scheduler.check_memory()
    return outs


@pytest.fixture(scope="module")
def reference(tiny_moe_dir, conversations) -> list[list[int]]:
    """Tiers off (and a KV pool that holds everything)."""
    with Engine(tiny_moe_dir, dtype="float32", page_size=PAGE) as engine:
        return [o.token_ids for o in _answers(engine, conversations)]


def tiers(store: Path, **settings) -> dict:
    return {
        "dtype": "float32",
        "page_size": PAGE,
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(store),
        **settings,
    }


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("policy", POLICIES)
def test_a_restarted_engine_finds_its_prefixes_in_storage_and_answers_the_same(
    tiny_moe_dir, conversations, reference, tmp_path, policy, loop
):
    """(Where the policy waits for the pages, the pictures inside them need no vision tower either.)"""
    settings = tiers(tmp_path, hicache_storage_prefetch_policy=policy, **LOOPS[loop])
    with Engine(tiny_moe_dir, **settings) as engine:
        assert [o.token_ids for o in _answers(engine, conversations)] == reference
        encoded_cold = engine.scheduler.get_stats().vit_items
    assert list(tmp_path.glob("*.kv"))
    with Engine(tiny_moe_dir, **settings) as engine:  # the same storage, nothing in memory
        outs = _answers(engine, conversations)
        assert [o.token_ids for o in outs] == reference
        stats = engine.scheduler.get_stats()
        assert stats.hicache.hit_tokens["storage"] > 0 and stats.hicache.copied_bytes["storage_to_host"] > 0
        if policy != "best_effort":  # (best_effort takes what was read when the request runs: maybe less)
            assert all(o.cached_tokens >= PAGE for o in outs)
            assert stats.vit_items < encoded_cold


def test_a_small_kv_pool_overflows_into_the_host_and_storage_tiers_exactly(
    tiny_moe_dir, conversations, reference, tmp_path
):
    """A KV pool of 8 pages (one conversation and a bit) and a host pool of the same size: later rounds find
    their prefixes on the device, in the host tier or, evicted from there too, in storage."""
    settings = tiers(
        tmp_path, max_total_tokens=8 * PAGE, hicache_ratio=1, hicache_storage_prefetch_policy="wait_complete"
    )
    with Engine(tiny_moe_dir, **settings) as engine:
        for _ in range(3):
            assert [o.token_ids for o in _answers(engine, conversations)] == reference
        stats = engine.scheduler.get_stats().hicache
        assert stats.hit_tokens["host"] > 0 and stats.hit_tokens["storage"] > 0


def test_seeded_sampling_over_the_tiers_draws_what_it_draws_without_them(tiny_moe_dir, conversations, tmp_path):
    """Seeded answers (temperature 1) from a small pool over both tiers, before and after a restart on warm
    storage, equal those of an engine without tiers."""
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1234}
    with Engine(tiny_moe_dir, dtype="float32", page_size=PAGE) as engine:
        expected = [engine.chat(c, **sampling).token_ids for c in conversations]
    settings = tiers(tmp_path, max_total_tokens=8 * PAGE, hicache_storage_prefetch_policy="wait_complete")
    for _ in range(2):  # (the second engine starts on the first one's storage)
        with Engine(tiny_moe_dir, **settings) as engine:
            for _ in range(2):
                assert [engine.chat(c, **sampling).token_ids for c in conversations] == expected
            assert sum(engine.scheduler.get_stats().hicache.hit_tokens.values()) > 0
            engine.scheduler.check_memory()


def test_a_damaged_storage_file_is_dropped_and_its_pages_computed_again(
    tiny_moe_dir, conversations, reference, tmp_path
):
    settings = tiers(tmp_path, hicache_storage_prefetch_policy="wait_complete")
    with Engine(tiny_moe_dir, **settings) as engine:
        _answers(engine, conversations)
    files = sorted(tmp_path.glob("*.kv"))
    for i, f in enumerate(files[::2]):  # every other page: one bit flipped, or cut short
        data = bytearray(f.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0x04
        else:
            del data[-100:]
        f.write_bytes(bytes(data))
    with Engine(tiny_moe_dir, **settings) as engine:
        assert [o.token_ids for o in _answers(engine, conversations)] == reference
        stats = engine.scheduler.get_stats().hicache
        assert stats.storage_failures["corrupt"] > 0
    assert len(list(tmp_path.glob("*.kv"))) >= len(files) - len(files[::2])


class StallingFile(HiCacheFile):
    """A file backend whose reads hang until released (a storage that stalls)."""

    release = threading.Event()

    def get(self, key: str) -> bytes | None:
        self.release.wait()
        return super().get(key)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_stalling_storage_delays_no_request_past_its_policy(
    tiny_moe_dir, conversations, reference, tmp_path, policy, monkeypatch
):
    """Reads never return while the requests run: best_effort goes on at once, timeout after its timeout,
    wait_complete after the stall limit; every request is answered, computing its prefix itself."""
    settings = tiers(tmp_path, hicache_storage_prefetch_policy=policy, hicache_storage_prefetch_timeout=0.05)
    with Engine(tiny_moe_dir, **settings) as engine:
        _answers(engine, conversations)
    monkeypatch.setattr(kv_cache_factory, "create_storage_backend", lambda args: StallingFile(tmp_path, 1 << 30))
    monkeypatch.setattr(storage_prefetch_module, "STALL_SECONDS", 0.2)
    StallingFile.release.clear()
    try:
        with Engine(tiny_moe_dir, **settings) as engine:
            assert [o.token_ids for o in _answers(engine, conversations)] == reference
            assert engine.scheduler.get_stats().hicache.hit_tokens["storage"] == 0
    finally:
        StallingFile.release.set()


def _evict_to_host(engine: Engine) -> None:
    tree = engine.scheduler.tree_cache
    tree.evict(tree.evictable_size())
    assert tree.evictable_size() == 0 and tree.host_size() > 0


def _cached_up_to_the_picture(engine: Engine, conversation: list[dict], out) -> bool:
    """Whether the answer reused no KV from the picture on: its cached tokens end before the first one."""
    first_picture = min(s for it in engine.processor.process_messages(conversation).mm_items for s, _ in it.spans)
    return out.cached_tokens <= first_picture


@pytest.mark.parametrize("tier", ["device", "host", "storage"])
def test_no_tier_serves_one_pictures_kv_for_another(tiny_moe_dir, tmp_path, tier):
    """The same text after another picture, and the same picture at another max_pixels (a smaller grid, or
    the same grid under other settings), reuse only the text before the picture, from whichever tier holds
    the first request's KV; the first request's own repeat then finds it there, picture included."""
    cat, dog = make_image(192, 128, seed=1), make_image(192, 128, seed=2)
    question = text("Describe this image in detail, please.")
    first = chat(image(cat), question)
    others = [
        chat(image(dog), question),
        chat(image(cat, max_pixels=128 * 96), question),
        chat(image(cat, max_pixels=192 * 128 * 4), question),
    ]
    with Engine(tiny_moe_dir, dtype="float32", page_size=PAGE) as engine:
        expected = [engine.chat(c, max_tokens=MAX_TOKENS, temperature=0).token_ids for c in others]
    for i, (other, want) in enumerate(zip(others, expected)):
        settings = tiers(tmp_path / str(i), hicache_storage_prefetch_policy="wait_complete")
        engine = Engine(tiny_moe_dir, **settings)
        engine.chat(first, max_tokens=MAX_TOKENS, temperature=0)
        if tier == "host":
            _evict_to_host(engine)
        if tier == "storage":
            engine.shutdown()
            engine = Engine(tiny_moe_dir, **settings)
        with engine:
            out = engine.chat(other, max_tokens=MAX_TOKENS, temperature=0)
            assert out.token_ids == want
            assert _cached_up_to_the_picture(engine, other, out)
            if tier == "host":
                _evict_to_host(engine)
            repeat = engine.chat(first, max_tokens=1, temperature=0)
            assert not _cached_up_to_the_picture(engine, first, repeat)
            engine.scheduler.check_memory()


def test_an_adapters_prefixes_are_stored_under_the_digest_of_its_files(tiny_moe_dir, conversations, tmp_path):
    """A restarted engine finds the prefixes computed through a LoRA adapter (of attention, experts and the
    vision tower) in storage and answers the same; the base, or another adapter under the same name, finds
    none of them."""
    pytest.importorskip("peft", reason="peft makes the adapters (the test extra installs it)")
    style, other = (make_adapter(tmp_path / name, tiny_moe_dir, seed=seed) for name, seed in (("a", 1), ("b", 2)))
    policy = {"hicache_storage_prefetch_policy": "wait_complete", "enable_lora": True}

    def run(lora_paths: list[str], lora: str | None) -> tuple[list[list[int]], int]:
        with Engine(tiny_moe_dir, **tiers(tmp_path / "store", lora_paths=lora_paths, **policy)) as engine:
            outs = [engine.chat(c, lora=lora, max_tokens=MAX_TOKENS, temperature=0) for c in conversations]
            engine.scheduler.check_memory()
            return [o.token_ids for o in outs], engine.scheduler.get_stats().hicache.hit_tokens["storage"]

    cold, _ = run([f"style={style}"], "style")
    warm, hits = run([f"style={style}"], "style")
    assert warm == cold and hits > 0
    for lora_paths, lora in (([f"style={other}"], "style"), ([], None)):
        assert run(lora_paths, lora)[1] == 0, lora_paths
