"""The Responses API (`/v1/responses`), through a real server with the official openai client.

A response is the chat completion of the same conversation: the same greedy text and token counts,
with images, JSON schemas and tools. Its output comes as typed items (message, function_call,
reasoning), and when streamed as OpenAI's typed events whose deltas add up to the same output.
Stored responses continue with `previous_response_id`, can be fetched, deleted and (in the
background) cancelled; what the server cannot honour is refused by name.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from helpers import circle_url, metric
from vlm_serve.server.chat_output import ChatDelta
from vlm_serve.server.responses_api import OutputBuilder, assistant_message
from vlm_serve.server.tool_parser import ToolCall
from vlm_serve.testing.media import png_stating

MAX = 8
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
}  # fmt: skip
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


def chat_answer(client: openai.OpenAI, messages: list[dict], **options):
    return client.chat.completions.create(model="default", messages=messages, temperature=0, **options)


@pytest.mark.server
def test_a_text_response_is_the_chat_completion_of_the_same_message(client, model):
    response = client.responses.create(
        model=model, input="Tell me about the sea.", instructions="Be brief.", max_output_tokens=MAX, temperature=0
    )
    chat = chat_answer(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}],
        max_tokens=MAX,
    )
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if chat.choices[0].finish_reason == "length":  # the tiny random model rarely stops by itself
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


@pytest.mark.server
def test_an_image_in_the_input_is_seen_as_in_chat(client, model):
    content = [{"type": "input_image", "image_url": circle_url()}, {"type": "input_text", "text": "What is it?"}]
    response = client.responses.create(
        model=model, input=[{"role": "user", "content": content}], max_output_tokens=MAX, temperature=0
    )
    chat = chat_answer(
        client,
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": circle_url()}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
        max_tokens=MAX,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    details = response.model_dump()["usage"]["input_tokens_details"]
    assert details["media"] == chat.model_dump()["usage"]["prompt_tokens_details"]["media"]
    assert details["media"][0]["type"] == "image" and details["media"][0]["tokens"] > 0


class Verdict(BaseModel):
    shape: Literal["circle", "square"]
    red: bool


@pytest.mark.server
def test_responses_parse_with_a_pydantic_model_follows_its_schema(client, model):
    parsed = client.responses.parse(
        model=model, input="Which shape, and is it red?", text_format=Verdict, max_output_tokens=40, temperature=0
    )
    assert isinstance(parsed.output_parsed, Verdict)
    assert Verdict.model_validate_json(parsed.output_text) == parsed.output_parsed


@pytest.mark.server
def test_json_object_format_gives_a_json_object(client, model):
    response = client.responses.create(
        model=model,
        input="Answer in JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=64,
        temperature=0,
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # cut short: what there is starts an object
        assert response.output_text.lstrip().startswith("{")


@pytest.mark.server
def test_a_tool_round_trip_with_previous_response_id_is_the_chat_conversation(client, model):
    question = "What is the weather in Paris?"
    first = client.responses.create(
        model=model, input=question, tools=[WEATHER], tool_choice="required", max_output_tokens=200, temperature=0
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    json.loads(calls[0].arguments)
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"} for call in calls]
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=outputs,
        tools=[WEATHER],
        max_output_tokens=MAX,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # the same conversation, sent whole to chat completions
    tool_calls = [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        *({"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"} for call in calls),
    ]
    chat = chat_answer(client, messages, tools=[CHAT_WEATHER], max_tokens=MAX)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == (chat.choices[0].message.content or "")
    # and the same conversation as explicit input items (what LangChain sends), without the store
    replayed = client.responses.create(
        model=model,
        input=[{"role": "user", "content": question}, *[c.model_dump() for c in calls], *outputs],
        tools=[WEATHER],
        max_output_tokens=MAX,
        temperature=0,
        store=False,
    )
    assert (replayed.output_text, replayed.usage.input_tokens) == (second.output_text, second.usage.input_tokens)


@pytest.mark.server
def test_a_named_tool_choice_calls_that_function(client, model):
    other = {**WEATHER, "name": "get_time", "description": "The time in a city."}
    response = client.responses.create(
        model=model,
        input="Hi",
        tools=[WEATHER, other],
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    assert [item.name for item in response.output if item.type == "function_call"][:1] == ["get_time"]


@pytest.mark.server
def test_a_streamed_response_sends_typed_events_that_add_up_to_the_same_output(client, model):
    options = dict(model=model, input="Tell me about the sea.", max_output_tokens=MAX, temperature=0)
    whole = client.responses.create(**options)
    events = list(client.responses.create(**options, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id


@pytest.mark.server
def test_a_streamed_tool_call_sends_its_arguments_events(client, model):
    events = list(
        client.responses.create(
            model=model,
            input="Weather in Oslo?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=200,
            parallel_tool_calls=False,
            temperature=0,
            stream=True,
        )
    )
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done and done[0].name == "get_weather"
    deltas = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == done[0].item_id
    )
    assert deltas == done[0].arguments
    [call, *_] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert call.arguments == done[0].arguments and call.id == done[0].item_id


@pytest.mark.server
def test_a_client_that_leaves_a_stream_aborts_its_request(server, client, model):
    before = metric(server.url, 'requests_finished_total{reason="abort"}')
    with client.responses.create(
        model=model, input="Count to a thousand.", max_output_tokens=2000, stream=True
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    deadline = time.monotonic() + 30
    while metric(server.url, 'requests_finished_total{reason="abort"}') == before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)


@pytest.mark.server
def test_stored_responses_can_be_fetched_listed_and_deleted(client, model):
    response = client.responses.create(model=model, input="Hello", max_output_tokens=2, metadata={"k": "v"})
    fetched = client.responses.retrieve(response.id)
    assert fetched.model_dump() == response.model_dump() and fetched.metadata == {"k": "v"}
    items = client.responses.input_items.list(response.id)
    assert [item.type for item in items.data] == ["message"] and items.data[0].content[0].text == "Hello"
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model=model, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="Hi", previous_response_id=unstored.id, max_output_tokens=2)
    assert caught.value.code == "previous_response_not_found"


@pytest.mark.server
def test_a_background_response_is_polled_and_can_be_cancelled(client, model):
    quick = client.responses.create(model=model, input="Hi", max_output_tokens=2, background=True)
    assert quick.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(quick.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert polled.status in ("completed", "incomplete") and polled.usage.output_tokens == 2
    slow = client.responses.create(model=model, input="Count.", max_output_tokens=3000, background=True)
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(slow.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(client.responses.create(model=model, input="Hi", max_output_tokens=1).id)


@pytest.mark.server
@pytest.mark.parametrize(
    "options, fragment, param",
    [
        ({"tools": [{"type": "web_search"}]}, "only function tools", "tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "Files API",
            "input[0].content[0]",
        ),
        ({"conversation": "conv_1"}, "conversation", None),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"background": True, "store": False}, "store", None),
        ({"tool_choice": "required"}, "needs `tools`", "tool_choice"),
        ({"use_beam_search": True}, "use_beam_search", "use_beam_search"),
        ({"text": {"verbosity": "low"}}, "verbosity", None),
        ({"stop_regex": "a+"}, "chat and text completions", "stop_regex"),  # SGLang's responses take neither
        ({"echo": True}, "chat and text completions", "echo"),
    ],
    ids=[
        "hosted tool",
        "file input",
        "conversation",
        "truncation auto",
        "background unstored",
        "choice without tools",
        "beam search",
        "verbosity",
        "stop regex",
        "echo",
    ],
)
def test_what_the_server_cannot_honour_is_refused_by_name(server, model, options, fragment, param):
    body = {"model": model, "input": "Hi", "max_output_tokens": 2, **options}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"], error
    if param is not None:
        assert error["param"] == param or error["param"].startswith(param), error


JUNK = "data:image/png;base64," + base64.b64encode(b"not a picture").decode()
HUGE = "data:image/png;base64," + base64.b64encode(png_stating(20000, 20000)).decode()
LOOK = {"type": "input_text", "text": "Look."}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.server
@pytest.mark.parametrize(
    "options, param, fragment",
    [
        (
            {"input": [{"role": "user", "content": [LOOK, {"type": "input_image", "image_url": JUNK}]}]},
            "input[0].content[1]",
            "cannot decode image",
        ),
        (
            {
                "instructions": "Be brief.",
                "input": [
                    {"role": "user", "content": "Weather?"},
                    CALL,
                    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
                    {"role": "user", "content": [LOOK, LOOK, {"type": "input_image", "image_url": HUGE}]},
                ],
            },
            "input[3].content[2]",
            "image is 20000 x 20000 = 400000000 pixels, more than the limit of 89478485",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": JUNK}}]}]},
            "input[0].content[0]",
            "media type 'image/png' is not video/*",
        ),
        (
            {
                "stream": True,
                "input": [{"role": "user", "content": [LOOK, {"type": "input_image", "image_url": JUNK}]}],
            },
            "input[0].content[1]",
            "cannot decode image",
        ),
    ],
    ids=["second part", "after instructions and a tool call", "a video", "streamed"],
)
def test_a_media_error_names_the_input_part_that_failed(server, client, model, options, param, fragment):
    body = {"model": model, "max_output_tokens": 2, **options}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert client.responses.create(model=model, input="Hi", max_output_tokens=2).status in ("completed", "incomplete")


@pytest.mark.server
def test_a_media_error_after_a_previous_response_names_the_new_input_part(client, model):
    first = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=model,
            previous_response_id=first.id,
            instructions="Be brief.",
            max_output_tokens=2,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": JUNK}, LOOK]}],
        )
    assert caught.value.param == "input[0].content[0]" and "cannot decode image" in caught.value.message


@pytest.mark.server
def test_a_too_long_input_raises_context_length_exceeded(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="the sea " * 40000, max_output_tokens=8)
    assert caught.value.code == "context_length_exceeded"


def test_an_answer_in_pieces_becomes_items_and_events_in_order():
    builder = OutputBuilder()
    events = builder.add(ChatDelta(reasoning="Think"))
    events += builder.add(ChatDelta(reasoning=" more", content="Hello"))
    events += builder.add(ChatDelta(content=" there", tool_calls=[ToolCall("f", "{}", "call_1")]))
    events += builder.finish("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    reasoning, message, call = builder.items
    assert reasoning.content[0].text == "Think more" and message.content[0].text == "Hello there"
    assert (call.call_id, call.name, call.arguments) == ("call_1", "f", "{}")
    assert all(item.status == "completed" for item in builder.items)
    assert assistant_message(builder.items) == {
        "role": "assistant",
        "content": "Hello there",
        "reasoning_content": "Think more",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


def test_an_empty_answer_cut_short_is_one_incomplete_empty_message():
    builder = OutputBuilder()
    builder.finish("incomplete")
    [message] = builder.items
    assert message.type == "message" and message.status == "incomplete" and message.content[0].text == ""
