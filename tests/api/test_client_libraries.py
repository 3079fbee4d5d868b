"""Client libraries people plug into an OpenAI-compatible server, against a real one: LangChain's
`ChatOpenAI` on the Responses API, and LiteLLM's `responses`; both recognise a prompt over the context
as a context overflow (their history trimming and fallbacks rely on it). They are optional test
dependencies (the `clients` extra, part of `test`)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.server  # every test here starts a real server

QUESTION = "Tell me about the sea."
TOO_LONG = "the sea " * 40000


WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
}}  # fmt: skip


@pytest.fixture(scope="module")
def langchain_openai():
    """(Imported by the tests that use it, so that collecting the suite does not import it.)"""
    return pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (pip install -e '.[clients]')"
    )


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else it fetches its price list from the internet
    return pytest.importorskip("litellm", reason="litellm is not installed (pip install -e '.[clients]')")


@pytest.fixture(scope="module")
def chat_model(server, model, langchain_openai):
    def make(**options):
        return langchain_openai.ChatOpenAI(
            model=model, base_url=server.url + "/v1", api_key="EMPTY", temperature=0, max_retries=0, **options
        )

    return make


def test_langchain_on_the_responses_api_answers_as_the_server_does(chat_model, client, model):
    expected = client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0).output_text
    answer = chat_model(use_responses_api=True, max_tokens=8).invoke(QUESTION)
    assert answer.text == expected
    assert answer.usage_metadata["output_tokens"] == 8


def test_langchain_on_the_responses_api_gets_tool_calls(chat_model):
    model = chat_model(use_responses_api=True, max_tokens=200)
    bound = model.bind_tools([WEATHER], tool_choice="weather", parallel_tool_calls=False)
    answer = bound.invoke("What is the weather in Paris?")
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "weather"
    assert isinstance(answer.tool_calls[0]["args"], dict)


def test_langchain_raises_context_overflow_for_a_prompt_over_the_context(chat_model):
    from langchain_core.exceptions import ContextOverflowError

    for use_responses_api in (False, True):
        with pytest.raises(ContextOverflowError):
            chat_model(use_responses_api=use_responses_api, max_tokens=8).invoke(TOO_LONG)


def test_litellm_responses_answers_as_the_server_does(server, client, model, litellm):
    # (LiteLLM raises max_output_tokens to OpenAI's least, 16)
    expected = client.responses.create(model=model, input=QUESTION, max_output_tokens=16, temperature=0).output_text
    answer = litellm.responses(
        model=f"openai/{model}",
        api_base=server.url + "/v1",
        api_key="EMPTY",
        input=QUESTION,
        max_output_tokens=16,
        temperature=0,
    )
    texts = [part.text for item in answer.output if item.type == "message" for part in item.content]
    assert "".join(texts) == expected


def test_litellm_raises_context_window_exceeded_for_a_prompt_over_the_context(server, model, litellm):
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=f"openai/{model}",
            api_base=server.url + "/v1",
            api_key="EMPTY",
            max_tokens=8,
            num_retries=0,
            messages=[{"role": "user", "content": TOO_LONG}],
        )
