"""Request options and leniency of the chat-completions API, as clients written for vLLM and SGLang use
them: a real `vlm-serve serve` subprocess driven by the official `openai` client (and raw HTTP for what
the client will not send). transformers' tokenizer is the oracle for how a conversation is rendered."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest

from helpers import ServerProcess, running_server
from vlm_serve.detokenizer import TextStream
from vlm_serve.testing.media import make_image, make_video
from vlm_serve.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

MAX_FRAMES = 32  # --mm-max-frames
MAX_IMAGE_PIXELS = 1 << 20  # --mm-max-image-pixels


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    make_image(192, 128, seed=1).save(folder / "cat.png")
    make_video(folder / "clip.mp4", num_frames=8, fps=4, size=(64, 48), seed=2)
    return folder


@pytest.fixture(scope="module")
def server(tiny_moe_dir: Path, media_dir: Path):
    with running_server(
        tiny_moe_dir,
        "--allowed-local-media-path",
        str(media_dir),
        "--mm-max-frames",
        str(MAX_FRAMES),
        "--mm-max-image-pixels",
        str(MAX_IMAGE_PIXELS),
    ) as srv:
        yield srv


def post(server: ServerProcess, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_refused(response: httpx.Response, *fragments: str) -> None:
    """A 400 in OpenAI's error shape whose message holds every fragment."""
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for fragment in fragments:
        assert fragment in message, message


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def with_image(media_dir: Path, **options) -> list[dict]:
    part = {"type": "image_url", "image_url": {"url": str(media_dir / "cat.png")}, **options}
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]


def with_video(media_dir: Path, **options) -> list[dict]:
    part = {"type": "video_url", "video_url": {"url": str(media_dir / "clip.mp4")}, **options}
    return [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]


def media_tokens(client: openai.OpenAI, model: str, messages: list[dict], **extra) -> list[int]:
    """The tokens each image / video of `messages` became, with the request fields `extra`."""
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body=extra)
    return [item["tokens"] for item in reply.usage.prompt_tokens_details.media]


# ---- add_generation_prompt, continue_final_message, chat_template_kwargs -------------------------------

STORY = [{"role": "user", "content": "Tell me a story."}]
CONTINUED = {
    "text": [*STORY, {"role": "assistant", "content": "Once upon a time"}],
    "trailing space": [*STORY, {"role": "assistant", "content": "Once upon a time, "}],
    "text parts": [
        *STORY,
        {"role": "assistant", "content": [{"type": "text", "text": "Once"}, {"type": "text", "text": " upon a"}]},
    ],
    "multi turn": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, *STORY, {"role": "assistant", "content": "Once"},
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONTINUED))
def test_a_continued_message_is_rendered_as_transformers_renders_it(ours: Tokenizer, theirs, name: str):
    messages = CONTINUED[name]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    expected = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == expected
    assert not rendered.endswith("<|im_end|>\n")


@pytest.mark.server
def test_the_answer_continues_the_final_assistant_message(client, model, theirs):
    messages = CONTINUED["text"]
    continued = {"continue_final_message": True, "add_generation_prompt": False}  # as vLLM's clients send it
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body=continued
    )
    prompt = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    same_prompt = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == same_prompt.choices[0].text
    assert reply.usage.prompt_tokens == same_prompt.usage.prompt_tokens == len(theirs.encode(prompt))
    # SGLang's clients send continue_final_message alone
    alone = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"continue_final_message": True}
    )
    assert alone.choices[0].message.content == reply.choices[0].message.content
    # without it the assistant message is a finished turn, and a new one starts
    new_turn = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert new_turn.usage.prompt_tokens == len(theirs.encode(rendered)) > reply.usage.prompt_tokens


@pytest.mark.server
def test_without_a_generation_prompt(client, model, theirs):
    messages = user("Hi")
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, extra_body={"add_generation_prompt": False}
    )
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert reply.usage.prompt_tokens == len(theirs.encode(rendered))


@pytest.mark.server
def test_chat_template_kwargs_reach_the_template(client, model, theirs, media_dir):
    messages = with_image(media_dir)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    numbered = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"add_vision_id": True, "enable_thinking": False}},
    )

    def rendered_tokens(**extra) -> int:
        rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return len(theirs.encode(rendered))

    added = rendered_tokens(add_vision_id=True) - rendered_tokens()
    assert added > 0
    assert numbered.usage.prompt_tokens == plain.usage.prompt_tokens + added


def echoed_and_plain(client, model, messages: list[dict], **extra) -> tuple:
    """The same greedy chat request with vLLM's `echo` and without it (log-probs on)."""
    request = dict(model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    echoed = client.chat.completions.create(**request, extra_body={"echo": True, **extra})
    plain = client.chat.completions.create(**request, extra_body=extra)
    return echoed, plain


@pytest.mark.server
@pytest.mark.parametrize("continued", [True, False], ids=["continuing it", "after it"])
def test_echo_starts_the_answer_with_the_final_assistant_message(client, model, continued):
    """As in vLLM: the echoed text has no log-probs and no tokens in the usage."""
    extra = {"continue_final_message": True, "add_generation_prompt": False} if continued else {}
    echoed, plain = echoed_and_plain(client, model, CONTINUED["text"], **extra)
    assert echoed.choices[0].message.content == "Once upon a time" + plain.choices[0].message.content
    assert echoed.choices[0].message.role == "assistant"
    echoed_logprobs, plain_logprobs = echoed.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [t.token for t in echoed_logprobs] == [t.token for t in plain_logprobs]
    assert [t.logprob for t in echoed_logprobs] == pytest.approx([t.logprob for t in plain_logprobs], abs=1e-3)
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (
        plain.usage.prompt_tokens,
        plain.usage.completion_tokens,
    )
    stream = client.chat.completions.create(
        model=model,
        messages=CONTINUED["text"],
        max_tokens=8,
        temperature=0,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
        extra_body={"echo": True, **extra},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == "Once upon a time"
    assert chunks[1].choices[0].logprobs is None
    assert "".join(d.content or "" for d in deltas) == echoed.choices[0].message.content
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in plain.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


@pytest.mark.server
def test_echo_of_a_user_message_adds_nothing_after_a_generation_prompt(client, model):
    """The answer's role is the assistant's: a last user message is not echoed. Without a generation
    prompt the answer goes on from the last message and has its role, as in vLLM: that one is echoed."""
    echoed, plain = echoed_and_plain(client, model, STORY)
    assert echoed.choices[0].message.content == plain.choices[0].message.content
    echoed, plain = echoed_and_plain(client, model, STORY, add_generation_prompt=False)
    assert echoed.choices[0].message.role == plain.choices[0].message.role == "user"
    assert echoed.choices[0].message.content == "Tell me a story." + plain.choices[0].message.content
    # text parts are echoed one per line
    echoed, plain = echoed_and_plain(client, model, CONTINUED["text parts"], continue_final_message=True)
    assert echoed.choices[0].message.content == "Once\n upon a" + plain.choices[0].message.content


@pytest.mark.server
def test_prompt_options_that_contradict_each_other_are_refused(server, model):
    assistant_last = CONTINUED["text"]
    both = {"continue_final_message": True, "add_generation_prompt": True}
    response = post(server, {"messages": assistant_last, **both})
    assert_refused(response, "continue_final_message", "add_generation_prompt")
    assert_refused(post(server, {"messages": STORY, "continue_final_message": True}), "assistant", "'user'")
    assert_refused(
        post(server, {"messages": STORY, "chat_template_kwargs": {"add_generation_prompt": False}}),
        "chat_template_kwargs",
        "add_generation_prompt",
    )
    # the same rules hold for /tokenize, which renders chat messages as a chat completion does
    assert_refused(post(server, {"messages": STORY, "continue_final_message": True}, "/tokenize"), "assistant")


# ---- sampling options ------------------------------------------------------------------------------------


@pytest.mark.server
def test_stop_token_ids_are_token_ids_of_the_vocabulary(client, model, server, ours):
    messages = user("Tell me a story.")
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True)
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    # a token of the answer that is one id of its own and not used before it
    j = next(j for j in range(1, len(tokens)) if len(ours.encode(tokens[j])) == 1 and tokens[j] not in tokens[:j])
    [stop_id] = ours.encode(tokens[j])
    cut = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == "".join(tokens[:j])
    assert cut.choices[0].model_extra["matched_stop"] == stop_id
    for bad in (10**9, -1):
        response = post(server, {"model": model, "messages": messages, "max_tokens": 2, "stop_token_ids": [5, bad]})
        assert_refused(response, "stop_token_ids", str(bad), "vocabulary")


def regex_ending_at(tokens: list[str]) -> tuple[int, str]:
    """A token j of an answer (its tokens' texts) and a regex whose first match in the answer ends with
    that token: its last two characters, alone or after digits."""
    for j in range(1, len(tokens)):
        tail = tokens[j][-2:]
        if tail.strip() and len(tail) == 2 and tail not in "".join(tokens[:j]) + tokens[j][:-1]:
            return j, rf"\d{{3}}|{re.escape(tail)}"
    pytest.skip("no token to end a stop_regex match with")


@pytest.mark.server
def test_stop_regex_ends_the_answer_with_its_first_match_kept(client, model, server):
    """SGLang's `stop_regex`: the answer ends with the token that completes a match of a pattern, the
    match kept (as SGLang keeps it), and `matched_stop` is the pattern; streamed, the same text."""
    request = dict(model=model, messages=user("Tell me a story."), max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**request, logprobs=True)
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    j, pattern = regex_ending_at(tokens)
    cut = client.chat.completions.create(**request, extra_body={"stop_regex": [pattern]})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["matched_stop"] == pattern
    assert cut.choices[0].message.content == "".join(tokens[: j + 1])
    assert cut.usage.completion_tokens == j + 1
    chunks = list(client.chat.completions.create(**request, stream=True, extra_body={"stop_regex": pattern}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    # text completions take it too
    text = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**text, logprobs=0)
    j, pattern = regex_ending_at(whole.choices[0].logprobs.tokens)
    cut = client.completions.create(**text, extra_body={"stop_regex": pattern})
    assert cut.choices[0].text == "".join(whole.choices[0].logprobs.tokens[: j + 1])
    assert cut.choices[0].model_extra["matched_stop"] == pattern


@pytest.mark.server
def test_an_invalid_stop_regex_is_refused_naming_the_pattern(server, model):
    for path, body in (("/v1/chat/completions", {"messages": user("Hi")}), ("/v1/completions", {"prompt": "Hi"})):
        response = post(server, {"model": model, "max_tokens": 2, **body, "stop_regex": ["ok", "(a"]}, path)
        assert_refused(response, "stop_regex", "'(a'", "not a valid regular expression")
        assert response.json()["error"]["param"] == "stop_regex"


@pytest.mark.server
def test_a_seed_is_a_signed_64_bit_integer(client, model, server):
    messages = user("Pick a word.")
    for bad in (2**63, -(2**63) - 1):
        assert_refused(post(server, {"model": model, "messages": messages, "seed": bad}), "seed")
    sampled = dict(model=model, messages=messages, max_tokens=6, temperature=1.0)
    biggest = client.chat.completions.create(**sampled, seed=2**63 - 1, n=2)
    again = client.chat.completions.create(**sampled, seed=2**63 - 1, n=2)
    assert [c.message.content for c in biggest.choices] == [c.message.content for c in again.choices]
    # choice i uses seed + i, wrapping around within the 64-bit range
    smallest = client.chat.completions.create(**sampled, seed=-(2**63))
    assert smallest.choices[0].message.content == biggest.choices[1].message.content


@pytest.mark.server
def test_stream_options_need_a_stream(server, model):
    body = {"model": model, "messages": user("Hi"), "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert_refused(post(server, body), "stream_options", "stream")
    assert_refused(post(server, {**body, "stream": False}), "stream_options")
    completion = {"model": model, "prompt": "Hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert_refused(post(server, completion, "/v1/completions"), "stream_options")


@pytest.mark.server
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, model):
    """With `include_usage`, every chunk carries its choice's usage so far, and a last chunk the total;
    without it, no chunk has usage (as in vLLM: continuous usage only comes with include_usage)."""
    request = dict(model=model, messages=user("Tell me a story."), max_tokens=8, temperature=0, stream=True)
    both = {"continuous_usage_stats": True, "include_usage": True}
    chunks = list(client.chat.completions.create(**request, stream_options=both))
    whole = client.chat.completions.create(**{**request, "stream": False})
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chunks = chunks[:-1]
    assert all(c.usage is not None and c.choices for c in chunks)
    assert chunks[0].usage.completion_tokens == 0
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == whole.usage.completion_tokens
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    alone = list(client.chat.completions.create(**request, stream_options={"continuous_usage_stats": True}))
    assert alone and all(c.usage is None and c.choices for c in alone)
    # text completions too
    text = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    pieces = list(client.completions.create(**text, stream=True, stream_options=both))
    assert all(c.usage is not None for c in pieces) and pieces[-1].choices == []
    assert pieces[-1].usage.completion_tokens == client.completions.create(**text).usage.completion_tokens
    alone = list(client.completions.create(**text, stream=True, stream_options={"continuous_usage_stats": True}))
    assert alone and all(c.usage is None for c in alone)


# ---- vLLM's media options ------------------------------------------------------------------------------


@pytest.mark.server
def test_mm_processor_kwargs_set_what_parts_do_and_parts_win(client, model, media_dir):
    def tokens(messages: list[dict], **extra) -> list[int]:
        return media_tokens(client, model, messages, **extra)

    small, medium = 32 * 32 * 6, 32 * 32 * 12
    default = tokens(with_image(media_dir))
    per_part = tokens(with_image(media_dir, max_pixels=small))
    assert per_part[0] < tokens(with_image(media_dir, max_pixels=medium))[0] < default[0]
    assert tokens(with_image(media_dir), mm_processor_kwargs={"max_pixels": small}) == per_part
    nested = {"max_pixels": medium, "images_kwargs": {"max_pixels": small}}  # a modality's own options win
    assert tokens(with_image(media_dir), mm_processor_kwargs=nested) == per_part
    assert tokens(with_image(media_dir, max_pixels=small), mm_processor_kwargs={"max_pixels": medium}) == per_part
    # flat options reach videos too; fps only videos
    assert tokens(with_video(media_dir), mm_processor_kwargs={"fps": 4}) == tokens(with_video(media_dir, fps=4))
    assert tokens(with_video(media_dir, fps=4), mm_processor_kwargs={"videos_kwargs": {"fps": 2}}) == tokens(
        with_video(media_dir, fps=4)
    )


@pytest.mark.server
def test_media_io_kwargs_num_frames_caps_the_frames(client, model, media_dir):
    eight = media_tokens(client, model, with_video(media_dir, fps=4))  # 8 frames: the whole 2 s clip at 4 fps
    four = media_tokens(client, model, with_video(media_dir, fps=4, max_frames=4))
    assert four[0] < eight[0]
    io = {"video": {"num_frames": 4}}
    assert media_tokens(client, model, with_video(media_dir, fps=4), media_io_kwargs=io) == four


@pytest.mark.server
def test_media_options_are_checked_against_the_server_caps(server, model, media_dir):
    def refused(messages: list[dict], *fragments: str, **extra) -> None:
        assert_refused(post(server, {"model": model, "messages": messages, "max_tokens": 1, **extra}), *fragments)

    refused(with_image(media_dir), "max_pixels", str(MAX_IMAGE_PIXELS), mm_processor_kwargs={"max_pixels": 2**30})
    refused(with_image(media_dir), "max_pixels", mm_processor_kwargs={"images_kwargs": {"max_pixels": 2**30}})
    refused(with_video(media_dir), "max_frames", str(MAX_FRAMES), media_io_kwargs={"video": {"num_frames": 1000}})
    refused(with_image(media_dir, min_pixels=4096), "min_pixels", mm_processor_kwargs={"max_pixels": 2048})
    refused(with_image(media_dir), "size", mm_processor_kwargs={"size": {"longest_edge": 100}})  # not supported
    refused(with_image(media_dir), "max_pixels", mm_processor_kwargs={"max_pixels": 0})


# ---- leniency ------------------------------------------------------------------------------------------


@pytest.mark.server
def test_unknown_keys_of_content_parts_are_ignored(client, model, media_dir):
    plain = client.chat.completions.create(model=model, messages=with_image(media_dir), max_tokens=6, temperature=0)
    extras = [
        {
            "role": "user",
            "content": [
                {
                    "type": "image_url",
                    "modalities": "image",
                    "uuid": "cat-1",  # SGLang's and vLLM's
                    "image_url": {"url": str(media_dir / "cat.png"), "detail": "auto", "max_dynamic_patch": 4},
                },
                {"type": "text", "text": "What is it?", "cache_control": {"type": "ephemeral"}},
            ],
        }
    ]
    reply = client.chat.completions.create(model=model, messages=extras, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.server
def test_any_role_reaches_the_chat_template(client, model, server, theirs):
    messages = [{"role": "narrator", "content": "It was late."}, *user("Hi")]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(theirs.encode(rendered))
    # what the template cannot render is the client's mistake: a 400
    broken = [*user("Hi"), {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]
    assert_refused(post(server, {"model": model, "messages": broken}), "chat template")


@pytest.mark.server
def test_a_bare_string_for_a_media_object_is_refused(server, model, media_dir):
    for kind, file in (("image_url", "cat.png"), ("video_url", "clip.mp4")):
        parts = [{"type": "text", "text": "Look"}, {"type": kind, kind: str(media_dir / file)}]
        messages = [{"role": "user", "content": parts}]
        response = post(server, {"model": model, "messages": messages})
        assert_refused(response, "messages.0.content.parts.1", f"{kind} must be an object")


# ---- streamed logprobs travel with their text --------------------------------------------------------

# prompts whose greedy answers hold tokens that are part of a UTF-8 character (their text waits for the
# next token) as a chat message and as a text prompt
MULTIBYTE = "日本語で答えて"
MULTIBYTE_PROMPT = "Write in Japanese."


def test_text_stream_releases_tokens_with_their_whole_text(ours: Tokenizer):
    ids = ours.encode("Hello wörld 日本語 🙂 end")
    for holdback in (0, 3, 8):
        stream = TextStream(ours, holdback)
        released = 0
        for k in range(1, len(ids) + 1):
            piece, count = stream.update(ids[:k])
            released += count
            assert count == 0 or piece  # tokens come out with text
            assert stream.sent.startswith(ours.decode(ids[:released]))  # all of their text is out
            if released < k:  # the next token's is not
                assert not stream.sent.startswith(ours.decode(ids[: released + 1]))
        piece, count = stream.finish(ids, None, None)
        assert released + count == len(ids) and stream.sent == ours.decode(ids)


def held_back_request(model: str, whole_text: str) -> dict:
    """A stop string that matches the answer's beginning, then never: the text after that waits."""
    return dict(model=model, max_tokens=16, temperature=0, stop=[whole_text[:6] + "\u2603"])


@pytest.mark.server
def test_streamed_chat_chunks_carry_text_with_their_logprobs(client, model):
    messages = user(MULTIBYTE)
    base = dict(model=model, messages=messages, max_tokens=16, temperature=0)
    text = client.chat.completions.create(**base).choices[0].message.content
    request = dict(held_back_request(model, text), messages=messages, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**request)
    entries = whole.choices[0].logprobs.content
    assert any("\ufffd" in t.token for t in entries), "the answer no longer holds a partial UTF-8 character"
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = []
    for chunk in chunks[1:]:
        [choice] = chunk.choices
        assert choice.delta.content or choice.finish_reason is not None, chunk
        streamed += choice.logprobs.content if choice.logprobs else []
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content == text
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in entries]
    assert len(streamed) == whole.usage.completion_tokens


@pytest.mark.server
def test_streamed_completion_chunks_carry_text_with_their_logprobs(client, model):
    text = client.completions.create(model=model, prompt=MULTIBYTE_PROMPT, max_tokens=16, temperature=0).choices[0].text
    request = dict(held_back_request(model, text), prompt=MULTIBYTE_PROMPT, logprobs=2)
    whole = client.completions.create(**request)
    assert any("\ufffd" in t for t in whole.choices[0].logprobs.tokens), "no partial UTF-8 character any more"
    chunks = [c for c in client.completions.create(**request, stream=True) if c.choices]
    tokens, token_logprobs = [], []
    for chunk in chunks:
        [choice] = chunk.choices
        assert choice.text or choice.finish_reason is not None, chunk
        tokens += choice.logprobs.tokens
        token_logprobs += choice.logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text == text
    assert tokens == whole.choices[0].logprobs.tokens and token_logprobs == whole.choices[0].logprobs.token_logprobs
    assert len(tokens) == whole.usage.completion_tokens
