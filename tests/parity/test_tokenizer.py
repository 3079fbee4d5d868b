"""The runtime Tokenizer against transformers' tokenizer on the tiny checkpoint (and Qwen-style configs)."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from PIL import Image

from vlm_serve.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world!",
    "Describe this image in detail.",
    "  leading spaces,\ttabs\n\nand blank lines  \n",
    "\r\n\r\n   \n",
    "Zürich café naïve façade — «quotes» 日本語 한국어 🙂👍🏽",
    "cafe\u0301 vs café (NFD and NFC)",
    "12345 3.14159 -42 1e10 $19.99 2024-06-01 10:45",
    "don't I'll we've THEY'RE it's",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|vision_start|><|image_pad|><|image_pad|><|vision_end|>b<|video_pad|>",
    '<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "<|endoftext|><|im_end|> trailing <|im_start",
    'def main():\n    print("hello, world")\n    return 0\n',
    "x" * 200,
    "",
]

CONVERSATIONS = {
    "text": [{"role": "user", "content": "Hi there"}],
    "text_parts": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}],
    "image": [
        {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"}]}
    ],
    "image_url": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}},
            ],
        }
    ],
    "video": [
        {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "Summarize."}]},
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///v.mp4"}}]},
    ],
    "system": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
    ],
    "system_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Hello"},
    ],
    "multi_turn": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q1"}]},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": [{"type": "text", "text": "q2"}, {"type": "video"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a2"}]},
        {"role": "user", "content": "q3 with <|image_pad|> typed in"},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris and Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Zürich"}'}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": [{"type": "text", "text": "rain"}]},
        {"role": "assistant", "content": "Sunny in Paris, rain in Zürich."},
    ],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Current weather — in °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, theirs, text: str):
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)  # byte-level: lossless


def test_special_tokens_are_single_ids(ours: Tokenizer):
    ids = ours.encode("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>")
    assert ids[0] == ours.token_to_id("<|im_start|>") and ids[-1] == ours.token_to_id("<|im_end|>")
    assert ids[-4:-1] == [ours.vision_start_token_id, ours.image_token_id, ours.vision_end_token_id]
    assert ours.decode(ids) == "user\n"  # special tokens skipped by default
    # <think> is an added token but not a special one: it survives skip_special_tokens.
    think = ours.encode("<think>")
    assert len(think) == 1 and ours.decode(think) == "<think>"
    # Ids in the padded tail of the embedding table decode to nothing, as in transformers.
    assert ours.decode([ours.vocab_size + 3] + ours.encode("ok")) == "ok"


def test_ids_match_transformers_and_config(tiny_moe_dir: Path, ours: Tokenizer, theirs):
    config = json.loads((tiny_moe_dir / "config.json").read_text())
    assert ours.vocab_size == len(ours) == len(theirs)
    assert ours.eos_token_id == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|im_end|>")
    assert ours.pad_token_id == theirs.pad_token_id == theirs.convert_tokens_to_ids("<|endoftext|>")
    assert ours.bos_token_id is None and theirs.bos_token_id is None
    assert ours.image_token_id == config["image_token_id"] == theirs.convert_tokens_to_ids("<|image_pad|>")
    assert ours.video_token_id == config["video_token_id"] == theirs.convert_tokens_to_ids("<|video_pad|>")
    assert ours.vision_start_token_id == config["vision_start_token_id"]
    assert ours.vision_end_token_id == config["vision_end_token_id"]
    assert ours.token_to_id("<|no such token|>") is None
    for token_id in (0, 100, ours.eos_token_id, ours.vocab_size - 1):
        assert ours.id_to_token(token_id) == theirs.convert_ids_to_tokens(token_id)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(ours: Tokenizer, theirs, name: str, add_generation_prompt: bool):
    messages = CONVERSATIONS[name]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert "None" not in rendered


def test_chat_template_renders_qwen_format(ours: Tokenizer):
    messages = CONVERSATIONS["multi_turn"]
    assert ours.apply_chat_template(messages) == (
        "<|im_start|>system\nsys<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>q1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|vision_start|><|video_pad|><|vision_end|>"
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\na2<|im_end|>\n"
        "<|im_start|>user\nq3 with <|image_pad|> typed in<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # No default system prompt.
    rendered = ours.apply_chat_template(CONVERSATIONS["text"])
    assert rendered == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["text", "system", "tool_calls"])
def test_tools_and_extra_variables_match_transformers(ours: Tokenizer, theirs, name: str):
    messages = CONVERSATIONS[name]
    rendered = ours.apply_chat_template(messages, tools=TOOLS)
    assert rendered == theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "°C" in rendered and '"required": ["city"]' in rendered  # tojson: no ASCII escaping
    with_ids = ours.apply_chat_template(CONVERSATIONS["multi_turn"], add_vision_id=True)
    assert with_ids == theirs.apply_chat_template(
        CONVERSATIONS["multi_turn"], tokenize=False, add_generation_prompt=True, add_vision_id=True
    )
    assert "Picture 2: <|vision_start|>" in with_ids and "Video 1: " in with_ids


def test_rich_objects_in_messages(ours: Tokenizer, theirs):
    """Decoded images (or anything else) inside content parts render like their placeholders."""
    content = [{"type": "image", "image": Image.new("RGB", (4, 4))}, {"type": "text", "text": "?"}]
    messages = [{"role": "user", "content": content}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|image_pad|>" in rendered


def test_template_environment(tmp_path: Path, tiny_moe_dir: Path):
    """raise_exception, special-token variables, loop controls, generation blocks, chat_template.jinja first."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_moe_dir, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    # Block tags on their own (indented) lines leave no trace: trim_blocks and lstrip_blocks are on.
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}\n"
        "    {% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}\n"
        "    {% if loop.index > 2 %}\n        {% break %}\n    {% endif %}\n"
        "  [{% generation %}{{ m.content }}{% endgeneration %}]\n"
        "{% endfor %}\n"
        "{{ eos_token }}|{{ extra }}"
    )
    ours = Tokenizer.from_pretrained(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": c} for c in "abc"]
    rendered = ours.apply_chat_template(messages, extra=7)
    assert rendered == "  [a]\n  [b]\n<|im_end|>|7"
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, extra=7)
    with pytest.raises(ValueError, match="the chat template cannot render these messages: bad role"):
        ours.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(ValueError):
        ours.apply_chat_template([])


def test_qwen_style_config_variants(tmp_path: Path, tiny_moe_dir: Path):
    """Checkpoints written by other tools: AddedToken dicts for special tokens, a list of named templates in
    tokenizer_config.json, or no template at all."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(tiny_moe_dir / "tokenizer.json", model_dir)
    config = json.loads((tiny_moe_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False}
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0].content }}!"},
    ]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"

    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template is None
    assert tokenizer.encode("hi") == Tokenizer.from_pretrained(tiny_moe_dir).encode("hi")
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
