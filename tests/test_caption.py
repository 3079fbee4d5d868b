"""`vlm-serve caption`: one JSON line per image, unreadable images reported in their line, resume."""

from __future__ import annotations

import json

import pytest

from vlm_serve.caption import collect_images
from vlm_serve.cli import main
from vlm_serve.testing.media import make_image


@pytest.fixture
def folder(tmp_path):
    """48 good images (PNG and JPEG, some in a subfolder), 2 corrupt ones and a file that is no image."""
    root = tmp_path / "photos"
    (root / "trip").mkdir(parents=True)
    for i in range(48):
        where = root / "trip" if i % 3 == 0 else root
        make_image(32 + i, 48, seed=i).save(where / f"img{i:02d}.{'jpg' if i % 2 else 'png'}")
    (root / "broken.png").write_bytes(b"this is not a png")
    good = (root / "img01.jpg").read_bytes()
    (root / "trip" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (root / "notes.txt").write_text("not an image")
    return root


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_folder_with_two_corrupt_images_gives_50_lines_and_resumes(folder, tiny_moe_dir, tmp_path):
    output = tmp_path / "captions.jsonl"
    args = ["caption", str(folder), "--output", str(output), "--model", str(tiny_moe_dir), "--dtype", "float32",
            "--max-tokens", "3", "--batch-size", "8", "--temperature", "0"]
    assert main(args) == 0
    records = _lines(output)
    assert len(records) == 50 and len({r["path"] for r in records}) == 50
    failed = {r["path"].rsplit("/", 1)[-1]: r["error"] for r in records if "error" in r}
    assert set(failed) == {"broken.png", "truncated.jpg"}
    assert all("image" in message for message in failed.values())
    good = [r for r in records if "error" not in r]
    assert all(r["caption"] is not None and r["tokens"] > 0 and r["time"] > 0 for r in good)

    # an interrupted run: only 20 lines (the last one cut short) made it to the file
    lines = output.read_text().splitlines()
    output.write_text("\n".join(lines[:20]) + "\n" + lines[20][:15])
    assert main(args + ["--resume"]) == 0
    resumed = _lines_skipping_partial(output)
    assert len(resumed) == 50 and {r["path"] for r in resumed} == {r["path"] for r in records}
    by_path = {r["path"]: r for r in records}
    assert all(r.get("caption") == by_path[r["path"]].get("caption") for r in resumed)  # greedy: same captions


def _lines_skipping_partial(path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def test_inputs_can_be_files_folders_and_lists_of_paths(folder, tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text(f"# two images\n{folder / 'img02.png'}\n\n{folder / 'img04.png'}\n")
    paths = collect_images([str(folder / "img02.png"), str(listing), str(folder / "trip")])
    assert paths[:2] == [folder / "img02.png", folder / "img04.png"]  # each path once
    assert len(paths) == 2 + 16 + 1 and all(p.suffix in (".png", ".jpg") for p in paths)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        collect_images([str(tmp_path / "nowhere")])
