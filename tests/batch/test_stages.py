"""What a batch job's row asks (`vlm_serve.batch.stages`), without Ray: the conversation and sampling
settings of each kind of row, and a row that asks nothing usable refused with its reason."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pandas", reason="pandas is not installed (pip install -e '.[batch]')")

from vlm_serve.batch.stages import conversation, sampling_of  # noqa: E402


def content(row: dict, prompt: str = "Describe.") -> list[dict]:
    return conversation(row, prompt)[0]["content"]


def test_an_image_or_video_row_is_asked_the_jobs_prompt_or_its_own():
    assert content({"id": 1, "image": "a.png"}) == [
        {"type": "image", "image": "a.png"},
        {"type": "text", "text": "Describe."},
    ]
    assert content({"id": 2, "video": b"\x00", "prompt": "What moves?"})[1] == {"type": "text", "text": "What moves?"}
    assert (
        content({"id": 3, "image": "a.png", "prompt": float("nan")})[1]["text"] == "Describe."
    )  # (pandas' missing value)


def test_a_hugging_face_datasets_image_gives_its_bytes_else_its_path():
    assert content({"id": 1, "image": {"bytes": b"PNG", "path": "a.png"}})[0]["image"] == b"PNG"
    assert content({"id": 1, "image": {"bytes": None, "path": "a.png"}})[0]["image"] == "a.png"


def test_a_messages_row_is_its_own_conversation_as_a_list_or_json():
    messages = [{"role": "user", "content": "Hello"}]
    assert conversation({"id": 1, "messages": messages}) == messages
    assert conversation({"id": 1, "messages": json.dumps(messages), "image": "ignored.png"}) == messages


@pytest.mark.parametrize("row", [{"id": 1}, {"id": 1, "image": "a.png", "video": "b.mp4"}, {"id": 1, "image": None}])
def test_a_row_without_exactly_one_image_video_or_messages_is_refused(row):
    with pytest.raises(ValueError, match="a row needs one of image, video or messages"):
        conversation(row)


def test_a_rows_sampling_settings_go_over_the_jobs():
    job = {"max_tokens": 8, "temperature": 0}
    assert sampling_of({"id": 1}, job) == job
    assert sampling_of({"id": 1, "sampling": {"max_tokens": 2}}, job) == {"max_tokens": 2, "temperature": 0}
    assert sampling_of({"id": 1, "sampling": '{"seed": 3}'}, job) == {**job, "seed": 3}
