"""Batch jobs on Ray Data (`vlm_serve.batch`), on a local cluster the tests start (2 CPUs, no network):
every id once, the plain engine's greedy answers, a row that fails gets its error and the job goes on."""

from __future__ import annotations

import os

import pytest

from vlm_serve.batch.stages import OUTPUT_COLUMNS, conversation, sampling_of
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image

pytestmark = pytest.mark.server  # the cluster's processes, and the engine actors in them

SAMPLING = {"max_tokens": 4, "temperature": 0}


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


def test_every_id_comes_back_once_with_the_engines_answer_or_its_error(ray, rows):
    """(The built-in model: its confident answers do not hang on the last bits of a batch's arithmetic.)"""
    from vlm_serve.batch.pipeline import answer_rows

    dataset = ray.data.from_items(rows)
    out = answer_rows(dataset, str(BUILTIN_MODEL), sampling=SAMPLING, batch_size=8)
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
