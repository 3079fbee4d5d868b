"""Qwen2.5-VL served by `vlm-serve serve` on 2 tensor-parallel CPU ranks: a chat request with a picture through
the OpenAI endpoint gets transformers' greedy answer (`Qwen2_5_VLForConditionalGeneration` on the same
processed input)."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import MESSAGES, openai_client, running_server
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.tokenizer import Tokenizer

pytestmark = pytest.mark.server  # the server and its ranks are processes

NEW_TOKENS = 16


def test_a_chat_with_a_picture_on_two_ranks_answers_as_transformers(tiny_qwen2_5_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_qwen2_5_dir)
    processed = MultimodalProcessor.from_pretrained(tiny_qwen2_5_dir, tokenizer).process_messages(MESSAGES)
    (picture,) = processed.mm_items
    ids = torch.tensor([processed.input_ids])
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen2_5_dir, dtype=torch.float32)
    with torch.no_grad():
        out = hf.eval().generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == tokenizer.image_token_id).int(),
            pixel_values=picture.pixel_values,
            image_grid_thw=torch.tensor([picture.grid_thw]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    expected = tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)

    with running_server(tiny_qwen2_5_dir, "--tp-size", "2") as server:
        client = openai_client(server)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
    assert reply.choices[0].message.content == expected
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(processed.input_ids), NEW_TOKENS)
