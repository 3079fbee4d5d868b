"""Batch jobs on Ray Data (`vlm_serve.batch`), on a local cluster of 2 CPUs the tests start (no
network): every id once, the plain engine's greedy answers, a row that fails gets its error and the job
goes on, a replica killed midway is replaced, a job killed midway resumes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import start_process
from vlm_serve.batch.stages import OUTPUT_COLUMNS, conversation, sampling_of
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image

pytestmark = pytest.mark.server  # the cluster's processes, and the engine actors in them

SAMPLING = {"max_tokens": 4, "temperature": 0}
FAILING = {"broken", "missing", "refused"}  # rows that get an error: no image, and a refused temperature


@pytest.fixture(scope="module")
def ray():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # (Ray would report usage over the network)
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[batch]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
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


@pytest.fixture(scope="module")
def expected(rows) -> dict[str, tuple]:
    """The plain engine's answer to each row that can be answered (no Ray), and its token counts."""
    answers = {}
    with Engine() as engine:
        for row in rows:
            if row["id"] not in FAILING:
                out = engine.chat(conversation(row), **sampling_of(row, SAMPLING))
                answers[row["id"]] = (out.text, out.prompt_tokens, len(out.token_ids))
    return answers


def answered(written: list[dict]) -> dict[str, tuple]:
    return {r["id"]: (r["answer"], r["prompt_tokens"], r["completion_tokens"]) for r in written if r["error"] is None}


# the replicas' engine settings: the default, and features users combine with it
COMBINED = {"chunked_prefill_size": 64, "speculative_algorithm": "ngram", "schedule_policy": "lpm"}


@pytest.mark.parametrize("settings", [{}, COMBINED], ids=["default", "chunked-ngram-lpm"])
def test_every_id_comes_back_once_with_the_engines_answer_or_its_error(ray, rows, expected, settings):
    """The same answers and token counts as one engine of the default settings without Ray (greedy).
    (The built-in model: its confident answers do not hang on the last bits of a batch's arithmetic.)"""
    from vlm_serve.batch.pipeline import answer_rows

    dataset = ray.data.from_items(rows)
    out = answer_rows(dataset, str(BUILTIN_MODEL), sampling=SAMPLING, settings=settings, batch_size=8)
    results = out.take_all()
    assert sorted(r["id"] for r in results) == sorted(r["id"] for r in rows)
    assert all(set(r) == set(OUTPUT_COLUMNS) for r in results)
    assert answered(results) == expected
    by_id = {r["id"]: r for r in results}
    failed = {i: r["error"] for i, r in by_id.items() if r["error"] is not None}
    assert set(failed) == FAILING
    assert "cannot decode image" in failed["broken"] and "does not exist" in failed["missing"]
    assert "temperature" in failed["refused"]
    for row in (row for row in rows if row["id"] not in FAILING):
        got = by_id[row["id"]]
        assert (got["media_tokens"] > 0) == ("image" in row) and got["preprocess_s"] > 0 and got["generate_s"] > 0


def read_rows(ray, rows: list[dict], folder, files: int = 1):
    """`rows` as a job reads them from JSON-lines `files` (a block each; sampling and messages as JSON text)."""
    from vlm_serve.batch.pipeline import IO_CPUS

    encoded = [{**r, **{k: json.dumps(r[k]) for k in ("sampling", "messages") if k in r}} for r in rows]
    folder.mkdir()
    for i in range(files):
        (folder / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in encoded[i::files]))
    return ray.data.read_json(str(folder), num_cpus=IO_CPUS)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".tar"])
def test_a_resumed_job_writes_each_id_once_in_each_format(ray, rows, tmp_path, suffix):
    """A first job wrote half the rows; the same job resumed writes the rest, and the output reads back
    with pyarrow (JSON lines, Parquet) or Ray's WebDataset reader: every id once."""
    from vlm_serve.batch.pipeline import write_answers

    output = tmp_path / f"answers{suffix}"
    options = {"model": str(BUILTIN_MODEL), "sampling": SAMPLING, "batch_size": 8}
    write_answers(read_rows(ray, rows[:30], tmp_path / "half"), output, **options)
    everything = read_rows(ray, rows, tmp_path / "rows")
    with pytest.raises(FileExistsError, match="--resume goes on from it, --overwrite starts again"):
        write_answers(everything, output, **options)
    write_answers(everything, output, resume=True, **options)
    written = read_back(ray, output)
    assert sorted(r["id"] for r in written) == sorted(r["id"] for r in rows)
    assert {r["id"] for r in written if r["error"] is not None} == FAILING


def read_back(ray, output) -> list[dict]:
    """The rows of a job's output, read as its users would: pyarrow, or Ray's WebDataset reader."""
    import pyarrow.json
    import pyarrow.parquet

    if output.suffix == ".tar":
        return [r["json"] for r in ray.data.read_webdataset(str(output)).take_all()]
    if output.suffix == ".parquet":
        return pyarrow.parquet.read_table(output).to_pylist()
    return [row for file in sorted(output.iterdir()) for row in pyarrow.json.read_json(file).to_pylist()]


def test_rows_not_read_from_files_cannot_be_written_resumably(ray, rows, tmp_path):
    from vlm_serve.batch.pipeline import write_answers

    with pytest.raises(ValueError, match="the rows must be read from files"):
        write_answers(ray.data.from_items(rows), tmp_path / "answers.jsonl", model=str(BUILTIN_MODEL))


def generate_pids() -> list[int]:
    """The processes of the engine replicas (Ray names an actor's process after its class)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if b"MapBatches(Generate)" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
    return pids


def wait_for(condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_replica_killed_midway_is_replaced_and_the_job_completes(ray, rows, expected, tmp_path):
    """The engine's process dies (SIGKILL) once some answers are written: Ray starts another replica,
    runs the dead one's batches again, and the job ends with every id once and the same answers."""
    from vlm_serve.batch.pipeline import write_answers

    output = tmp_path / "answers.jsonl"
    job = threading.Thread(
        target=write_answers,
        args=(read_rows(ray, rows, tmp_path / "rows", files=6), output),
        kwargs={"model": str(BUILTIN_MODEL), "sampling": SAMPLING, "batch_size": 4},
    )
    job.start()
    wait_for(lambda: output.is_dir() and any(output.iterdir()) and generate_pids())
    killed = generate_pids()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    job.join(timeout=600)
    assert not job.is_alive()
    assert generate_pids() == [] or set(generate_pids()).isdisjoint(killed)
    written = read_back(ray, output)
    assert sorted(r["id"] for r in written) == sorted(r["id"] for r in rows)
    assert answered(written) == expected


DRIVER = """
import sys, ray
from vlm_serve.batch.pipeline import IO_CPUS, write_answers
ray.init(address=sys.argv[1], log_to_driver=False)
rows = ray.data.read_json(sys.argv[2], num_cpus=IO_CPUS)
write_answers(rows, sys.argv[3], model=sys.argv[4], sampling={"max_tokens": 4, "temperature": 0}, batch_size=4)
"""


def test_a_job_killed_midway_resumes_with_no_id_twice_and_none_lost(ray, rows, expected, tmp_path):
    """The job's driver (another process on the same cluster) is killed once some answers are written;
    the job resumed from here writes the rest: every id once (Ray's two-step commit drops a block whose
    write the kill cut short)."""
    from vlm_serve.batch.pipeline import write_answers

    dataset = read_rows(ray, rows, tmp_path / "rows", files=6)
    output = tmp_path / "answers.parquet"
    address = ray.get_runtime_context().gcs_address
    driver = start_process(
        [sys.executable, "-c", DRIVER, address, str(tmp_path / "rows"), str(output), str(BUILTIN_MODEL)],
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    wait_for(lambda: output.is_dir() and any(output.iterdir()) or driver.poll() is not None)
    assert driver.poll() is None, "the job ended before it could be killed midway"
    driver.kill()  # (a block being written now is left cut short: the resumed job drops it, Ray's commit undone)
    driver.wait()
    write_answers(dataset, output, resume=True, model=str(BUILTIN_MODEL), sampling=SAMPLING, batch_size=4)
    written = read_back(ray, output)
    assert sorted(r["id"] for r in written) == sorted(r["id"] for r in rows)
    assert answered(written) == expected
