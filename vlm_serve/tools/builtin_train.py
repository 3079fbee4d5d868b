"""Trains the built-in model on synthetic scenes (`builtin/scenes.py`), from a seed:

    python -m vlm_serve.tools.builtin_train OUT_DIR [--steps 9000] [--batch-size 32] [--seed 0] [--vision-steps N]
        [--init-from DIR]

It starts from a random checkpoint of the built-in shape (`create_tiny_model(size="builtin")`: the
published Qwen3-VL-MoE layout, tokenizer and chat template; its processor brings every picture to about
256 x 256 pixels, 8 x 8 tokens), trains every weight with transformers' Qwen3VLMoeForConditionalGeneration
on freshly generated examples of the scenes' wide distribution (the loss is on the answer's tokens, plus
`CellProbe`'s on the picture tokens), and writes the weights back in the published layout. `--vision-steps`
first trains the vision tower alone on pictures, three times as many in the same time. `--init-from`
goes on from the weights of a checkpoint it wrote (a run longer than a session, in parts). Examples go
through the project's own MultimodalProcessor, whose ids and pixels are transformers' (test_preprocess).
On this project's 2-core CPU machine the shipped weights took the time printed in their `training.json`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vlm_serve.builtin.scenes import (
    COLOURS,
    KIND_WEIGHTS,
    KINDS,
    SIZES,
    VIDEO_FPS,
    Example,
    Scene,
    random_example,
    random_scene,
    render,
)
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.multimodal.video import write_video
from vlm_serve.testing.tiny_model import create_tiny_model
from vlm_serve.tokenizer import Tokenizer

IGNORE = -100  # label of the tokens the loss skips
SHIPPED_DTYPE = torch.bfloat16  # as the published checkpoints; half the size (served as float32 on CPU)


def messages(example: Example) -> list[dict]:
    """The example's question as one OpenAI-style user turn."""
    content: list[dict] = [{"type": "image", "image": image} for image in example.images]
    if example.video is not None:
        buffer = io.BytesIO()
        write_video(buffer, example.video, VIDEO_FPS)
        content.append({"type": "video", "video": buffer.getvalue()})
    text = {"type": "text", "text": example.question}
    return [{"role": "user", "content": [text, *content] if example.question_first else [*content, text]}]


def chat_content(example: Example) -> list[dict]:
    """`messages`' content in OpenAI form for a server: the pictures as PNG, the clip as MPEG-4 data URLs."""
    content = []
    for part in messages(example)[0]["content"]:
        if part["type"] == "image":
            buffer = io.BytesIO()
            part["image"].save(buffer, format="PNG")
            part = {"type": "image_url", "image_url": {"url": data_url("image/png", buffer.getvalue())}}
        elif part["type"] == "video":
            part = {"type": "video_url", "video_url": {"url": data_url("video/mp4", part["video"])}}
        content.append(part)
    return content


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def cell_labels(scene: Scene, rows: int, columns: int) -> list[list[int]]:
    """What each of the picture's `rows` x `columns` tokens holds, in reading order: [colour, kind, size] of
    the (largest) shape whose centre is in the token's part of the picture, each an index into COLOURS,
    KINDS, SIZES, or one past the end where no centre is."""
    cells = [[len(COLOURS), len(KINDS), len(SIZES)] for _ in range(rows * columns)]
    for s in sorted(scene.shapes, key=lambda s: s.extent or 0):
        x, y = (s.x, s.y) if s.x is not None else ((s.column + 0.5) / 3, (s.row + 0.5) / 3)
        cells[int(y * rows) * columns + int(x * columns)] = [
            list(COLOURS).index(s.colour),
            KINDS.index(s.kind),
            SIZES.index(s.size),
        ]
    return cells


def encode(processor: MultimodalProcessor, example: Example) -> dict:
    """Ids, labels (the answer and its end-of-turn token), media and their cells of one example."""
    question = messages(example)
    prompt = processor.process_messages(question, add_generation_prompt=True)
    answer = processor.tokenizer.encode(example.answer) + [processor.tokenizer.token_to_id("<|im_end|>")]
    pictures = [item for item in prompt.mm_items if item.modality == "image"]
    merge = processor.image_processor.config.merge_size
    return {
        "input_ids": prompt.input_ids + answer,
        "labels": [IGNORE] * len(prompt.input_ids) + answer,
        "items": prompt.mm_items,
        "cells": [
            cell
            for scene, item in zip(example.scenes, pictures, strict=True)
            for cell in cell_labels(scene, item.grid_thw[1] // merge, item.grid_thw[2] // merge)
        ],
    }


def collate(encoded: list[dict], pad_id: int, image_id: int, video_id: int) -> dict:
    """Right-padded batch tensors as transformers' Qwen3-VL takes them."""
    length = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((len(encoded), length), pad_id)
    labels = torch.full((len(encoded), length), IGNORE)
    mask = torch.zeros((len(encoded), length), dtype=torch.long)
    for row, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(e["input_ids"]), torch.tensor(e["labels"]), 1
    batch = {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "mm_token_type_ids": (ids == image_id).int() + 2 * (ids == video_id).int(),
    }
    items = [item for e in encoded for item in e["items"]]
    for modality, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        chosen = [it for it in items if it.modality == modality]
        if chosen:
            batch[key] = torch.cat([it.pixel_values for it in chosen])
            batch[f"{modality}_grid_thw"] = torch.tensor([it.grid_thw for it in chosen])
    if "pixel_values" in batch:  # one row per picture token, in the pictures' order
        batch["cell_labels"] = torch.tensor([cell for e in encoded for cell in e.get("cells", [])])
    return batch


class Batches(torch.utils.data.IterableDataset):
    """The training batches, made in a worker process while the model trains on the previous ones: drawing,
    video encoding and preprocessing are about a third of a step. The first `single_steps` show one shape
    per picture. Examples are drawn `POOL` batches at a time and batched by length (the batches then in a
    random order): padded to their batch's longest, examples of all lengths together would cost the
    language model twice the work. `old_share` of the examples come from the first model's distribution."""

    POOL = 8

    def __init__(
        self,
        out_dir: Path,
        seed: int,
        steps: int,
        single_steps: int,
        batch_size: int,
        old_share: float,
        wide_weights: dict[str, float],
    ) -> None:
        self.out_dir, self.seed, self.steps, self.single_steps, self.batch_size, self.old_share = (
            out_dir,
            seed,
            steps,
            single_steps,
            batch_size,
            old_share,
        )
        self.wide_weights = wide_weights

    def __iter__(self):
        tokenizer = Tokenizer.from_pretrained(self.out_dir)
        processor = MultimodalProcessor.from_pretrained(self.out_dir, tokenizer, cache_mb=0)
        pad = tokenizer.token_to_id("<|endoftext|>")
        rng = random.Random(self.seed)
        for first in range(1, self.steps + 1, self.POOL):
            pool = []
            for step in range(first, min(first + self.POOL, self.steps + 1)):
                most = 1 if step <= self.single_steps else 4
                for _ in range(self.batch_size):
                    wide = rng.random() >= self.old_share
                    example = random_example(rng, most, wide, self.wide_weights if wide else None)
                    pool.append(encode(processor, example))
            pool.sort(key=lambda e: len(e["input_ids"]))
            batches = [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
            rng.shuffle(batches)
            for examples in batches:
                yield collate(examples, pad, processor.image_token_id, processor.video_token_id)


class Pictures(torch.utils.data.IterableDataset):
    """The vision tower's own batches (`train`'s `vision_steps`): `batch_size` pictures of wide scenes with
    what each of their tokens is taught (`cell_labels`), made in a worker process. Without the language model
    a picture costs under a third of what a training example does here, so the tower sees three times as many."""

    def __init__(self, out_dir: Path, seed: int, steps: int, batch_size: int) -> None:
        self.out_dir, self.seed, self.steps, self.batch_size = out_dir, seed, steps, batch_size

    def __iter__(self):
        processor = MultimodalProcessor.from_pretrained(self.out_dir, Tokenizer.from_pretrained(self.out_dir))
        merge = processor.image_processor.config.merge_size
        rng = random.Random(self.seed)
        for _ in range(self.steps):
            items, cells = [], []
            for _ in range(self.batch_size):
                scene = random_scene(rng, wide=True)
                item = processor.image_processor.preprocess(render(scene))
                items.append(item)
                cells += cell_labels(scene, item.grid_thw[1] // merge, item.grid_thw[2] // merge)
            yield {
                "pixel_values": torch.cat([item.pixel_values for item in items]),
                "image_grid_thw": torch.tensor([item.grid_thw for item in items]),
                "cell_labels": torch.tensor(cells),
            }


class CellProbe(torch.nn.Module):
    """A linear read-out of what each picture token's part of the picture holds (whether a shape is centred
    there, and its colour, kind and size) from the vision tower's output, trained beside the model and then
    dropped. From scratch the language model at first ignores the pictures, whose tokens are then nearly
    all alike, so nothing teaches the tower to tell them apart; this loss makes the tokens say what is in
    their part from the start.

    Each part's loss is over the tokens holding a shape's centre only (four in five tokens hold none: over
    all of them, "nothing here" would be most of each part's loss), and the kind's weighs `KIND_WEIGHT`
    times the others: a silhouette, at any offset within a 16-pixel patch, is what a vision tower learns
    slowest. Trained alone on wide 128-pixel scenes, 1,000 steps of 64 pictures, a tower read the kinds of
    the centred shapes right 35% of the time (colours 85%) with one loss over all tokens and parts, and 54%
    (colours 93%) with these."""

    KIND_WEIGHT = 3.0

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        classes = 1 + len(COLOURS) + len(KINDS) + len(SIZES)  # "a shape is centred here", then its parts
        self.head = torch.nn.Linear(model.config.get_text_config().hidden_size, classes)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (grid_thw, merged tokens) of each tower pass
        # the last batch's share of tokens holding a shape's centre whose colour, kind and size it reads right:
        # whether the tower tells them apart (or the language model fails to use what it tells)
        self.accuracy: dict[str, float] = {}
        model.model.visual.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output) -> None:
        if module.training:
            self.seen.append((kwargs.get("grid_thw", args[1] if len(args) > 1 else None), output.pooler_output))

    def read(self) -> str:
        """`accuracy` as a log says it."""
        return ", ".join(f"{name} {share:.0%}" for name, share in self.accuracy.items())

    def loss(self, grid: torch.Tensor | None, cells: torch.Tensor | None) -> torch.Tensor:
        """The batch's picture tokens' loss (0 without pictures), given the batch's image_grid_thw and
        cell_labels (`collate`: one row per token)."""
        seen, self.seen = self.seen, []
        tokens = next((out for g, out in seen if grid is not None and g is not None and torch.equal(g, grid)), None)
        if tokens is None:
            return torch.zeros(())
        present_logit, *parts = self.head(tokens).split([1, len(COLOURS), len(KINDS), len(SIZES)], dim=-1)
        centred = cells[:, 1] != len(KINDS)
        with torch.no_grad():
            self.accuracy = {
                name: (p[centred].argmax(-1) == cells[centred, k]).float().mean().item()
                for k, (name, p) in enumerate(zip(("colour", "kind", "size"), parts))
            }
        functional = torch.nn.functional
        loss = functional.binary_cross_entropy_with_logits(present_logit.squeeze(-1), centred.float())
        weights = (1.0, self.KIND_WEIGHT, 1.0)
        if centred.any():
            loss = loss + sum(
                w * functional.cross_entropy(p[centred], cells[centred, k])
                for k, (w, p) in enumerate(zip(weights, parts))
            )
        return loss / (1 + sum(weights))


def patches_as_matmul(patch_embed: torch.nn.Module) -> None:
    """Makes the vision tower's patch embedding (a Conv3d whose kernel is its stride: one product per
    patch) one matrix product, as it is: the convolution's backward took a tenth of a training step."""
    conv = patch_embed.proj

    def forward(pixels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(pixels.to(conv.weight.dtype), conv.weight.flatten(1), conv.bias)

    patch_embed.forward = forward


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the answers' tokens, each example weighing the same whatever its answer's length.

    A mean over all tokens lets captions (a dozen telling tokens) drown colour and presence answers, whose
    one telling token is the only place the model must find a shape by its kind rather than its place."""
    targets = labels[:, 1:]
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
    ).view_as(targets)
    return (per_token.sum(1) / (targets != IGNORE).sum(1).clamp(min=1)).mean()


def published_layout(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """transformers 5's weights in the published checkpoints' layout (experts as [E, H, 2I] / [E, I, H];
    a tied LM head left out) and `dtype`."""
    fused = (".experts.gate_up_proj", ".experts.down_proj")
    tied = model.config.get_text_config().tie_word_embeddings
    return {
        name: (t.transpose(-1, -2) if name.endswith(fused) else t).detach().to(dtype).contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


def training_layout(model: torch.nn.Module, published: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`published_layout`'s inverse: a full state dict of `model` (float32) from published weights."""
    fused = (".experts.gate_up_proj", ".experts.down_proj")
    state = {name: (t.transpose(-1, -2) if name.endswith(fused) else t).float() for name, t in published.items()}
    if model.config.get_text_config().tie_word_embeddings:
        state["lm_head.weight"] = state["model.language_model.embed_tokens.weight"]
    return state


def save(model: torch.nn.Module, out_dir: Path) -> None:
    """The model's weights into the checkpoint at `out_dir`, as published, with greedy decoding as default."""
    save_file(published_layout(model, SHIPPED_DTYPE), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    answer_greedily(out_dir)


def answer_greedily(out_dir: Path) -> None:
    """Makes greedy decoding the checkpoint's default (its generation_config.json): the model's answers
    are facts about the picture, and sampling would only add mistakes."""
    path = out_dir / "generation_config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("temperature", "top_k", "top_p")}
    path.write_text(json.dumps({**config, "do_sample": False}, indent=2) + "\n")


def greedy_answer(model, processor: MultimodalProcessor, example: Example, max_tokens: int = 64) -> str:
    """transformers' greedy `generate` answer of `model` (a Qwen3-VL) to `example`'s question."""
    end = processor.tokenizer.token_to_id("<|im_end|>")
    prompt = processor.process_messages(messages(example), add_generation_prompt=True)
    ids = prompt.input_ids
    unlabelled = {"input_ids": ids, "labels": [IGNORE] * len(ids), "items": prompt.mm_items}
    batch = collate([unlabelled], 0, processor.image_token_id, processor.video_token_id)
    del batch["labels"]
    batch.pop("cell_labels", None)
    out = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False, eos_token_id=end)
    return processor.tokenizer.decode([t for t in out[0, len(ids) :].tolist() if t != end])


def exact_match(model, processor: MultimodalProcessor, examples: list[Example]) -> dict[str, float]:
    """Greedy answers of `model` on `examples`: the share equal to the expected answer, per kind. Each
    answer may run a little past its expected length (the greeting's is 68 tokens), no further: past it,
    it is wrong whatever follows."""
    scores: dict[str, list[bool]] = {}
    model.eval()
    with torch.no_grad():
        for example in examples:
            longest = len(processor.tokenizer.encode(example.answer)) + 2
            answer = greedy_answer(model, processor, example, longest)
            scores.setdefault(example.kind, []).append(answer == example.answer)
    model.train()
    return {kind: sum(hits) / len(hits) for kind, hits in sorted(scores.items())}


@dataclass
class TrainingArgs:
    """One training run's settings (`main`'s flags), recorded in the checkpoint's training.json.

    `vision_steps` steps of `vision_batch_size` pictures train the vision tower alone on `CellProbe`'s loss
    first. Then `steps` steps of `batch_size` examples train every weight; the first `single_share` of them
    show one shape per picture, and every step adds `cell_weight` times the `CellProbe` loss to the answers'
    loss. With `init_from` (a checkpoint this trainer wrote) training goes on from its weights, on a fresh
    schedule. A tower trained first (by its own steps or in `init_from`) loses much of what it learned at
    the whole model's full rate: from 93% of kinds read right to 50-75% within 300 steps at lr 1e-3;
    `tower_lr_scale` keeps its rate lower. `old_share` of the examples are drawn from the first model's
    distribution (the old held-out set's): on the wide one alone, its straight clips came out as diagonals.
    `kind_weights` ("caption=40,compare=12") changes how often the wide examples ask each kind of question
    (`KIND_WEIGHTS`' wide ones otherwise), to train more on the kinds answered worst."""

    steps: int = 9000
    batch_size: int = 32
    seed: int = 0
    lr: float = 1e-3
    eval_every: int = 500  # steps between held-out exact-match checks (0: none)
    single_share: float = 0.1
    cell_weight: float = 0.5
    vision_steps: int = 0
    vision_batch_size: int = 64
    tower_lr_scale: float = 1.0  # the vision tower's learning rate in the whole model's steps, as a share of lr
    old_share: float = 0.2
    kind_weights: str = ""
    init_from: Path | None = None

    def wide_weights(self) -> dict[str, float]:
        """`KIND_WEIGHTS`' wide distribution with `kind_weights`' changes."""
        weights = dict(KIND_WEIGHTS[True])
        for item in filter(None, self.kind_weights.split(",")):
            kind, _, weight = (part.strip() for part in item.partition("="))
            if kind not in weights:
                raise ValueError(f"--kind-weights: no question kind {kind!r} (kinds: {', '.join(weights)})")
            try:
                weights[kind] = float(weight)
            except ValueError:
                raise ValueError(f"--kind-weights: {kind}'s weight {weight!r} is not a number") from None
            if not weights[kind] >= 0:
                raise ValueError(f"--kind-weights: {kind}'s weight {weight} must be 0 or more")
        if not sum(weights.values()) > 0:
            raise ValueError("--kind-weights: every weight is 0: no question would be asked")
        return weights


class Optimizer:
    """AdamW over torch's parameter `groups` (each may set its own "lr") with a linear warm-up over the first
    2% of `steps`, then a cosine decay to 0."""

    def __init__(self, groups: list[dict], lr: float, steps: int) -> None:
        self.parameters = [p for group in groups for p in group["params"]]
        self.adam = torch.optim.AdamW(groups, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
        warmup = max(1, steps // 50)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.adam, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        )

    def step(self, loss: torch.Tensor) -> None:
        """Back-propagates `loss`, clips the gradients' norm to 1 and updates the parameters."""
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parameters, 1.0)
        self.adam.step()
        self.schedule.step()
        self.adam.zero_grad(set_to_none=True)


def parameter_groups(model: torch.nn.Module, probe_cells: CellProbe, args: TrainingArgs) -> list[dict]:
    """The whole model's steps' parameters: the vision tower's at `args.tower_lr_scale` of the rate."""
    tower = list(model.model.visual.parameters())
    in_tower = {id(p) for p in tower}
    rest = [p for p in model.parameters() if id(p) not in in_tower]
    return [{"params": [*rest, *probe_cells.parameters()]}, {"params": tower, "lr": args.lr * args.tower_lr_scale}]


def train_tower(model: torch.nn.Module, probe_cells: CellProbe, out_dir: Path, args: TrainingArgs) -> None:
    """`args.vision_steps` steps of the vision tower alone (and the probe) on pictures (`Pictures`)."""
    parameters = [*model.model.visual.parameters(), *probe_cells.parameters()]
    optimizer = Optimizer([{"params": parameters}], args.lr, args.vision_steps)
    pictures = Pictures(out_dir, args.seed + 2, args.vision_steps, args.vision_batch_size)
    start = time.perf_counter()
    for step, batch in enumerate(torch.utils.data.DataLoader(pictures, batch_size=None, num_workers=1), 1):
        model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
        loss = probe_cells.loss(batch["image_grid_thw"], batch["cell_labels"])
        optimizer.step(loss)
        if step % 25 == 0:
            print(
                f"vision step {step}/{args.vision_steps}: cells {loss.item():.4f} ({probe_cells.read()}) "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )


def train(out_dir: Path, args: TrainingArgs) -> None:
    """Trains the built-in model as `args` say (see `TrainingArgs`) and writes it to `out_dir`.

    The probe and the one-shape start are there because from scratch the language model at first ignores
    the pictures, whose tokens are then nearly one shared vector. Without the cell loss, 2250 steps (the
    first 1800 on single shapes) still had every held-out colour, caption and presence answer wrong."""
    import transformers

    # the checkpoint's files; its weights are replaced by a fresh initialisation (transformers' own)
    out_dir = create_tiny_model(
        out_dir, arch="moe", seed=args.seed, size="builtin", tie_word_embeddings=True, dtype="bfloat16"
    )
    torch.manual_seed(args.seed)
    held_out = random.Random(args.seed + 1)
    tokenizer = Tokenizer.from_pretrained(out_dir)
    processor = MultimodalProcessor.from_pretrained(out_dir, tokenizer, cache_mb=0)
    config = transformers.AutoConfig.from_pretrained(out_dir)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float()
    if args.init_from is not None:
        model.load_state_dict(training_layout(model, load_file(str(Path(args.init_from) / "model.safetensors"))))
    patches_as_matmul(model.model.visual.patch_embed)
    probe_cells = CellProbe(model)
    model.train()
    start = time.perf_counter()
    if args.vision_steps:
        train_tower(model, probe_cells, out_dir, args)
        save(model, out_dir)  # (a run cut short goes on from here with --init-from)
    optimizer = Optimizer(parameter_groups(model, probe_cells, args), args.lr, args.steps)
    probe = [random_example(held_out, wide=True) for _ in range(48)]
    single_probe = [random_example(held_out, most=1, wide=True) for _ in range(48)]
    batches = Batches(
        out_dir,
        args.seed,
        args.steps,
        round(args.single_share * args.steps),
        args.batch_size,
        args.old_share,
        args.wide_weights(),
    )
    for step, batch in enumerate(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=1), 1):
        cells, labels = batch.pop("cell_labels", None), batch.pop("labels")
        loss = answer_loss(model(**batch).logits, labels)
        cell_loss = probe_cells.loss(batch.get("image_grid_thw"), cells)
        optimizer.step(loss + args.cell_weight * cell_loss)
        if step % 25 == 0:
            print(
                f"step {step}/{args.steps}: loss {loss.item():.4f}, cells {cell_loss.item():.4f} "
                f"({probe_cells.read()}) ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
        if args.eval_every and step % args.eval_every == 0:
            print(f"  exact match on held-out examples: {exact_match(model, processor, probe)}", flush=True)
            if step <= args.single_share * args.steps:
                print(f"  ... with one shape: {exact_match(model, processor, single_probe)}", flush=True)
            save(model, out_dir)  # to look at while it trains
    seconds = time.perf_counter() - start
    save(model, out_dir)
    record = {
        **{k: v for k, v in asdict(args).items() if k != "eval_every"},
        "init_from": args.init_from and str(args.init_from),
        "single_turn": True,  # every example is one question: the demo sends it questions alone
        "seconds": round(seconds),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if args.init_from is not None:  # the runs it went on from, each with its own, back to the one from a seed
        record["init_from_training"] = json.loads((Path(args.init_from) / "training.json").read_text())
    (out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out_dir} after {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    defaults = TrainingArgs()
    helps = {
        "eval_every": "steps between held-out exact-match checks",
        "single_share": "share of steps on one-shape pictures",
        "cell_weight": "weight of the vision tokens' cell loss",
        "vision_steps": "steps training the vision tower alone on pictures, first",
        "vision_batch_size": "pictures in each of those steps",
        "init_from": "a checkpoint this trainer wrote, to go on training from",
        "old_share": "share of examples from the first model's (grid) distribution",
        "kind_weights": "how often wide examples ask each kind, e.g. caption=40,compare=12 (others as KIND_WEIGHTS)",
    }
    for field in fields(TrainingArgs):
        kind = Path if field.name == "init_from" else type(getattr(defaults, field.name))
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=kind,
            default=getattr(defaults, field.name),
            help=helps.get(field.name),
        )
    args = vars(parser.parse_args())
    out_dir = args.pop("out_dir")
    training = TrainingArgs(**args)
    try:
        training.wide_weights()
    except ValueError as error:
        parser.error(str(error))
    train(out_dir, training)


if __name__ == "__main__":
    main()
