"""Valid request bodies of every generating endpoint, as hypothesis strategies: what a real client may send
to /v1/chat/completions, /v1/completions, /v1/responses and SGLang's /generate, with the features combined.
The combined-feature test (tests/deployments/test_combined_features.py) and benchmarks/fuzz_soak.py draw from `calls()`.
Needs the test extra (hypothesis). `calls(router=True)` draws only what sglang-router's PD mode passes on whole
(each strategy says what it leaves out then: the router refuses or drops some valid fields and values).

Every body drawn is valid: values within their documented ranges, and only combinations that go together
(`top_logprobs` with `logprobs`, at most one structured-output constraint, a forced tool call without one,
a `tool_choice` naming a tool the request defines, `min_tokens` at most `max_tokens`...), so a server must
answer each with a 200. Answers stay short (`max_tokens` 1-24). Pictures are the built-in model's scenes
(`vlm_serve.builtin.scenes`), a few of them, so that a request often repeats one; videos are one of its clips.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import io
import json
import random
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from vlm_serve.builtin.scenes import VIDEO_FPS, random_motion, random_scene, render, render_motion
from vlm_serve.multimodal.video import write_video
from vlm_serve.sampling_params import MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN
from vlm_serve.testing.lora_adapter import ADAPTER

CHAT, COMPLETIONS, RESPONSES, GENERATE = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"
ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES, GENERATE)
MAX_TOKENS = 24
MAX_N = 3
VOCAB_SIZE = 1408  # the built-in model's (its tokenizer names 1382 of them: the rest are valid ids without text)
SPECIAL_IDS = (1362, 1363, 1364, 1376, 1377, 1380, 1381)  # <|endoftext|>, <|im_start|>, <|im_end|>, <tool_call>...
QUESTIONS = (
    "Describe this image.", "What colour is the circle?", "How many shapes are there?", "Is there a star?",
    "Where is the square?", "Describe the video.", "Which picture has more shapes?", "What is an LLM?", "Hi!",
)  # fmt: skip
PICTURE_SIZES = ((96, 96), (160, 128), (192, 192), (120, 200))
STOP_STRINGS = ("the", ".", " is", "circle", "\n", "e", "There are", "!")
STOP_REGEXES = (r"\.", r"[0-9]+", r"(circle|square)s?", r"\s{2}", r"(?i)the\b", r"e")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "shapes": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
REGEXES = (r"(yes|no)", r"[a-z]{1,8}", r"The (circle|square) is (red|blue)\.", r"[0-9]+( shapes)?")
CHOICES = (["yes", "no"], ["red", "green", "blue"], ["A large red circle in the center."])
GRAMMARS = {'root ::= "yes" | "no"': r"yes|no", 'root ::= [a-z]+ "." | "none"': r"[a-z]+\.|none"}  # EBNF -> its regex
FUNCTIONS = (
    {"name": "report_colour", "description": "Report the colour of the shape.", "parameters": {
        "type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}, "required": ["colour"]}},
    {"name": "count_shapes", "description": "Count the shapes.", "parameters": {
        "type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["count"], "additionalProperties": False}},
    {"name": "no_arguments", "description": "A function without parameters."},
)  # fmt: skip


@dataclass(frozen=True)
class Call:
    """One request: the endpoint's path and the JSON body sent to it."""

    endpoint: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def sampling(self) -> dict[str, Any]:
        """The body's sampling settings (/generate's `sampling_params`, the body itself elsewhere)."""
        return self.body.get("sampling_params", {}) if self.endpoint == GENERATE else self.body

    @property
    def greedy(self) -> bool:
        """Whether the answer is decided without random numbers (the built-in model's default is greedy)."""
        return self.sampling.get("temperature", 0) == 0 or self.sampling.get("top_k") == 1

    @property
    def seeded(self) -> bool:
        return self.sampling.get("seed", self.sampling.get("sampling_seed")) is not None

    @property
    def deterministic(self) -> bool:
        """Whether the same call must answer the same every time (greedy, or sampled with a seed)."""
        return self.greedy or self.seeded

    def unstreamed(self) -> Call:
        """The same request, answered whole."""
        body = {k: v for k, v in self.body.items() if k not in ("stream", "stream_options")}
        return Call(self.endpoint, body)

    def as_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "body": self.body}

    def __str__(self) -> str:
        return f"POST {self.endpoint} {json.dumps(_elided(self.body))}"

    def __repr__(self) -> str:  # (as hypothesis shows a failing example: data URLs shortened)
        return f"Call({self.endpoint!r}, {_elided(self.body)!r})"


def _elided(value: Any) -> Any:
    """`value` with data URLs shortened (for messages; saved calls keep them whole)."""
    if isinstance(value, str) and value.startswith("data:") and len(value) > 60:
        return value[:40] + f"...({len(value)} chars)"
    if isinstance(value, dict):
        return {k: _elided(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_elided(v) for v in value]
    return value


# ---- media ----------------------------------------------------------------------------------------------


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@functools.cache
def pictures() -> tuple[str, ...]:
    """Four of the built-in model's scenes as PNG data URLs, two of each distribution (the first's, the wide
    one's), in sizes up to 200 px."""
    urls = []
    for seed, (width, height) in enumerate(PICTURE_SIZES):
        scene = dataclasses.replace(random_scene(random.Random(seed), wide=seed % 2 == 1), width=width, height=height)
        buffer = io.BytesIO()
        render(scene).save(buffer, "PNG")
        urls.append(_data_url("image/png", buffer.getvalue()))
    return tuple(urls)


@functools.cache
def clip() -> str:
    """A short clip of one moving shape, as an MPEG-4 data URL."""
    buffer = io.BytesIO()
    write_video(buffer, render_motion(random_motion(random.Random(0))), VIDEO_FPS)
    return _data_url("video/mp4", buffer.getvalue())


@st.composite
def media(draw: st.DrawFn) -> tuple[list[str], bool]:
    """0-3 pictures (the same one repeated, often) and whether a video comes with them."""
    images = draw(st.lists(st.integers(0, len(pictures()) - 1), max_size=3))
    return [pictures()[i] for i in images], draw(st.booleans())


def texts() -> st.SearchStrategy[str]:
    """A question the built-in model knows, or any short text (non-ASCII characters included; no media
    placeholder: in a raw prompt, one without its picture is the request's mistake)."""
    text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30).filter(lambda t: "_pad|>" not in t)
    return st.one_of(st.sampled_from(QUESTIONS), text)


# ---- sampling settings ------------------------------------------------------------------------------------


def _floats(low: float, high: float, router: bool = False, **bounds: bool) -> st.SearchStrategy[float]:
    """Any float in the range (one of 32 bits behind sglang-router, which reads them so: a smaller one is 0)."""
    return st.floats(low, high, allow_nan=False, allow_infinity=False, width=32 if router else 64, **bounds)


def _optional(**fields: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    """A dict with any of `fields`, each drawn from its strategy."""
    return st.fixed_dictionaries({}, optional=fields)


def sampling_settings(router: bool = False, seed_name: str = "seed") -> st.SearchStrategy[dict[str, Any]]:
    """Temperature, top-p/top-k/min-p, penalties and a seed, each given or not (OpenAI's names, with vLLM's
    and SGLang's extras; `seed_name` is /generate's `sampling_seed`; behind sglang-router, seeds >= 0, the
    only ones it takes)."""
    return _optional(
        **{
            "temperature": st.one_of(st.just(0), _floats(0, 2, router)),
            "top_p": _floats(0, 1, router, exclude_min=True),
            "top_k": st.one_of(st.just(-1), st.integers(1, 50), st.integers(1, 2 * VOCAB_SIZE)),
            "min_p": _floats(0, 1, router),
            "frequency_penalty": _floats(-2, 2, router),
            "presence_penalty": _floats(-2, 2, router),
            "repetition_penalty": _floats(0, 2, router, exclude_min=True),
            seed_name: st.integers(0 if router else SEED_MIN, SEED_MAX),
        }
    )


def ids() -> st.SearchStrategy[list[int]]:
    """A prompt of 1-8 token ids, any of the vocabulary."""
    return st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8)


def token_ids() -> st.SearchStrategy[int]:
    """Any id of the model's vocabulary, its special tokens often."""
    return st.one_of(st.sampled_from(SPECIAL_IDS), st.integers(0, VOCAB_SIZE - 1))


def stops(router: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """Stop strings (one, or a list of up to 4), stop token ids and SGLang's stop regular expressions (but
    behind sglang-router), each given or not."""
    stop_string = st.one_of(st.sampled_from(STOP_STRINGS), st.text(min_size=1, max_size=3))
    regexes = (
        {}
        if router
        else {
            "stop_regex": st.one_of(st.sampled_from(STOP_REGEXES), st.lists(st.sampled_from(STOP_REGEXES), max_size=3))
        }
    )
    return _optional(
        stop=st.one_of(stop_string, st.lists(stop_string, max_size=4)),
        stop_token_ids=st.lists(token_ids(), max_size=3),
        **regexes,
    )


@st.composite
def lengths(
    draw: st.DrawFn, max_name: str = "max_tokens", min_name: str | None = "min_tokens", lowest: int = 0
) -> dict[str, Any]:
    """The answer's length bounds: `max_name` in 1-24, and `min_name` from `lowest` up to it, or not given."""
    most = draw(st.integers(1, MAX_TOKENS))
    least = draw(st.none() | st.integers(min(lowest, most), most)) if min_name is not None else None
    return {max_name: most, **({min_name: least} if least is not None else {})}


def extras(router: bool = False, bias: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """`ignore_eos` and, with `bias`, `logit_bias` (up to 3 tokens, any id of the vocabulary), each given or
    not."""
    fields = {"ignore_eos": st.booleans()}
    if bias:
        fields["logit_bias"] = st.dictionaries(token_ids().map(str), _floats(-100, 100, router), max_size=3)
    return _optional(**fields)


def stream_fields(router: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """Not streamed, or streamed with or without `stream_options` (usage at the end, or in every chunk but
    behind sglang-router, which drops `continuous_usage_stats`)."""
    continuous = {} if router else {"continuous_usage_stats": st.booleans()}
    options = _optional(include_usage=st.booleans(), **continuous)
    return st.one_of(
        st.just({}),
        st.just({"stream": False}),
        st.just({"stream": True}),
        options.map(lambda o: {"stream": True, "stream_options": o}),
    )


# ---- structured output and tools -----------------------------------------------------------------------


def constraints(router: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """At most one constraint of the answer, in any peer's spelling: OpenAI's `response_format`, vLLM's
    `structured_outputs` (but in a chat behind sglang-router, which drops it), SGLang's `regex`."""
    response_format = st.one_of(
        st.just({"type": "text"}),
        st.just({"type": "json_object"}),
        st.just({"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}}),
        st.just({"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True}}),
    )
    structured_outputs = st.one_of(
        st.just({"json": SCHEMA}),
        st.just({"json": json.dumps(SCHEMA)}),
        st.just({"json_object": True}),
        st.sampled_from(REGEXES).map(lambda r: {"regex": r}),
        st.sampled_from(CHOICES).map(lambda c: {"choice": c}),
        st.sampled_from(list(GRAMMARS)).map(lambda g: {"grammar": g}),
    )
    return st.one_of(
        st.just({}),
        response_format.map(lambda f: {"response_format": f}),
        *([] if router else [structured_outputs.map(lambda s: {"structured_outputs": s})]),
        st.sampled_from(REGEXES).map(lambda r: {"regex": r}),
    )


def has_constraint(body: dict[str, Any]) -> bool:
    """Whether a chat or text completion's body constrains its answer (a "text" response_format does not)."""
    response_format = body.get("response_format") or {}
    return response_format.get("type", "text") != "text" or "structured_outputs" in body or "regex" in body


@st.composite
def chat_tools(draw: st.DrawFn, constrained: bool, router: bool = False) -> dict[str, Any]:
    """No tools, or 1-3 of them with any `tool_choice` (a forced call only where no constraint is given;
    behind sglang-router only what it takes: functions with parameters, no `allowed_tools`)."""
    offered = [f for f in FUNCTIONS if "parameters" in f or not router]
    functions = draw(st.lists(st.sampled_from(offered), min_size=0, max_size=3, unique_by=lambda f: f["name"]))
    if not functions:
        return draw(st.sampled_from([{}, {"tool_choice": "none"}]))
    names = [f["name"] for f in functions]
    named = [{"type": "function", "function": {"name": name}} for name in names]
    allowed = st.builds(
        lambda mode, tools: {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}},
        st.sampled_from(["auto"] if constrained else ["auto", "required"]),
        st.lists(st.sampled_from(named), min_size=1, unique_by=lambda t: t["function"]["name"]),
    )
    choices = [st.just("none"), st.just("auto"), *([] if router else [allowed])]
    if not constrained:
        choices += [st.just("required"), st.sampled_from(named)]
    body = {"tools": [{"type": "function", "function": f} for f in functions]}
    choice = draw(st.none() | st.one_of(choices))
    if choice is not None:
        body["tool_choice"] = choice
    return body | draw(_optional(parallel_tool_calls=st.booleans()))


# ---- the endpoints --------------------------------------------------------------------------------------


@st.composite
def chat_calls(draw: st.DrawFn, router: bool = False, adapter: bool = False) -> Call:
    """A chat completion: a question about 0-3 pictures and maybe a video (with a system message or an
    earlier turn, or not), with every option a chat client may set."""
    images, video = draw(media())
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    parts += [{"type": "video_url", "video_url": {"url": clip()}}] if video else []
    question = draw(texts())
    text = {"type": "text", "text": question}
    content = [*parts, text] if parts else draw(st.sampled_from([question, [text]]))
    messages = draw(
        st.sampled_from(
            [
                [],
                [{"role": "system", "content": "You are a helpful assistant."}],
                [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"}],
            ]
        )
    ) + [{"role": "user", "content": content}]
    body: dict[str, Any] = {"messages": messages, **draw(models(adapter))}
    # (sglang-router refuses a chat's min_tokens of 0)
    body |= draw(lengths(draw(st.sampled_from(["max_tokens", "max_completion_tokens"])), lowest=int(router)))
    body |= draw(sampling_settings(router)) | draw(stops(router)) | draw(extras(router)) | draw(stream_fields(router))
    body |= draw(constraints(router)) | draw(_optional(n=st.integers(1, MAX_N)))
    if draw(st.booleans()):
        body["logprobs"] = True
        body |= draw(_optional(top_logprobs=st.integers(0, MAX_TOP_LOGPROBS)))
    body |= draw(chat_tools(has_constraint(body), router))
    if not router:  # vLLM's echo, and continuing a last assistant message (sglang-router's take is unknown)
        body |= draw(_optional(echo=st.booleans()))
        if "tools" not in body and draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(st.sampled_from(["There", "The image shows"]))})
            body |= {"continue_final_message": True, "add_generation_prompt": False}
    return Call(CHAT, body)


@st.composite
def completion_calls(draw: st.DrawFn, router: bool = False, adapter: bool = False) -> Call:
    """A text completion of one prompt (text or token ids) or a batch of two, with every option (behind
    sglang-router, which requires it, naming its model; a prompt of text, the only kind it takes)."""
    prompt = draw(st.one_of(texts(), st.lists(texts(), min_size=1, max_size=2), *([] if router else [ids()])))
    body: dict[str, Any] = {"prompt": prompt, **draw(lengths())}
    body |= {"model": "default"} if router else draw(models(adapter))
    body |= draw(sampling_settings(router)) | draw(stops(router)) | draw(extras(router)) | draw(stream_fields(router))
    body |= draw(constraints())
    body |= draw(_optional(n=st.integers(1, MAX_N), logprobs=st.integers(0, 5)))
    return Call(COMPLETIONS, body)


@st.composite
def responses_calls(draw: st.DrawFn, adapter: bool = False) -> Call:
    """A response to a string or to a message of 0-3 pictures, maybe a video, and text; with instructions,
    a text format, tools, log-probs, streaming, or not."""
    images, video = draw(media())
    question = draw(texts())
    parts = [{"type": "input_image", "image_url": url} for url in images]
    parts += [{"type": "video_url", "video_url": {"url": clip()}}] if video else []
    if parts or draw(st.booleans()):
        content = [*parts, {"type": "input_text", "text": question}]
        body: dict[str, Any] = {"input": [{"role": "user", "content": content}]}
    else:
        body = {"input": question}
    body |= draw(lengths("max_output_tokens", None)) | draw(sampling_settings()) | draw(models(adapter))
    body |= draw(_optional(instructions=st.just("Answer briefly."), store=st.booleans()))
    streams = [{}, {"stream": True}, {"stream": True, "stream_options": {"include_obfuscation": False}}]
    body |= draw(st.sampled_from(streams))
    text_format = draw(
        st.sampled_from(
            [
                None,
                {"type": "text"},
                {"type": "json_object"},
                {"type": "json_schema", "name": "scene", "schema": SCHEMA},
            ]
        )
    )
    if text_format is not None:
        body["text"] = {"format": text_format}
    if draw(st.booleans()):
        body["include"] = ["message.output_text.logprobs"]
        body |= draw(_optional(top_logprobs=st.integers(0, MAX_TOP_LOGPROBS)))
    tools = draw(chat_tools(text_format is not None and text_format["type"] != "text"))
    if "tools" in tools:  # in the Responses API's shapes
        body["tools"] = [{"type": "function", **tool["function"]} for tool in tools["tools"]]
        choice = tools.get("tool_choice")
        if isinstance(choice, dict) and choice["type"] == "function":
            choice = {"type": "function", "name": choice["function"]["name"]}
        elif isinstance(choice, dict):
            allowed = choice["allowed_tools"]
            named = [{"type": "function", "name": t["function"]["name"]} for t in allowed["tools"]]
            choice = {"type": "allowed_tools", "mode": allowed["mode"], "tools": named}
        if choice is not None:
            body["tool_choice"] = choice
        if "parallel_tool_calls" in tools:
            body["parallel_tool_calls"] = tools["parallel_tool_calls"]
    return Call(RESPONSES, body)


@st.composite
def generate_calls(draw: st.DrawFn, router: bool = False, adapter: bool = False) -> Call:
    """SGLang's /generate: a chat-formatted text with 0-3 pictures and maybe a video, token ids, or a
    batch of two prompts (of token ids behind sglang-router, which takes no batch of texts); SGLang's
    sampling parameters (but `logit_bias` behind sglang-router, which drops it), log-probs, streaming."""
    images, video = draw(media())
    question = draw(texts())
    media_text = IMAGE_PLACEHOLDER * len(images) + (VIDEO_PLACEHOLDER if video else "")
    text = f"<|im_start|>user\n{media_text}{question}<|im_end|>\n<|im_start|>assistant\n"
    form = draw(st.sampled_from(["text", "ids", "batch"]))
    if images or video or form == "text":
        body: dict[str, Any] = {"text": text}
        body |= {"image_data": images} if images else {}
        body |= {"video_data": clip()} if video else {}
    elif form == "ids":
        body = {"input_ids": draw(ids())}
    elif router or draw(st.booleans()):
        body = {"input_ids": draw(st.lists(ids(), min_size=2, max_size=2))}
    else:
        body = {"text": draw(st.lists(texts(), min_size=2, max_size=2))}
    params = draw(lengths("max_new_tokens", "min_new_tokens"))
    params |= draw(sampling_settings(router, "sampling_seed"))
    params |= draw(stops(router)) | draw(extras(router, bias=not router)) | draw(_optional(n=st.integers(1, MAX_N)))
    constraint = draw(
        st.sampled_from(
            [
                {},
                {"json_schema": json.dumps(SCHEMA)},
                *({"regex": r} for r in REGEXES),
                *({"ebnf": g} for g in GRAMMARS),
            ]
        )
    )
    body["sampling_params"] = params | constraint
    body |= draw(_optional(stream=st.booleans()))
    if adapter:  # (SGLang's way to name it; `model` works too)
        body |= draw(st.sampled_from([{}, {"lora_path": ADAPTER}, {"model": ADAPTER}]))
    if draw(st.booleans()):
        body |= {"return_logprob": True} | draw(
            _optional(top_logprobs_num=st.integers(0, MAX_TOP_LOGPROBS), return_text_in_logprobs=st.booleans())
        )
    return Call(GENERATE, body)


def calls(router: bool = False, adapter: bool = False) -> st.SearchStrategy[Call]:
    """A valid request to any of the four generating endpoints; with `router`, one that sglang-router's PD
    mode passes on whole (it has no Responses API); with `adapter`, some through the LoRA adapter `ADAPTER`
    (which the server then serves)."""
    endpoints = [chat_calls(router, adapter), completion_calls(router, adapter), generate_calls(router, adapter)]
    return st.one_of(*endpoints, *([] if router else [responses_calls(adapter)])).map(copy.deepcopy)


def models(adapter: bool) -> st.SearchStrategy[dict[str, str]]:
    """No `model`, the served one by SGLang's alias, or (with `adapter`) the LoRA adapter `ADAPTER`."""
    return st.sampled_from([{}, {"model": "default"}, *([{"model": ADAPTER}] if adapter else [])])
