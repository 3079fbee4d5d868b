"""`vlm-serve caption`: one JSON line per image, unreadable images reported in their line, resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import start_process
from vlm_serve.caption import collect_images, progress_bar
from vlm_serve.cli import main
from vlm_serve.testing.media import jpeg_stating, make_image


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
    args = [
        "caption",
        str(folder),
        "--output",
        str(output),
        "--model",
        str(tiny_moe_dir),
        "--dtype",
        "float32",
        "--max-tokens",
        "3",
        "--batch-size",
        "8",
        "--temperature",
        "0",
    ]
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


def test_a_picture_over_max_image_pixels_is_reported_in_its_line_with_its_size_and_limit(tiny_moe_dir, tmp_path):
    make_image(100, 100).save(tmp_path / "at_limit.png")
    make_image(101, 100).save(tmp_path / "over.png")
    (tmp_path / "huge.jpg").write_bytes(jpeg_stating(20000, 20000))
    output = tmp_path / "captions.jsonl"
    args = [
        "caption",
        str(tmp_path),
        "--output",
        str(output),
        "--model",
        str(tiny_moe_dir),
        "--dtype",
        "float32",
        "--max-tokens",
        "2",
        "--max-image-pixels",
        "10000",
    ]
    assert main(args) == 0
    records = {r["path"].rsplit("/", 1)[-1]: r for r in _lines(output)}
    assert records["at_limit.png"]["caption"] is not None and "error" not in records["at_limit.png"]
    over = "image is 101 x 100 = 10100 pixels, more than the limit of 10000 (--max-image-pixels)"
    assert records["over.png"]["error"] == over
    assert records["huge.jpg"]["error"].startswith("image is 20000 x 20000 = 400000000 pixels, more than the limit")


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


def test_resume_knows_images_however_they_are_named_and_retries_failed_ones(
    folder, tiny_moe_dir, tmp_path, monkeypatch
):
    output = tmp_path / "captions.jsonl"
    options = [
        "--output",
        str(output),
        "--model",
        str(tiny_moe_dir),
        "--dtype",
        "float32",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
    ]
    monkeypatch.chdir(tmp_path)
    assert main(["caption", "photos/img01.jpg", "photos/trip/../broken.png", *options]) == 0
    first = {r["path"]: r for r in _lines(output)}
    assert set(first) == {str(folder / "img01.jpg"), str(folder / "broken.png")}  # absolute paths
    assert "error" in first[str(folder / "broken.png")]

    make_image(40, 40, seed=99).save(folder / "broken.png", format="PNG")  # mended since
    assert main(["caption", str(folder), *options, "--resume"]) == 0
    records = _lines(output)
    assert len(records) == 50 and len({r["path"] for r in records}) == 50  # img01 and broken.png skipped
    assert [r for r in records if r["path"] == str(folder / "broken.png")] == [first[str(folder / "broken.png")]]

    assert main(["caption", str(folder), *options, "--retry-failed"]) == 0  # resumes too
    retried = {r["path"]: r for r in _lines(output)}
    assert len(retried) == 50 == len(_lines(output))  # the failed lines replaced, not added to
    assert "error" not in retried[str(folder / "broken.png")] and retried[str(folder / "broken.png")]["tokens"] > 0
    assert "error" in retried[str(folder / "trip" / "truncated.jpg")]
    assert retried[str(folder / "img01.jpg")] == first[str(folder / "img01.jpg")]  # kept as it was


def test_an_output_with_captions_is_never_written_over_unless_asked(folder, tiny_moe_dir, tmp_path, capsys):
    output = tmp_path / "captions.jsonl"
    image = str(folder / "img02.png")
    options = ["--output", str(output), "--model", str(tiny_moe_dir), "--max-tokens", "2", "--temperature", "0"]
    assert main(["caption", image, *options]) == 0
    before = output.read_text()
    capsys.readouterr()
    assert main(["caption", image, *options]) == 2  # the same command again, by mistake
    assert capsys.readouterr().err == (
        f"vlm-serve: error: {output} already holds 1 captions: --resume goes on from them, --overwrite starts again\n"
    )
    assert output.read_text() == before
    assert main(["caption", str(folder / "img04.png"), *options, "--overwrite"]) == 0
    assert [r["path"] for r in _lines(output)] == [str(folder / "img04.png")]


def test_what_is_wrong_or_left_to_do_is_said_before_a_model_loads(folder, tmp_path, capsys):
    """A model that is not there shows that none loads: a missing input, a run with nothing left."""
    output = tmp_path / "captions.jsonl"
    output.write_text(json.dumps({"path": str(folder / "img02.png"), "caption": "a", "tokens": 1, "time": 0}) + "\n")
    nowhere = ["--model", str(tmp_path / "no-model")]
    assert main(["caption", str(folder / "img02.png"), "--output", str(output), "--resume", *nowhere]) == 0
    assert capsys.readouterr().err == f"0 captioned, 0 failed, 1 already in {output}\n"
    assert main(["caption", str(tmp_path / "nosuch"), "--output", str(output), *nowhere]) == 2
    assert capsys.readouterr().err == f"vlm-serve: error: {tmp_path / 'nosuch'}: no such file or folder\n"
    assert main(["generate", "--prompt", "hi", "--image", str(tmp_path / "nosuch.png"), *nowhere]) == 2
    assert capsys.readouterr().err == f"vlm-serve: error: image file '{tmp_path / 'nosuch.png'}' does not exist\n"


def test_an_interrupted_run_names_only_files_that_exist(folder, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("vlm_serve.engine.Engine.__init__", interrupted)  # (Ctrl-C while the model loads)
    output = tmp_path / "captions.jsonl"
    assert main(["caption", str(folder / "img02.png"), "--output", str(output)]) == 130
    assert capsys.readouterr().err == "\nvlm-serve: interrupted; nothing was written\n"


def test_progress_off_a_terminal_is_plain_lines_with_the_rate_and_time_left(capsys):
    with progress_bar(4, every=0) as bar:  # (pytest's stderr is no terminal)
        bar.update(1)
        bar.update(3)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == ["1/4 images", "4/4 images", "4/4 images"]
    assert all(re.fullmatch(r"\d/4 images, [\d.]+ img/s, (\d\d:\d\d:\d\d|\?) left", line) for line in lines)


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["sigint", "ctrl-c-to-the-group"])
def test_ctrl_c_stops_quietly_leaving_whole_lines(folder, tiny_moe_dir, tmp_path, group):
    """SIGINT to the process (`kill -INT`), or to its whole process group (a terminal's Ctrl-C, which
    reaches the encoder ranks too): exit code 130, and nothing on stderr but the progress lines and the
    line saying so (no traceback, from this process or one of its encoder ranks)."""
    output = tmp_path / "captions.jsonl"
    command = [
        sys.executable,
        "-m",
        "vlm_serve.cli",
        "caption",
        str(folder),
        "--output",
        str(output),
        "--model",
        str(tiny_moe_dir),
        "--dtype",
        "float32",
        "--max-tokens",
        "48",
        "--batch-size",
        "2",
    ]
    process = start_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (output.is_file() and output.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    said = [line for line in stderr.splitlines() if line.strip() and "img/s" not in line]  # but the progress lines
    assert said == [f"vlm-serve: interrupted; the lines in {output} are complete (--resume goes on)"]
    lines = output.read_text().splitlines(keepends=True)
    assert 2 <= len(lines) < 50 and all(line.endswith("\n") and json.loads(line)["path"] for line in lines)
