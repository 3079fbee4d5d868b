"""Batch jobs on Ray Data (`vlm_serve.batch`), on a local cluster the tests start (no network; 4 logical
CPUs on this 2-core machine: a resumed job's read task and Ray's checkpoint filter take one each):
every id once, the plain engine's greedy answers, a row that fails gets its error and the job goes on."""

from __future__ import annotations

import json
import os

import pytest

from vlm_serve.batch.stages import OUTPUT_COLUMNS, conversation, sampling_of
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image

pytestmark = pytest.mark.server  # the cluster's processes, and the engine actors in them

SAMPLING = {"max_tokens": 4, "temperature": 0}
# the two stages on half a CPU each, leaving CPUs for reading, Ray's checkpoint filter and writing
SMALL = {"preprocess_cpus": 0.5, "cpus_per_replica": 0.5}


@pytest.fixture(scope="module")
def ray():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # (Ray would report usage over the network)
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[batch]')")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """60 rows: 50 pictures, 5 of them again under other ids, 3 large ones, and 2 that are no image."""
    folder = tmp_path_factory.mktemp("pictures")
    rows = []
    for i in range(50):
        size = (900, 700) if i % 17 == 0 else (32 + i, 48)
        path = folder / f"img{i:02d}.png"
        make_image(*size, seed=i).save(path)
        rows.append({"id": f"p{i}", "image": str(path)})
    rows += [{"id": f"again{i}", "image": rows[i]["image"]} for i in range(5)]
    (folder / "broken.png").write_bytes(b"this is not a png")
    rows += [{"id": "broken", "image": str(folder / "broken.png")}, {"id": "missing", "image": str(folder / "no.png")}]
    rows += [{"id": "asked", "image": rows[1]["image"], "prompt": "What shape?", "sampling": {"max_tokens": 2}}]
    rows += [{"id": "chat", "messages": [{"role": "user", "content": "Hello"}]}]
    rows += [{"id": "refused", "image": rows[2]["image"], "sampling": {"temperature": -1}}]
    return rows


def test_every_id_comes_back_once_with_the_engines_answer_or_its_error(ray, rows):
    """(The built-in model: its confident answers do not hang on the last bits of a batch's arithmetic.)"""
    from vlm_serve.batch.pipeline import answer_rows

    dataset = ray.data.from_items(rows)
    out = answer_rows(dataset, str(BUILTIN_MODEL), sampling=SAMPLING, batch_size=8, **SMALL)
    results = out.take_all()
    assert sorted(r["id"] for r in results) == sorted(r["id"] for r in rows)
    assert all(set(r) == set(OUTPUT_COLUMNS) for r in results)
    by_id = {r["id"]: r for r in results}

    failed = {i: r["error"] for i, r in by_id.items() if r["error"] is not None}
    assert set(failed) == {"broken", "missing", "refused"}
    assert "cannot decode image" in failed["broken"] and "does not exist" in failed["missing"]
    assert "temperature" in failed["refused"]
    with Engine() as engine:  # the same rows, one engine, no Ray
        for row in rows:
            if row["id"] in failed:
                continue
            expected = engine.chat(conversation(row), **sampling_of(row, SAMPLING))
            got = by_id[row["id"]]
            assert (got["answer"], got["completion_tokens"]) == (expected.text, len(expected.token_ids)), row["id"]
            assert got["prompt_tokens"] == expected.prompt_tokens and got["generate_s"] > 0
            assert (got["media_tokens"] > 0) == ("image" in row)


def read_rows(ray, rows: list[dict], path):
    """`rows` as a job reads them from a file (JSON lines; sampling and messages as JSON text)."""
    encoded = [{**r, **{k: json.dumps(r[k]) for k in ("sampling", "messages") if k in r}} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in encoded))
    return ray.data.read_json(str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".tar"])
def test_a_resumed_job_writes_each_id_once_in_each_format(ray, rows, tmp_path, suffix):
    """A first job wrote half the rows; the same job resumed writes the rest, and the output reads back
    with pyarrow (JSON lines, Parquet) or Ray's WebDataset reader: every id once."""
    from vlm_serve.batch.pipeline import write_answers

    output = tmp_path / f"answers{suffix}"
    options = {"model": str(BUILTIN_MODEL), "sampling": SAMPLING, "batch_size": 8, **SMALL}
    write_answers(read_rows(ray, rows[:30], tmp_path / "half.jsonl"), output, **options)
    everything = read_rows(ray, rows, tmp_path / "rows.jsonl")
    with pytest.raises(FileExistsError, match="--resume goes on from it, --overwrite starts again"):
        write_answers(everything, output, **options)
    write_answers(everything, output, resume=True, **options)
    if suffix == ".tar":
        written = [r["json"] for r in ray.data.read_webdataset(str(output)).take_all()]
    else:
        reader = ray.data.read_parquet if suffix == ".parquet" else ray.data.read_json
        written = reader(str(output)).take_all()
    assert sorted(r["id"] for r in written) == sorted(r["id"] for r in rows)
    assert {r["id"] for r in written if r["error"] is not None} == {"broken", "missing", "refused"}


def test_rows_not_read_from_files_cannot_be_written_resumably(ray, rows, tmp_path):
    from vlm_serve.batch.pipeline import write_answers

    with pytest.raises(ValueError, match="the rows must be read from files"):
        write_answers(ray.data.from_items(rows), tmp_path / "answers.jsonl", model=str(BUILTIN_MODEL), **SMALL)
