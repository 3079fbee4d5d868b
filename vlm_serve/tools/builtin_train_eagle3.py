"""Trains the built-in model's EAGLE-3 draft head from a seed, in the published layout:

    python -m vlm_serve.tools.builtin_train_eagle3 OUT_DIR [--examples 3000] [--steps 1500] [--seed 0]

The examples are the built-in model's own kind (`scenes.random_example`), their answers the built-in
model's own greedy ones: the draft learns what the target says. The target's states entering layers 1,
2 and 3 (`AUX_LAYER_IDS` + 1) at every position come from transformers' forward over prompt and answer.

The draft (`TrainableDraft`: the published architecture, `eagle3.py`'s, as plain torch modules) learns
with training-time test (EAGLE-3's TTT) over `DEPTH` steps: at step k each position p reads the true
token p + 1 and, for k > 0, the draft's own output of step k - 1 at p - 1, attends to the target-fed
step-0 keys of positions up to p - k and to its own chain's keys of steps 1..k, and predicts token
p + 2: what chained drafting sees at serving time. The loss is on answer tokens, step k weighted 0.8^k.
Embeddings are the target's (not trained, not shipped); the LM head starts from the target's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from torch import nn

from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.builtin.scenes import random_example
from vlm_serve.engine import Engine
from vlm_serve.tools.builtin_train import collate, messages

AUX_LAYER_IDS = [0, 1, 2]  # the target layers whose outputs the draft reads (the built-in has 4)
DEPTH = 4  # TTT steps: as many drafts as a verify step takes by default
STEP_WEIGHT = 0.8
SHIPPED_DTYPE = torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: (batch, heads, tokens, dim), positions: (tokens,)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    angles = positions[:, None].float() * inv
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class TrainableDraft(nn.Module):
    """The EAGLE-3 draft architecture, with the published tensor names (`state_dict` is the checkpoint)."""

    def __init__(
        self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, vocab: int, eps: float, theta: float
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps, self.theta = heads, kv_heads, head_dim, eps, theta
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm, m.post_attention_layernorm = (
            nn.Parameter(torch.ones(hidden)) for _ in range(3)
        )
        m.self_attn = nn.Module()
        a = m.self_attn
        a.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        a.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        a.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        a.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj, m.mlp.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        m.mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """q, k, v of one step: (batch, heads, tokens, head_dim)."""
        m, a = self.midlayer, self.midlayer.self_attn
        x = torch.cat([rms_norm(embeds, m.input_layernorm, self.eps), rms_norm(hidden, m.hidden_norm, self.eps)], -1)
        b, t = x.shape[:2]
        q = a.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(q, positions, self.theta), rope(k, positions, self.theta), v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, pre-norm output) of a step, from its attention output (batch, heads, tokens, dim)."""
        m = self.midlayer
        b, _, t, _ = attn.shape
        residual = hidden + m.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        h = rms_norm(residual, m.post_attention_layernorm, self.eps)
        prenorm = residual + m.mlp.down_proj(F.silu(m.mlp.gate_proj(h)) * m.mlp.up_proj(h))
        return self.lm_head(rms_norm(prenorm, self.norm, self.eps)), prenorm

    def published(self) -> dict[str, torch.Tensor]:
        names = {
            "midlayer.input_layernorm": "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm": "midlayer.hidden_norm.weight",
            "midlayer.post_attention_layernorm": "midlayer.post_attention_layernorm.weight",
            "norm": "norm.weight",
        }
        return {names.get(k, k): v.detach().to(SHIPPED_DTYPE).contiguous() for k, v in self.state_dict().items()}


def ttt_mask(length: int, step: int) -> torch.Tensor:
    """(length, (step + 1) * length): may query position i of TTT step `step` see key j of step m? The
    chain it belongs to starts at i - step: step-0 keys up to there, then that chain's own keys."""
    i = torch.arange(length)[:, None]
    parts = [torch.arange(length)[None, :] <= i - step]
    for m in range(1, step + 1):
        parts.append(torch.arange(length)[None, :] == i - step + m)
    return torch.cat(parts, dim=1)


def ttt_loss(draft: TrainableDraft, embed: torch.Tensor, batch: dict) -> tuple[torch.Tensor, list[float]]:
    """The TTT loss of a batch (`ids`, `aux` target states, `first` answer position, `lengths`), and each
    step's accuracy of the top token."""
    ids, aux, lengths, first = batch["ids"], batch["aux"], batch["lengths"], batch["first"]
    b, t = ids.shape
    inputs = torch.cat([ids[:, 1:], ids[:, -1:]], 1)  # position p reads token p + 1
    targets = torch.cat([ids[:, 2:], ids[:, -2:]], 1)  # and predicts token p + 2
    embeds = embed[inputs]
    positions = torch.arange(t)
    p = positions[None, :]
    hidden = draft.fc(aux)
    keys, values = [], []
    total, accuracies = torch.zeros(()), []
    groups = draft.heads // draft.kv_heads
    for step in range(DEPTH):
        q, k, v = draft.qkv(embeds, hidden, positions)
        keys.append(k.repeat_interleave(groups, 1))
        values.append(v.repeat_interleave(groups, 1))
        mask = ttt_mask(t, step)[None, None] & (torch.arange((step + 1) * t) % t < lengths[:, None])[:, None, None, :]
        mask[..., positions, step * t + positions] = True  # (its own key: padding rows see one too)
        attn = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)
        logits, prenorm = draft.finish(hidden, attn)
        valid = (p >= step) & (p + 2 < lengths[:, None]) & (p + 2 >= first[:, None])
        if valid.any():
            loss = F.cross_entropy(logits[valid], targets[valid])
            total = total + STEP_WEIGHT**step * loss
            accuracies.append(float((logits[valid].argmax(-1) == targets[valid]).float().mean()))
        hidden = torch.cat(
            [torch.zeros_like(prenorm[:, :1]), prenorm[:, :-1]], 1
        )  # step k+1 at p reads step k at p - 1
    return total, accuracies


def make_data(examples: int, seed: int) -> list[dict]:
    """Each example's ids (prompt, then the built-in model's greedy answer with its end token), the
    answer's first position, and the target's states entering layers AUX_LAYER_IDS + 1."""
    rng = random.Random(seed)
    chosen = [random_example(rng, wide=True) for _ in range(examples)]
    with Engine(BUILTIN_MODEL, vit_dp=0) as engine:
        processor = engine.processor
        prompts = [processor.process_messages(messages(e), add_generation_prompt=True) for e in chosen]
        answers = []
        for start in range(0, len(prompts), 64):
            outs = engine.generate_processed(prompts[start : start + 64], max_tokens=64, temperature=0)
            answers += [o.token_ids for o in outs]
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(BUILTIN_MODEL, dtype=torch.float32).eval()
    data = []
    for start in range(0, len(prompts), 32):
        encoded = [
            {"input_ids": x.input_ids + a, "labels": [0] * (len(x.input_ids) + len(a)), "items": x.mm_items}
            for x, a in zip(prompts[start : start + 32], answers[start : start + 32])
        ]
        batch = collate(encoded, 0, processor.image_token_id, processor.video_token_id)
        batch.pop("labels")
        batch.pop("cell_labels", None)
        with torch.no_grad():
            states = hf(**batch, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i + 1] for i in AUX_LAYER_IDS], dim=-1)
        for row, e in enumerate(encoded):
            n = len(e["input_ids"])
            first = len(prompts[start + row].input_ids)
            data.append({"ids": torch.tensor(e["input_ids"]), "aux": aux[row, :n].clone(), "first": first})
    return data


def batches(data: list[dict], size: int, rng: random.Random):
    while True:
        chosen = rng.sample(data, size)
        t = max(len(d["ids"]) for d in chosen)
        ids = torch.zeros(size, t, dtype=torch.long)
        aux = torch.zeros(size, t, chosen[0]["aux"].shape[-1])
        for row, d in enumerate(chosen):
            ids[row, : len(d["ids"])], aux[row, : len(d["ids"])] = d["ids"], d["aux"]
        yield {
            "ids": ids,
            "aux": aux,
            "lengths": torch.tensor([len(d["ids"]) for d in chosen]),
            "first": torch.tensor([d["first"] for d in chosen]),
        }


def write(draft: TrainableDraft, out: Path, target: dict, meta: dict) -> None:
    """The draft as published: config.json, model.safetensors (with d2t: the whole vocabulary), training.json."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = target["vocab_size"]
    tensors = draft.published()
    tensors["d2t"] = torch.zeros(vocab, dtype=torch.int64)
    tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": target["rope_theta"],
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        "target_hidden_size": target["hidden_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    began = time.monotonic()
    data = make_data(args.examples, args.seed)
    print(f"{len(data)} examples of the built-in model's answers in {time.monotonic() - began:.0f} s", flush=True)
    target = json.loads((BUILTIN_MODEL / "config.json").read_text())["text_config"]
    weights = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(BUILTIN_MODEL, dtype=torch.float32)
    embed = weights.model.language_model.embed_tokens.weight.detach()
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
    draft.lm_head.weight.data.copy_(weights.lm_head.weight.detach())
    draft.norm.data.copy_(weights.model.language_model.norm.weight.detach())
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s / 100) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    stream = batches(data, args.batch_size, random.Random(args.seed))
    for step in range(1, args.steps + 1):
        loss, accuracies = ttt_loss(draft, embed, next(stream))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps:
            print(
                f"step {step}: loss {float(loss):.3f}, top-1 by TTT step {[round(a, 3) for a in accuracies]}",
                flush=True,
            )
    seconds = time.monotonic() - began
    meta = {
        "examples": args.examples,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "depth": DEPTH,
        "last_top1_by_step": accuracies,
        "seconds": round(seconds),
    }
    write(draft, args.out_dir, target, meta)
    print(f"wrote {args.out_dir} after {seconds / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
