"""Each front end's body becomes one typed `SamplingParams` in the protocol layer, over the checkpoint's
generation defaults, and reaches the scheduler as that object: no endpoint edits a dict of settings.

In pytest's process: the request models, `GenerateReqInput.normalize` and the scheduler's limits.
"""

from __future__ import annotations

import pytest

from vlm_serve.messages.backend import SchedulerLimits
from vlm_serve.messages.frontend import GenerateReqInput
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.server.protocol import ChatCompletionRequest, CompletionRequest
from vlm_serve.server.sglang_api import GenerateRequest

DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}  # as a checkpoint's generation_config.json gives them
ASK = [{"role": "user", "content": "Well?"}]
LIMITS = SchedulerLimits(max_total_tokens=4096, context_length=1024, max_running_requests=8, page_size=16)


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=ASK, **fields)


def test_a_chat_body_becomes_sampling_params_over_the_checkpoints_defaults():
    params = _chat(temperature=0.2, max_tokens=9, stop="END", seed=5, logprobs=True, top_logprobs=2).to_sampling_params(
        DEFAULTS
    )
    assert isinstance(params, SamplingParams)
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.8, 20)  # given wins, the rest defaults
    assert (params.max_new_tokens, params.stop, params.seed) == (9, ["END"], 5)
    assert (params.logprobs, params.top_logprobs) == (True, 2)
    assert params.max_new_tokens == _chat(max_completion_tokens=9).to_sampling_params({}).max_new_tokens


def test_without_max_tokens_the_answer_may_run_to_what_the_context_leaves():
    params = _chat().to_sampling_params(DEFAULTS)
    assert params.max_new_tokens is None
    prompt = ProcessedInput(list(range(100)))
    (choice,) = GenerateReqInput(prompt, params).normalize("r", LIMITS)
    assert choice.sampling_params.max_new_tokens == LIMITS.max_sequence_tokens - 100
    assert params.max_new_tokens is None  # (the request's own settings are not changed)


def test_a_chat_constraint_and_the_endpoints_own_settings_land_in_their_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    params = body.to_sampling_params({}, reasoning=True)
    assert params.json_schema is not None and params.ebnf is None and params.reasoning
    tool_grammar = 'root ::= "call"'
    params = _chat().to_sampling_params({}, tool_grammar=tool_grammar)
    assert (params.ebnf, params.json_schema, params.reasoning) == (tool_grammar, None, False)
    assert _chat(guided_regex="[ab]").to_sampling_params({}).regex == "[ab]"


def test_a_completion_bodys_integer_logprobs_ask_for_that_many_alternatives():
    params = CompletionRequest(model="m", prompt="Hi", logprobs=3).to_sampling_params({})
    assert (params.logprobs, params.top_logprobs, params.prompt_logprobs) == (True, 3, None)
    echoed = CompletionRequest(model="m", prompt="Hi", logprobs=3, echo=True).to_sampling_params({})
    assert echoed.prompt_logprobs == 3  # the echoed prompt tokens get their entries too
    plain = CompletionRequest(model="m", prompt="Hi", prompt_logprobs=1).to_sampling_params({})
    assert (plain.logprobs, plain.top_logprobs, plain.prompt_logprobs) == (False, 0, 1)


def test_sglangs_sampling_params_keep_their_names_and_sglangs_default_length():
    body = GenerateRequest(text="Hi", sampling_params={"min_new_tokens": 2, "sampling_seed": 11, "temperature": 0})
    params = body.to_sampling_params(DEFAULTS)
    assert (params.max_new_tokens, params.min_new_tokens, params.seed) == (128, 2, 11)
    assert (params.temperature, params.top_k) == (0, 20)
    logprobs = GenerateRequest(
        text="Hi", return_logprob=True, top_logprobs_num=4, logprob_start_len=0, sampling_params={"max_new_tokens": 3}
    ).to_sampling_params({})
    assert (logprobs.max_new_tokens, logprobs.logprobs, logprobs.top_logprobs, logprobs.prompt_logprobs) == (
        3,
        True,
        4,
        4,
    )


@pytest.mark.parametrize(
    "body, message",
    [
        (lambda: _chat(min_tokens=5, max_tokens=2), "min_new_tokens must be in [0, max_new_tokens=2], not 5"),
        (lambda: _chat(top_k=0), "top_k must be -1 (off) or >= 1, not 0"),
        (lambda: GenerateRequest(text="Hi", sampling_params={"top_k": -3}), "top_k must be -1 (off) or >= 1, not -3"),
    ],
)
def test_a_bad_setting_is_a_value_error_naming_it_when_the_settings_are_made(body, message):
    with pytest.raises(ValueError) as refusal:
        body().to_sampling_params({})
    assert str(refusal.value) == message
