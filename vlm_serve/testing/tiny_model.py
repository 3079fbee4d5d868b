"""Tiny, randomly initialised Qwen3-VL checkpoints in the published Hugging Face layout.

`create_tiny_model` writes everything a real Qwen3-VL checkpoint directory holds (config, weights,
tokenizer, chat template, image/video processor configs), small enough for CPU tests. The layout is
the one the published checkpoints have (written by transformers 4.57): `rope_scaling` in the text
config and MoE experts fused as `gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]`.

The tokenizer is a real byte-level BPE (Qwen2 pre-tokenizer) trained on a small built-in corpus, so
ids differ from Qwen's but every code path (special tokens, chat template, decoding) is the real one.
The embedding table is padded to a multiple of 64 like Qwen's; the padded rows are zero, so those ids
get logit 0 (well below the real tokens') and are not sampled in practice.

Pixel limits are smaller than Qwen's so that test images stay cheap: an image is resized to between
32x32 (one merged token) and 512x512 pixels (256 tokens); a video to at most 1024 merged tokens per
clip. `video_preprocessor_config.json` pins `cap_pixels_per_frame: false` (transformers' current
default behaviour) so that the oracle's video sizing is explicit.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from vlm_serve.config import DTYPES

ARCHS = {
    "moe": ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
    "dense": ("Qwen3VLForConditionalGeneration", "qwen3_vl"),
}

# Sizes of the tiny model.
TEXT_HIDDEN = 64
TEXT_LAYERS = 3
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
HEAD_DIM = 32
MROPE_SECTION = [6, 5, 5]  # sums to HEAD_DIM // 2
TEXT_INTERMEDIATE = 128
ROPE_THETA = 10000.0
MAX_POSITIONS = 4096
NUM_EXPERTS = 8
EXPERTS_PER_TOK = 2
# Not HEAD_DIM-related: must differ from TEXT_HIDDEN and TEXT_HIDDEN // 2, or transformers cannot tell the
# 4.57 expert layout [E, H, 2I] from its own [E, 2I, H] and loads the experts untransposed.
MOE_INTERMEDIATE = 48
VISION_DEPTH = 3
VISION_HIDDEN = 32
VISION_HEADS = 2
VISION_INTERMEDIATE = 64
VISION_POSITIONS = 64  # an 8x8 learned grid
DEEPSTACK_INDEXES = [0, 1]
PATCH_SIZE = 16
TEMPORAL_PATCH = 2
MERGE_SIZE = 2
BPE_VOCAB_SIZE = 1400
# Scale of what each attention/MLP block (and the vision mergers) adds to the residual stream, relative to
# an input-preserving init. Large, so that in the tied variant the input token's own embedding does not
# dominate the final hidden state (which would make greedy decoding repeat the last token forever).
RESIDUAL_GAIN = 16.0

# Qwen's special tokens, in Qwen's order, appended after the BPE vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added but not special: they survive `decode(skip_special_tokens=True)`, as in Qwen's tokenizer.
PLAIN_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A Qwen-style chat template: string or list content; image/image_url and video/video_url parts become
# vision placeholders; tools and tool calls are rendered the way Qwen3-VL-Instruct renders them.
CHAT_TEMPLATE = r"""{%- set media = namespace(images=0, videos=0) -%}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type in ['image', 'image_url'] or 'image' in part or 'image_url' in part -%}
                {%- set media.images = media.images + 1 -%}
                {%- if add_vision_id -%}{{- 'Picture ' ~ media.images ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type in ['video', 'video_url'] or 'video' in part or 'video_url' in part -%}
                {%- set media.videos = media.videos + 1 -%}
                {%- if add_vision_id -%}{{- 'Video ' ~ media.videos ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        '<args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif not (loop.first and tools and message.role == 'system') -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) -}}
        {%- if message.role == 'assistant' and message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
                {%- set fn = call.function if call.function else call -%}
                {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
                {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) -}}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Training text for the BPE: plain English about pictures, videos and everyday things.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, and a video is worth
many pictures. Describe this image in detail. What is shown in the picture? There is a cat sitting on a
red chair next to the window. The sun is shining and the sky is blue with a few white clouds.
A small boy is playing with a yellow ball in the garden, while his sister reads a book under a tall tree.
In the video, a man walks along the beach at sunset. Waves roll onto the sand and birds fly over the water.
The camera slowly moves to the left and shows a lighthouse on the rocks. Then the scene changes to a busy
street in the city, full of cars, buses, bicycles and people walking to work in the morning.
Please answer the question. How many apples are on the table? There are three green apples and two red
apples on the wooden table. The kitchen is bright and clean. A kettle is boiling on the stove.
Can you read the text on the sign? The sign says: "Welcome to the museum. Open every day from 9 to 5."
This chart shows the number of visitors in each month of the year. The highest value is in July and the
lowest value is in February. The line goes up in spring and comes down again in autumn.
I think the answer is yes, because the dog is looking at the ball and its tail is moving. It is happy.
The photo was taken at night. The lights of the houses are reflected in the river, and the moon is full.
You are a helpful assistant. You should answer the user's questions carefully and explain your reasoning.
Hello! How can I help you today? Thank you very much. You're welcome. Let's look at the image together.
First, we find the object; second, we measure its size; finally, we compare it with the others.
The mountain is covered with snow, and the forest below it is dark green. A river runs through the valley.
A woman in a blue dress is holding an umbrella because it is raining. People are waiting for the train.
The train arrives at the station at 10:45 and leaves again after five minutes. It's going to be late!
Numbers: 0 1 2 3 4 5 6 7 8 9 10 20 100 1000 2024 3.14 42 7% $19.99 #1 (a) [b] {c} <d> a+b=c x*y/z
Code: def main(): print("hello, world") return 0 if x > 1 else -1; for i in range(10): total += i
The model looks at every frame of the video and writes a short caption for each scene that it sees.
Colors: red, orange, yellow, green, blue, indigo, violet, black, white, gray, brown, pink, purple, gold.
Animals: cat, dog, horse, cow, sheep, bird, fish, lion, tiger, bear, rabbit, mouse, elephant, monkey.
Objects: table, chair, window, door, car, bus, phone, computer, lamp, bottle, cup, plate, knife, bag.
They were talking about the weather, the news, and the football match that they watched last weekend.
She said that she would come back tomorrow, but nobody knew whether she really meant it or not.
We have been working on this problem for a long time, and now we finally understand what went wrong.
The important thing is not to stop asking questions. Curiosity has its own reason for existing.
On the left side of the image there is a tall building; on the right side there is a small park.
At the top of the page there is a title in large letters, and below it there are two columns of text.
The person in the center of the picture is smiling and wearing glasses, a hat, and a green jacket.
Is there anything unusual in this scene? Yes: the clock on the wall shows the wrong time, and the
shadow of the tree points in a different direction from the shadows of the people.
Summarize the video in one sentence. A chef prepares a meal, tastes it, and serves it to the guests.
Translate to French: good morning, thank you, please, goodbye. Bonjour, merci, s'il vous plaît, au revoir.
Some words with accents: café, naïve, résumé, jalapeño, Zürich, São Paulo, Ångström, façade, coöperate.
What happens next? The door opens and a dog runs into the room, jumping over the sleeping cat.
Every morning the baker opens the shop at six o'clock and sells fresh bread, cakes and cookies.
The children built a sand castle with towers, walls and a bridge, and then the sea washed it away.
Write a list of the main steps:
1. Open the box.
2. Take out the parts.
3. Read the instructions carefully.
4. Put the parts together.
The weather today is cold and windy, with some rain in the afternoon and clear skies in the evening.
Where was this picture taken? It looks like a market in a small town, with fruit and vegetables on
display, colorful flowers, and people carrying baskets. Someone is buying oranges from an old man.
The robot picks up the red block and places it on top of the blue block, then it moves back.
Between the two trees there is a wooden bench where an old couple is sitting and feeding the pigeons.
"""


def _train_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on `CORPUS` and append Qwen's special and added tokens."""
    tokenizer = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    return tokenizer


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _model_config(arch: str, token_ids: dict[str, int], vocab_size: int, tie: bool, dtype: str) -> dict:
    """The `config.json` of the tiny model, as transformers 4.57 writes Qwen3-VL configs."""
    architecture, model_type = ARCHS[arch]
    text_config: dict = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_ids["<|endoftext|>"],
        "dtype": dtype,
        "eos_token_id": token_ids["<|im_end|>"],
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": TEXT_HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": TEXT_INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": f"{model_type}_text",
        "num_attention_heads": TEXT_HEADS,
        "num_hidden_layers": TEXT_LAYERS,
        "num_key_value_heads": TEXT_KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": list(MROPE_SECTION), "rope_type": "default"},
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if arch == "moe":
        text_config |= {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": MOE_INTERMEDIATE,
            "norm_topk_prob": True,
            "num_experts": NUM_EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOK,
        }
    vision_config = {
        "deepstack_visual_indexes": list(DEEPSTACK_INDEXES),
        "depth": VISION_DEPTH,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": VISION_HIDDEN,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": VISION_INTERMEDIATE,
        "model_type": f"{model_type}_vision",
        "num_heads": VISION_HEADS,
        "num_position_embeddings": VISION_POSITIONS,
        "out_hidden_size": TEXT_HIDDEN,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH,
    }
    return {
        "architectures": [architecture],
        "dtype": dtype,
        "image_token_id": token_ids["<|image_pad|>"],
        "model_type": model_type,
        "text_config": text_config,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "transformers_version": "4.57.0",
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_config": vision_config,
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
    }


def _weight_specs(arch: str, vocab_size: int, tie: bool) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(name, shape, mean, std) of every tensor, in a fixed order.

    Linear weights use std 1/sqrt(fan_in) so activations keep their scale, times RESIDUAL_GAIN where a
    block writes to the residual stream; embeddings have std 1 and the LM head std 0.5 (logits spread by
    about 4, so greedy decoding has clear winners); norm weights are 1 + noise and biases are noise, so a
    weight that is not loaded, or loaded wrongly, shows up in the outputs.
    """
    specs: list[tuple[str, tuple[int, ...], float, float]] = []

    def linear(name: str, out_dim: int, in_dim: int, bias: bool = False, gain: float = 1.0) -> None:
        specs.append((f"{name}.weight", (out_dim, in_dim), 0.0, gain * in_dim**-0.5))
        if bias:
            specs.append((f"{name}.bias", (out_dim,), 0.0, 0.1))

    def norm(name: str, dim: int, bias: bool = False) -> None:
        specs.append((f"{name}.weight", (dim,), 1.0, 0.1))
        if bias:
            specs.append((f"{name}.bias", (dim,), 0.0, 0.1))

    v = "model.visual"
    patch_shape = (VISION_HIDDEN, 3, TEMPORAL_PATCH, PATCH_SIZE, PATCH_SIZE)  # Conv3d
    specs.append((f"{v}.patch_embed.proj.weight", patch_shape, 0.0, (3 * TEMPORAL_PATCH * PATCH_SIZE**2) ** -0.5))
    specs.append((f"{v}.patch_embed.proj.bias", (VISION_HIDDEN,), 0.0, 0.1))
    specs.append((f"{v}.pos_embed.weight", (VISION_POSITIONS, VISION_HIDDEN), 0.0, 0.5))
    for i in range(VISION_DEPTH):
        block = f"{v}.blocks.{i}"
        norm(f"{block}.norm1", VISION_HIDDEN, bias=True)
        norm(f"{block}.norm2", VISION_HIDDEN, bias=True)
        linear(f"{block}.attn.qkv", 3 * VISION_HIDDEN, VISION_HIDDEN, bias=True)
        linear(f"{block}.attn.proj", VISION_HIDDEN, VISION_HIDDEN, bias=True)
        linear(f"{block}.mlp.linear_fc1", VISION_INTERMEDIATE, VISION_HIDDEN, bias=True)
        linear(f"{block}.mlp.linear_fc2", VISION_HIDDEN, VISION_INTERMEDIATE, bias=True)
    merged = VISION_HIDDEN * MERGE_SIZE**2
    mergers = [(f"{v}.merger", VISION_HIDDEN)]
    mergers += [(f"{v}.deepstack_merger_list.{k}", merged) for k in range(len(DEEPSTACK_INDEXES))]
    for name, norm_dim in mergers:
        norm(f"{name}.norm", norm_dim, bias=True)
        linear(f"{name}.linear_fc1", merged, merged, bias=True)
        linear(f"{name}.linear_fc2", TEXT_HIDDEN, merged, bias=True, gain=RESIDUAL_GAIN)

    t = "model.language_model"
    specs.append((f"{t}.embed_tokens.weight", (vocab_size, TEXT_HIDDEN), 0.0, 1.0))
    for i in range(TEXT_LAYERS):
        layer = f"{t}.layers.{i}"
        norm(f"{layer}.input_layernorm", TEXT_HIDDEN)
        linear(f"{layer}.self_attn.q_proj", TEXT_HEADS * HEAD_DIM, TEXT_HIDDEN)
        linear(f"{layer}.self_attn.k_proj", TEXT_KV_HEADS * HEAD_DIM, TEXT_HIDDEN)
        linear(f"{layer}.self_attn.v_proj", TEXT_KV_HEADS * HEAD_DIM, TEXT_HIDDEN)
        linear(f"{layer}.self_attn.o_proj", TEXT_HIDDEN, TEXT_HEADS * HEAD_DIM, gain=RESIDUAL_GAIN)
        norm(f"{layer}.self_attn.q_norm", HEAD_DIM)
        norm(f"{layer}.self_attn.k_norm", HEAD_DIM)
        norm(f"{layer}.post_attention_layernorm", TEXT_HIDDEN)
        if arch == "moe":
            linear(f"{layer}.mlp.gate", NUM_EXPERTS, TEXT_HIDDEN)
            gate_up = (NUM_EXPERTS, TEXT_HIDDEN, 2 * MOE_INTERMEDIATE)
            specs.append((f"{layer}.mlp.experts.gate_up_proj", gate_up, 0.0, TEXT_HIDDEN**-0.5))
            down = (NUM_EXPERTS, MOE_INTERMEDIATE, TEXT_HIDDEN)
            specs.append((f"{layer}.mlp.experts.down_proj", down, 0.0, RESIDUAL_GAIN * MOE_INTERMEDIATE**-0.5))
        else:
            linear(f"{layer}.mlp.gate_proj", TEXT_INTERMEDIATE, TEXT_HIDDEN)
            linear(f"{layer}.mlp.up_proj", TEXT_INTERMEDIATE, TEXT_HIDDEN)
            linear(f"{layer}.mlp.down_proj", TEXT_HIDDEN, TEXT_INTERMEDIATE, gain=RESIDUAL_GAIN)
    norm(f"{t}.norm", TEXT_HIDDEN)
    if not tie:
        specs.append(("lm_head.weight", (vocab_size, TEXT_HIDDEN), 0.0, 0.5))
    return specs


def _tokenizer_config(tokenizer: Tokenizer) -> dict:
    """`tokenizer_config.json` in the form Qwen3-VL ships it."""
    decoder = {
        str(token_id): {
            "content": added.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": added.special,
        }
        for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _processor_configs() -> tuple[dict, dict]:
    """`preprocessor_config.json` and `video_preprocessor_config.json` (tiny pixel limits, see module doc)."""
    common = {
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": MERGE_SIZE,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
    }
    image = {
        "size": {"shortest_edge": 32 * 32, "longest_edge": 512 * 512},
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
    }
    video = {
        "size": {"shortest_edge": 32 * 32, "longest_edge": 1024 * 32 * 32 * TEMPORAL_PATCH},
        **common,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
        "cap_pixels_per_frame": False,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    return image, video


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def create_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "moe",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random Qwen3-VL checkpoint (`arch` "moe" or "dense") into `out_dir` and return it.

    The same arguments always give byte-identical files.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer()
    token_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    vocab_size = _round_up(tokenizer.get_vocab_size(with_added_tokens=True), 64)

    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: mean + std * torch.randn(shape, generator=generator)
        for name, shape, mean, std in _weight_specs(arch, vocab_size, tie_word_embeddings)
    }
    # Rows of the padded vocabulary tail belong to no token: zero logits, far below the real tokens'.
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    for name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name][num_tokens:] = 0.0
    tensors = {name: tensor.to(getattr(torch, dtype)).contiguous() for name, tensor in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    _write_json(out / "config.json", _model_config(arch, token_ids, vocab_size, tie_word_embeddings, dtype))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": token_ids["<|endoftext|>"],
            "do_sample": True,
            "eos_token_id": [token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
            "pad_token_id": token_ids["<|endoftext|>"],
            "repetition_penalty": 1.0,
            "temperature": 0.7,
            "top_k": 20,
            "top_p": 0.8,
            "transformers_version": "4.57.0",
        },
    )
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    image_config, video_config = _processor_configs()
    _write_json(out / "preprocessor_config.json", image_config)
    _write_json(out / "video_preprocessor_config.json", video_config)
    return out


def default_model_path() -> Path:
    """The built-in default model (tiny MoE, seed 0), created on first use under the cache folder.

    The cache folder is `$VLM_SERVE_CACHE` or `~/.cache/vlm_serve`. The checkpoint is written to a
    temporary folder and renamed into place, so concurrent first calls are safe.
    """
    cache = Path(os.environ.get("VLM_SERVE_CACHE") or Path.home() / ".cache" / "vlm_serve")
    path = cache / "tiny-qwen3-vl-moe"
    if (path / "config.json").exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-vl-moe-", dir=cache))
    try:
        create_tiny_model(tmp, arch="moe", seed=0)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").exists():  # lost the race only if the winner's copy is there
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
