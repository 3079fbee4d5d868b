"""`--model` names a checkpoint folder, or a Hugging Face model id found in huggingface_hub's cache (here
always offline: the cache is laid out as huggingface_hub lays it out), or nothing (the built-in model)."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from vlm_serve.config import ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.model_source import HUB_FILES, resolve_model, with_local_model


def hub_cache(cache: Path, repo_id: str, checkpoint: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """`checkpoint`'s files as huggingface_hub caches revision `commit` of `repo_id`: contents in blobs/
    (named by hash), the snapshot's files linked to them, and refs/ naming the commit. Its snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for file in checkpoint.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_model_id_is_read_from_the_hugging_face_cache(tmp_path, tiny_moe_dir, tiny_dense_dir, offline):
    main = hub_cache(tmp_path, "acme/tiny-vl", tiny_moe_dir, "a" * 40)
    older = hub_cache(tmp_path, "acme/tiny-vl", tiny_dense_dir, "b" * 40, refs=("v0.1",))
    assert resolve_model("acme/tiny-vl", download_dir=str(tmp_path)) == main
    assert resolve_model("acme/tiny-vl", revision="v0.1", download_dir=str(tmp_path)) == older
    assert resolve_model("acme/tiny-vl", revision="b" * 40, download_dir=str(tmp_path)) == older

    with Engine("acme/tiny-vl", download_dir=str(tmp_path), dtype="float32") as from_hub:
        answer = from_hub.chat([{"role": "user", "content": "hello"}], max_tokens=5, temperature=0)
    with Engine(tiny_moe_dir, dtype="float32") as from_folder:
        assert (
            from_folder.chat([{"role": "user", "content": "hello"}], max_tokens=5, temperature=0).token_ids
            == answer.token_ids
        )

    served = with_local_model(ServerArgs(model="acme/tiny-vl", download_dir=str(tmp_path)))
    assert (served.model, served.served_model_name) == (str(main), "acme/tiny-vl")  # named as vLLM names it
    assert with_local_model(ServerArgs(model=str(tiny_moe_dir))).served_model_name == tiny_moe_dir.name


def test_a_model_that_is_nowhere_is_one_line_naming_it(tmp_path, tiny_moe_dir, offline):
    hub_cache(tmp_path, "acme/tiny-vl", tiny_moe_dir, "a" * 40)
    with pytest.raises(ValueError, match=r"^model acme/elsewhere: no such folder, nor in .*HF_HUB_OFFLINE is set") as e:
        resolve_model("acme/elsewhere", download_dir=str(tmp_path))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="acme/tiny-vl: .*at revision 'v9'"):
        resolve_model("acme/tiny-vl", revision="v9", download_dir=str(tmp_path))
    with pytest.raises(ValueError, match=f"^model {tmp_path / 'nope'}: no such folder$"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no config.json"):
        resolve_model(tmp_path / "empty")
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_moe_dir, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="weightless: no \\*.safetensors weights"):
        resolve_model(weightless)


def test_only_the_files_serving_reads_are_downloaded(tiny_moe_dir):
    def fetched(name: str) -> bool:
        return any(fnmatch.fnmatch(name, pattern) for pattern in HUB_FILES)

    assert all(fetched(file.name) for file in tiny_moe_dir.iterdir())
    published = [
        "model-00001-of-00004.safetensors",
        "model.safetensors.index.json",
        "merges.txt",
        "vocab.json",
        "chat_template.jinja",
        "video_preprocessor_config.json",
    ]
    assert all(fetched(name) for name in published)
    assert not any(fetched(name) for name in ("README.md", ".gitattributes", "demo.png", "original/model.pth"))
