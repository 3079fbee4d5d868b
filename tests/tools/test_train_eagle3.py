"""Training the built-in model's EAGLE-3 draft: the model it trains is the one served (the checkpoint it
writes loads into the serving draft, which computes the same), and training-time test shows each
position what chained drafting shows it at serving time."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from eagle3_reference import CausalAttention
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.config import ModelConfig
from vlm_serve.llm.layers.embedding import VocabParallelEmbedding
from vlm_serve.llm.speculative.eagle3 import load_eagle3_draft
from vlm_serve.tools.builtin_train_eagle3 import TrainableDraft, ttt_mask, write


def test_ttt_shows_each_step_the_target_fed_prefix_of_its_chain_and_the_chain_itself():
    mask = ttt_mask(6, 2)  # queries of step 2, keys of steps 0, 1, 2 side by side
    # position 4 of step 2 belongs to the chain after position 2: step-0 keys 0..2, then its own
    # step-1 key (position 3) and step-2 key (position 4)
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 6 + 3, 12 + 4]
    assert ttt_mask(6, 0).equal(torch.ones(6, 6).tril().bool())  # step 0: causal


def test_the_trained_draft_is_the_served_one(tmp_path):
    target = json.loads((BUILTIN_MODEL / "config.json").read_text())["text_config"]
    draft = TrainableDraft(
        target["hidden_size"],
        target["intermediate_size"],
        target["num_attention_heads"],
        target["num_key_value_heads"],
        target["head_dim"],
        target["vocab_size"],
        target["rms_norm_eps"],
        target["rope_theta"],
    )
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * torch.randn_like(p)).copy_(p.bfloat16())  # (as shipped: bfloat16)
    write(draft, tmp_path / "draft", target, {})
    text = ModelConfig.from_pretrained(BUILTIN_MODEL).text
    served = load_eagle3_draft(tmp_path / "draft", text, text.num_hidden_layers, torch.device("cpu"), torch.float32)
    embed = torch.randn(text.vocab_size, text.hidden_size)
    shared = VocabParallelEmbedding(text.vocab_size, text.hidden_size)
    shared.weight.data.copy_(embed)
    served.share_embeddings(shared)
    ids, aux, positions = torch.randint(0, text.vocab_size, (9,)), torch.randn(9, 3 * text.hidden_size), torch.arange(9)
    with torch.no_grad():
        hidden = draft.fc(aux)[None]
        q, k, v = draft.qkv(embed[ids][None], hidden, positions)
        groups = draft.heads // draft.kv_heads
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
        )
        logits, prenorm = draft.finish(hidden, attn)
        normed, served_prenorm = served(
            ids, aux, positions.expand(3, -1), SimpleNamespace(attn_backend=CausalAttention())
        )
    torch.testing.assert_close(served_prenorm, prenorm[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(served.draft_tokens(normed), logits[0].argmax(-1))
