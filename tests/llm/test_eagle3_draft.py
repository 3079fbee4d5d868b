"""EAGLE-3 draft heads in the published layout: a checkpoint loads (its config checked against the
target it serves) and the draft computes what the published architecture defines, written out here from
the checkpoint's own tensors: fc over the target's three hidden states; one Llama layer whose attention
reads [norm(embedding), norm(hidden)] and whose residual stream starts from the hidden state; the final
norm; the LM head over the draft vocabulary; d2t back to the target's ids."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_reference import CausalAttention, draft_reference, fuse
from vlm_serve.config import ModelConfig
from vlm_serve.llm.layers.embedding import VocabParallelEmbedding
from vlm_serve.llm.speculative.eagle3 import Eagle3Config, load_eagle3_draft
from vlm_serve.testing.eagle3_draft import create_eagle3_draft


@pytest.mark.parametrize("own_embeddings", [False, True])
def test_a_draft_computes_the_published_architecture(tiny_dense_dir, tmp_path, own_embeddings):
    target = ModelConfig.from_pretrained(tiny_dense_dir).text
    path = create_eagle3_draft(
        tmp_path / "draft",
        tiny_dense_dir,
        seed=1,
        draft_vocab_size=target.vocab_size // 2,
        own_embeddings=own_embeddings,
    )
    weights = load_file(str(path / "model.safetensors"))
    weights["d2t"] = torch.randint(
        0, target.vocab_size // 2, weights["d2t"].shape, generator=torch.Generator().manual_seed(2)
    )
    save_file(weights, str(path / "model.safetensors"))  # (a draft vocabulary that is not the first ids)
    draft = load_eagle3_draft(
        path, target, kv_layer=target.num_hidden_layers, device=torch.device("cpu"), dtype=torch.float32
    )
    embeddings = torch.randn(target.vocab_size, target.hidden_size) * 0.02
    if not own_embeddings:
        shared = VocabParallelEmbedding(target.vocab_size, target.hidden_size)
        shared.weight.data.copy_(embeddings)
        draft.share_embeddings(shared)
    else:
        embeddings = weights["embed_tokens.weight"]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, target.vocab_size, (7,), generator=g)
    hidden3 = torch.randn(7, 3 * target.hidden_size, generator=g)
    positions = torch.arange(5, 12)
    with torch.no_grad():
        normed, prenorm = draft(ids, hidden3, positions.expand(3, -1), SimpleNamespace(attn_backend=CausalAttention()))
        tokens = draft.draft_tokens(normed)
    want_normed, want_prenorm, want_tokens = draft_reference(
        weights, json.loads((path / "config.json").read_text()), embeddings[ids], fuse(weights, hidden3), positions
    )
    torch.testing.assert_close(normed, want_normed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prenorm, want_prenorm, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, want_tokens)


def test_a_chained_step_reads_the_drafts_own_hidden_state_without_fc(tiny_dense_dir, tmp_path):
    target = ModelConfig.from_pretrained(tiny_dense_dir).text
    path = create_eagle3_draft(tmp_path / "draft", tiny_dense_dir, own_embeddings=True)
    draft = load_eagle3_draft(
        path, target, kv_layer=target.num_hidden_layers, device=torch.device("cpu"), dtype=torch.float32
    )
    weights = load_file(str(path / "model.safetensors"))
    hidden = torch.randn(3, target.hidden_size)
    ids, positions = torch.tensor([4, 9, 2]), torch.arange(3)
    with torch.no_grad():
        normed, _ = draft(ids, hidden, positions.expand(3, -1), SimpleNamespace(attn_backend=CausalAttention()))
    config = json.loads((path / "config.json").read_text())
    want = draft_reference(weights, config, weights["embed_tokens.weight"][ids], hidden, positions)[0]
    torch.testing.assert_close(normed, want, rtol=1e-4, atol=1e-4)


def test_drafts_that_cannot_serve_the_target_are_refused_by_what_differs(tiny_dense_dir, tmp_path):
    target = ModelConfig.from_pretrained(tiny_dense_dir).text
    path = create_eagle3_draft(tmp_path / "draft", tiny_dense_dir)
    config = json.loads((path / "config.json").read_text())
    for change, message in [
        ({"architectures": ["LlamaForCausalLM"]}, "name no EAGLE-3 draft"),
        ({"vocab_size": target.vocab_size + 1}, "vocabulary"),
        ({"target_hidden_size": 2 * target.hidden_size}, "hidden states of size"),
        ({"num_key_value_heads": 2 * target.num_key_value_heads}, "KV heads"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, target.num_hidden_layers]}}, "reads layers"),
    ]:
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            Eagle3Config.from_pretrained(path).check_target(target)
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "norm.weight"}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 tensors"):
        load_eagle3_draft(
            path, target, kv_layer=target.num_hidden_layers, device=torch.device("cpu"), dtype=torch.float32
        )
