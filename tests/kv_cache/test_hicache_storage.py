"""The storage tier's pieces: key chains that name a whole prefix (media included), framed pages whose
damage is detected, and the file backend's LRU bound."""

from __future__ import annotations

import os
import time

import pytest

from vlm_serve.kv_cache.hicache_mooncake import MooncakeStoreConfig
from vlm_serve.kv_cache.hicache_storage import HiCacheFile, frame, namespace_key, page_keys, unframe
from vlm_serve.mm_cache.hashing import pad_value

VOCAB = 1000


def test_a_page_key_names_the_whole_prefix_up_to_its_end():
    root = namespace_key("model")
    a = page_keys(root, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2
    assert page_keys(root, [1, 2, 3, 4, 9, 9, 9, 9], 4)[0] == a[0]  # same first page, same key
    assert page_keys(root, [1, 2, 3, 4, 9, 9, 9, 9], 4)[1] != a[1]
    assert page_keys(root, [0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # another start changes every later key
    assert page_keys(a[0], [5, 6, 7, 8], 4) == a[1:]  # a chain goes on from any page's key
    assert page_keys(root, [1, 2, 3], 4) == []  # only whole pages
    assert page_keys(namespace_key("another model"), [1, 2, 3, 4], 4)[0] != a[0]


def test_pictures_that_differ_in_any_bit_of_their_62_bit_hash_get_other_keys():
    root = namespace_key("model")
    text = [5, 6, 7, 8]
    h = 0x2ABC_DEF0_1234_5678
    for other in (h ^ 1, h ^ (1 << 40), h ^ (1 << 61)):
        assert pad_value(h, VOCAB) != pad_value(other, VOCAB)
        mine = page_keys(root, text + [pad_value(h, VOCAB)] * 4 + text, 4)
        theirs = page_keys(root, text + [pad_value(other, VOCAB)] * 4 + text, 4)
        assert mine[0] == theirs[0] and mine[1] != theirs[1] and mine[2] != theirs[2]


def test_a_framed_page_reads_back_and_any_damage_is_detected():
    payload = os.urandom(1000)
    blob = frame(payload)
    assert unframe(blob) == payload
    assert unframe(blob[:-1]) is None  # truncated
    assert unframe(blob[:10]) is None
    flipped = bytearray(blob)
    flipped[-5] ^= 0x10
    assert unframe(bytes(flipped)) is None
    assert unframe(None) is None


def test_the_file_backend_keeps_pages_across_instances(tmp_path):
    store = HiCacheFile(tmp_path, max_bytes=1 << 20)
    store.set("k1", b"x" * 100)
    assert store.exists("k1") and store.get("k1") == b"x" * 100
    assert not store.exists("k2") and store.get("k2") is None
    again = HiCacheFile(tmp_path, max_bytes=1 << 20)  # a restarted server
    assert again.get("k1") == b"x" * 100
    assert again.usage_bytes() == store.usage_bytes() > 100
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then renamed


def test_a_corrupted_or_truncated_file_is_dropped_and_counted(tmp_path):
    store = HiCacheFile(tmp_path, max_bytes=1 << 20)
    store.set("good", b"a" * 64)
    store.set("flipped", b"b" * 64)
    store.set("cut", b"c" * 64)
    data = bytearray((tmp_path / "flipped.kv").read_bytes())
    data[-1] ^= 1
    (tmp_path / "flipped.kv").write_bytes(bytes(data))
    (tmp_path / "cut.kv").write_bytes((tmp_path / "cut.kv").read_bytes()[:-10])
    assert store.get("flipped") is None and store.get("cut") is None
    assert store.corrupt == 2
    assert not (tmp_path / "flipped.kv").exists() and not (tmp_path / "cut.kv").exists()
    assert store.get("good") == b"a" * 64


def test_the_file_backend_stays_within_its_bound_dropping_the_least_recently_used(tmp_path):
    size = len(frame(b"p" * 100))
    store = HiCacheFile(tmp_path, max_bytes=3 * size)
    for key in ("a", "b", "c"):
        store.set(key, b"p" * 100)
    assert store.get("a") is not None  # a is now the most recently used
    store.set("d", b"p" * 100)
    assert store.usage_bytes() <= 3 * size
    assert not store.exists("b") and all(store.exists(k) for k in "acd")


def test_a_restarted_file_backend_drops_the_oldest_files_over_a_smaller_bound(tmp_path):
    store = HiCacheFile(tmp_path, max_bytes=1 << 20)
    for i, key in enumerate(("old", "mid", "new")):
        store.set(key, b"q" * 100)
        os.utime(tmp_path / f"{key}.kv", ns=(time.time_ns(), time.time_ns() + i * 10**9))
    size = len(frame(b"q" * 100))
    smaller = HiCacheFile(tmp_path, max_bytes=2 * size)
    assert not smaller.exists("old") and smaller.exists("mid") and smaller.exists("new")


@pytest.mark.parametrize(
    "text,message",
    [
        ("{", "is not JSON"),
        ("[1]", "must be a JSON object"),
        ("{}", "needs the master's address"),
        ('{"master_server_address": "h:1", "segment": 1}', r"unknown keys \['segment'\]"),
    ],
)
def test_the_mooncake_backends_settings_are_checked_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        MooncakeStoreConfig.from_json(text)
    assert MooncakeStoreConfig.from_json('{"master_server_address": "h:1"}').metadata_server == "P2PHANDSHAKE"
