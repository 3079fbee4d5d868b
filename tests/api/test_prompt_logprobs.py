"""Prompt log-probs (vLLM's `prompt_logprobs`) and the `/v1/completions` features that use them.

In the engine: each prompt token's log-prob, rank and top alternatives equal log_softmax of
transformers' logits for the same checkpoint, for text and for a chat with an image, in one forward
or over small prefill chunks, with the prompt already in the RadixCache, when the request is retracted
and prefilled again, under both event loops. Through a real server with the `openai` client: lists of
prompts (each with its `n` choices), `echo` with and without logprobs, `logprobs: 0`, and the
`prompt_logprobs` field of completions and chat completions in vLLM's shape.
"""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
import transformers

from vlm_serve.engine import Engine
from vlm_serve.messages.logprobs import PromptLogprobs
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer

TOP = 3
RTOL = 1e-4  # of the largest logit, as in test_model_parity
LOOPS = {"normal": {"disable_overlap_schedule": True}, "overlap": {"disable_overlap_schedule": False}}
CHUNKING = {"one_forward": {"chunked_prefill_size": -1}, "chunks_of_8": {"chunked_prefill_size": 8}}


def _conversations() -> dict[str, list[dict]]:
    return {
        "text": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a story about a cat who sails the seas with a dog."},
        ],
        "image": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": make_image(96, 64, seed=1)},
                    {"type": "text", "text": "Describe what you see in a few words."},
                ],
            }
        ],
    }


@pytest.fixture(scope="module")
def inputs(tiny_moe_dir) -> dict[str, ProcessedInput]:
    processor = MultimodalProcessor.from_pretrained(tiny_moe_dir, Tokenizer.from_pretrained(tiny_moe_dir))
    return {name: processor.process_messages(conv) for name, conv in _conversations().items()}


@pytest.fixture(scope="module")
def reference(tiny_moe_dir, inputs) -> dict[str, tuple[torch.Tensor, float]]:
    """Per input: transformers' log-probs at every prompt position but the last, (len - 1, vocab), and
    the tolerance (RTOL of its largest logit)."""
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    out = {}
    for name, x in inputs.items():
        ids = torch.tensor([x.input_ids])
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        kwargs["mm_token_type_ids"] = (ids == hf.config.image_token_id).int()
        if x.mm_items:
            kwargs["pixel_values"] = torch.cat([it.pixel_values for it in x.mm_items])
            kwargs["image_grid_thw"] = torch.tensor([it.grid_thw for it in x.mm_items])
        with torch.no_grad():
            logits = hf(**kwargs).logits[0]
        out[name] = (torch.log_softmax(logits[:-1], dim=-1), RTOL * logits.abs().max().item())
    return out


def assert_matches(scores: PromptLogprobs, x: ProcessedInput, ref: tuple[torch.Tensor, float], top: int = TOP) -> None:
    """Every prompt token from the second on: its log-prob, a rank consistent with transformers' log-probs
    (ties within the tolerance may go either way) and its `top` best alternatives."""
    logprobs, tol = ref
    assert scores.token_ids == x.input_ids[1:]
    want = logprobs.gather(1, torch.tensor(x.input_ids[1:])[:, None]).squeeze(1)
    assert (torch.tensor(scores.logprobs) - want).abs().max() < tol
    for row, value, rank, alternatives in zip(logprobs, want, scores.ranks, scores.top_logprobs):
        assert int((row > value + tol).sum()) + 1 <= rank <= int((row >= value - tol).sum())
        assert len(alternatives) == top
        if top:
            ids, values = zip(*alternatives)
            assert (torch.tensor(values) - row.topk(top).values).abs().max() < tol
            assert (torch.tensor(values) - row[list(ids)]).abs().max() < tol


# ---- the engine --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[(loop, chunking) for loop in LOOPS for chunking in CHUNKING], ids="-".join)
def engine(request, tiny_moe_dir):
    loop, chunking = request.param
    with Engine(tiny_moe_dir, dtype="float32", vit_dp=0, **LOOPS[loop], **CHUNKING[chunking]) as engine:
        yield engine
        engine.scheduler.check_memory()


def _run_together(engine: Engine, jobs: list[tuple[ProcessedInput, dict]]):
    """Requests with different settings, submitted at once (scheduled in the same batches)."""
    submissions = [engine.submit(x, max_tokens=3, temperature=0, **sampling) for x, sampling in jobs]
    while not all(s.done for s in submissions) or not engine.scheduler.is_idle():
        engine.step()
    return [engine.result(s) for s in submissions]


def test_prompt_logprobs_equal_transformers(engine, inputs, reference):
    """Text and a chat with an image (8-token chunks cut through it), batched with a request that asks
    for none."""
    scored = {"prompt_logprobs": TOP}
    jobs = [(inputs["text"], scored), (inputs["image"], scored), (inputs["text"], {})]
    text, image, plain = _run_together(engine, jobs)
    assert_matches(text.prompt_logprobs, inputs["text"], reference["text"])
    assert_matches(image.prompt_logprobs, inputs["image"], reference["image"])
    assert plain.prompt_logprobs is None
    assert text.token_ids == plain.token_ids  # asking for them changes nothing else


def test_a_prompt_in_the_prefix_cache_is_computed_again(engine, inputs, reference):
    """Cached positions have no logits: the request takes no prefix from the cache, which still
    serves the requests that ask for no prompt log-probs."""
    x = inputs["image"]
    first = engine.generate_processed([x], max_tokens=2, temperature=0)[0]
    scored = engine.generate_processed([x], max_tokens=2, temperature=0, prompt_logprobs=0)[0]
    again = engine.generate_processed([x], max_tokens=2, temperature=0)[0]
    assert scored.cached_tokens == 0 and again.cached_tokens > 0
    assert_matches(scored.prompt_logprobs, x, reference["image"], top=0)
    assert first.token_ids == scored.token_ids == again.token_ids


def test_a_prompt_with_n_choices(engine, inputs, reference):
    """Each choice computes them (none takes the prompt from another's cache); the output holds the first's."""
    out = engine.generate_processed([inputs["text"]], max_tokens=2, temperature=0, n=3, prompt_logprobs=1)[0]
    assert_matches(out.prompt_logprobs, inputs["text"], reference["text"], top=1)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_retracted_requests_keep_their_prompt_logprobs(tiny_moe_dir, inputs, reference, loop):
    """A pool that holds both prompts and one answer: the second request is admitted once the first
    runs, and one is retracted while they decode, then prefilled again (from the prefix cache). The
    prompt log-probs are neither lost nor doubled."""
    max_tokens = 24
    pool = sum(len(x.input_ids) for x in inputs.values()) + max_tokens + 4
    with Engine(
        tiny_moe_dir,
        dtype="float32",
        vit_dp=0,
        max_total_tokens=pool,
        schedule_conservativeness=0.05,
        chunked_prefill_size=16,
        **LOOPS[loop],
    ) as engine:
        jobs = [inputs["image"], inputs["text"]] * 2
        outs = engine.generate_processed(jobs, max_tokens=max_tokens, temperature=0, prompt_logprobs=1)
        engine.scheduler.check_memory()
        assert engine.scheduler.metrics.num_retractions > 0
    for x, out in zip(jobs, outs):
        assert_matches(out.prompt_logprobs, x, reference["text" if x is inputs["text"] else "image"], top=1)


# ---- the server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_moe_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_moe_dir)


PROMPTS = ["The capital of France is", "Once upon a time, a small robot"]
GREEDY = {"max_tokens": 5, "temperature": 0}


@pytest.mark.server
def test_a_batch_of_prompts_gets_n_choices_each(client, model, tokenizer):
    """Prompt i's choice j is choice i * n + j; text, token-id and batched forms agree with one prompt
    at a time, and usage adds up over the prompts."""
    alone = [client.completions.create(model=model, prompt=p, **GREEDY) for p in PROMPTS]
    id_lists = [tokenizer.encode(p) for p in PROMPTS]
    for prompt in (PROMPTS, id_lists):
        reply = client.completions.create(model=model, prompt=prompt, n=2, **GREEDY)
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert [c.text for c in reply.choices] == [a.choices[0].text for a in alone for _ in range(2)]
        assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert reply.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    one_id_list = client.completions.create(model=model, prompt=id_lists[0], **GREEDY)
    assert one_id_list.choices[0].text == alone[0].choices[0].text

    streamed = client.completions.create(
        model=model, prompt=PROMPTS, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, usage = ["", "", "", ""], None
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [a.choices[0].text for a in alone for _ in range(2)]
    assert usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


@pytest.mark.server
def test_empty_prompt_lists_are_rejected(server, model):
    for prompt in ([], [[]], [[1, 2], []]):
        response = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": prompt}, timeout=30)
        assert response.status_code == 400, prompt
        assert "empty list" in response.json()["error"]["message"]


@pytest.mark.server
def test_echo_prepends_the_prompt(client, model, tokenizer):
    plain = client.completions.create(model=model, prompt=PROMPTS[0], **GREEDY).choices[0].text
    echoed = client.completions.create(model=model, prompt=PROMPTS[0], echo=True, **GREEDY).choices[0]
    assert echoed.text == PROMPTS[0] + plain and echoed.logprobs is None
    ids = tokenizer.encode(PROMPTS[1])
    from_ids = client.completions.create(model=model, prompt=[ids], echo=True, **GREEDY).choices[0]
    assert from_ids.text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    streamed = client.completions.create(model=model, prompt=PROMPTS[0], echo=True, stream=True, **GREEDY)
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert pieces[0].startswith(PROMPTS[0]) and "".join(pieces) == echoed.text


@pytest.mark.server
def test_echo_with_logprobs_scores_the_prompt_tokens(client, model, tokenizer):
    """The prompt's tokens come first, the first one with no log-prob (nothing predicts it), as in vLLM,
    then the answer's as without echo."""
    ids = tokenizer.encode(PROMPTS[1])
    plain = client.completions.create(model=model, prompt=PROMPTS[1], logprobs=2, **GREEDY).choices[0]
    echoed = client.completions.create(model=model, prompt=PROMPTS[1], logprobs=2, echo=True, **GREEDY).choices[0]
    lp = echoed.logprobs
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # each token's own entry, then its 2 best alternatives (the token may be one of them)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert all(
        top[token] == logprob for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:])
    )
    assert lp.token_logprobs[len(ids) :] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-3)
    assert lp.text_offset[len(ids)] == len(PROMPTS[1])
    assert lp.text_offset[: len(ids)] == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(ids))]

    streamed = client.completions.create(model=model, prompt=PROMPTS[1], logprobs=2, echo=True, stream=True, **GREEDY)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


@pytest.mark.server
def test_logprobs_0_gives_each_tokens_own_logprob(client, model):
    """Each `top_logprobs` entry holds the sampled token (as OpenAI's legacy API and vLLM give it)."""
    reply = client.completions.create(model=model, prompt=PROMPTS[0], logprobs=0, **GREEDY)
    lp, n = reply.choices[0].logprobs, reply.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n > 0
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs == [{token: logprob} for token, logprob in zip(lp.tokens, lp.token_logprobs)]


def _check_vllm_shape(body: list, ids: list[int], top: int) -> None:
    """vLLM's prompt_logprobs: None, then per token {id: {logprob, rank, decoded_token}} holding the
    token itself and its `top` best alternatives (ranks 1..top)."""
    assert len(body) == len(ids) and body[0] is None
    for token_id, entry in zip(ids[1:], body[1:]):
        assert str(token_id) in entry and top <= len(entry) <= top + 1
        ranks = sorted(e["rank"] for key, e in entry.items() if key != str(token_id))
        assert ranks == list(range(1, top + 1))[: len(ranks)]
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())


@pytest.mark.server
def test_prompt_logprobs_in_vllms_shape(client, server, model, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    reply = client.completions.create(model=model, prompt=PROMPTS[0], n=2, extra_body={"prompt_logprobs": 2}, **GREEDY)
    echoed = client.completions.create(model=model, prompt=PROMPTS[0], logprobs=0, echo=True, **GREEDY).choices[0]
    for choice in reply.choices:
        body = choice.model_extra["prompt_logprobs"]
        _check_vllm_shape(body, ids, 2)
        own = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], body[1:])]
        assert own == pytest.approx(echoed.logprobs.token_logprobs[1 : len(ids)], abs=1e-3)
    plain = client.completions.create(model=model, prompt=PROMPTS[0], **GREEDY).choices[0]
    assert plain.model_extra.get("prompt_logprobs") is None

    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png_base64()}},
                {"type": "text", "text": "What is here?"},
            ],
        },
    ]
    chat = client.chat.completions.create(model=model, messages=messages, extra_body={"prompt_logprobs": 1}, **GREEDY)
    body = chat.model_extra["prompt_logprobs"]
    assert len(body) == chat.usage.prompt_tokens and body[0] is None
    assert all(1 <= len(entry) <= 2 for entry in body[1:])

    for path, body in (
        ("/v1/completions", {"prompt": PROMPTS[0]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        response = httpx.post(server.url + path, json={**body, "stream": True, "prompt_logprobs": 1}, timeout=30)
        assert response.status_code == 400 and "stream" in response.json()["error"]["message"]


def _png_base64() -> str:
    buffer = io.BytesIO()
    make_image(64, 64, seed=5).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()
