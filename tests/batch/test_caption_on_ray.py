"""`vlm-serve caption --ray` as users run it: the same captions as the plain command, from folders of
images or dataset files, written by the output's extension, and resumed; refusals before Ray starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet
import pytest

from helpers import run_process
from vlm_serve.testing.media import make_image

pytestmark = pytest.mark.server  # the command, its Ray cluster and engine actors

pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[batch]')")


def caption(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "vlm_serve.cli", "caption", *args, "--max-tokens", "4", "--temperature", "0"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return run_process(command, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def folder(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(6):
        make_image(40 + 8 * i, 48, seed=i).save(folder / f"{i}.png")
    (folder / "broken.png").write_bytes(b"not a picture")
    return folder


def test_the_same_captions_as_the_plain_command_and_a_resumed_job_adds_the_new_images(folder, tmp_path):
    plain = caption(str(folder), "--output", str(tmp_path / "plain.jsonl"))
    assert plain.returncode == 0, plain.stderr
    expected = {}
    for line in (tmp_path / "plain.jsonl").read_text().splitlines():
        record = json.loads(line)
        expected[record["path"]] = record["caption"]

    output = tmp_path / "captions.parquet"
    done = caption(str(folder), "--output", str(output), "--ray")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == f"6 answered, 1 failed in {output}"
    assert {r["id"]: r["answer"] for r in pyarrow.parquet.read_table(output).to_pylist()} == expected

    again = caption(str(folder), "--output", str(output), "--ray")
    assert again.returncode == 2
    assert (
        again.stderr.splitlines()[-1]
        == f"vlm-serve: error: {output} exists: --resume goes on from it, --overwrite starts again"
    )
    assert "Ray" not in again.stderr  # (refused before a cluster starts)

    make_image(64, 64, seed=9).save(folder / "new.png")
    resumed = caption(str(folder), "--output", str(output), "--ray", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.splitlines()[-1] == f"7 answered, 1 failed in {output}"
    ids = [r["id"] for r in pyarrow.parquet.read_table(output).to_pylist()]
    assert sorted(ids) == sorted(str(path) for path in folder.iterdir())


def test_dataset_rows_in_with_their_own_prompts_and_json_lines_out(folder, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"id": 1, "image": str(folder / "0.png"), "prompt": "What color is it?"}) + "\n"
        + json.dumps({"id": 2, "messages": [{"role": "user", "content": "Hello"}]}) + "\n"
        + json.dumps({"id": 3, "video": str(folder / "none.mp4")}) + "\n"
    )  # fmt: skip
    output = tmp_path / "answers.jsonl"
    done = caption(str(rows), "--output", str(output), "--ray")
    assert done.returncode == 0, done.stderr
    written = {row["id"]: row for file in output.iterdir() for row in map(json.loads, file.read_text().splitlines())}
    assert sorted(written) == [1, 2, 3]
    assert written[1]["error"] is None and written[1]["media_tokens"] > 0 and written[1]["answer"]
    assert written[2]["error"] is None and written[2]["media_tokens"] == 0
    assert "does not exist" in written[3]["error"]


@pytest.mark.parametrize(
    ("inputs", "output", "message"),
    [
        (["rows.jsonl"], "out.jsonl", "rows.jsonl is a dataset file: its rows are captioned with --ray"),
        (["rows.jsonl", "--ray"], "out.csv", "the output must end in one of .jsonl, .json, .parquet, .tar"),
        (["rows.jsonl", "photos", "--ray"], "out.jsonl", "give dataset files (.parquet, .jsonl) or images, not both"),
        (["photos", "--ray", "--retry-failed"], "out.jsonl", "a Ray job resumes with --resume"),
    ],
)
def test_what_a_job_refuses_is_named(folder, tmp_path, inputs, output, message):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"id": 1, "image": str(folder / "0.png")}) + "\n")
    refused = run_process(
        [sys.executable, "-m", "vlm_serve.cli", "caption", *inputs, "--output", output],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        timeout=300,
    )
    assert refused.returncode == 2 and message in refused.stderr.splitlines()[-1], refused.stderr
