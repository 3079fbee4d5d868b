"""The runtime tokenizer: a checkpoint's `tokenizer.json` plus its chat template, without transformers.

Ids and rendered prompts are the same as transformers' tokenizer and processor give for the checkpoint
(`encode` adds no BOS; special tokens written in the text are recognised).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """JSON without HTML escaping (unlike jinja's built-in filter), as chat templates expect."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _plain(value: Any) -> Any:
    """A copy of template input made of JSON-like types only; anything else (images, arrays) becomes "<Type>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, numpy floats, ...) are cut back to the base type, losing their extra methods.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "model_dump"):  # pydantic models (the OpenAI protocol types)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _cut_after(rendered: str, message: dict) -> str:
    """`rendered` up to the end of `message`'s (last) text, which the template may have stripped."""
    content = message.get("content")
    if isinstance(content, list):
        content = next((part["text"] for part in reversed(content) if part.get("type") == "text"), None)
    text = content.strip() if isinstance(content, str) else ""
    if not text or text not in rendered:
        raise ValueError("continue_final_message needs a final message whose text the chat template renders")
    start = rendered.rindex(text)
    kept = content.lstrip()  # the trailing whitespace too, where the template kept it
    return rendered[: start + (len(kept) if rendered.startswith(kept, start) else len(text))]


def _token_content(token: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string, an AddedToken dict or null."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _load_chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """The checkpoint's default chat template: `chat_template.jinja`, else `chat_template.json`, else the
    tokenizer config's (a string, or a list of named templates)."""
    if (model_dir / "chat_template.jinja").exists():
        return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (model_dir / "chat_template.json").exists():
        return json.loads((model_dir / "chat_template.json").read_text(encoding="utf-8"))["chat_template"]
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


class Tokenizer:
    """Byte-level BPE tokenizer and chat template of a Qwen3-VL (or any HF-layout) checkpoint."""

    def __init__(self, tokenizer: _HFTokenizer, tokenizer_config: dict, chat_template: str | None) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self._special_tokens = {
            key: content
            for key in _SPECIAL_TOKEN_KEYS
            if (content := _token_content(tokenizer_config.get(key))) is not None
        }
        self._template: jinja2.Template | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template from a checkpoint folder."""
        path = Path(model_dir)
        tokenizer = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        return cls(tokenizer, config, _load_chat_template(path, config))

    # -- ids ------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS is added and special tokens in the text become their ids."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids without a token (the padded tail of the embedding table) are dropped."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included (the model's embedding table may be larger)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        """Every token's encoded string (byte-level for Qwen), added tokens included, with its id."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The whole `tokenizer.json` (normalizer, pre-tokenizer, model, decoder), as a string."""
        return self._tokenizer.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def _special_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def image_token_id(self) -> int | None:
        return self.token_to_id("<|image_pad|>")

    @property
    def video_token_id(self) -> int | None:
        return self.token_to_id("<|video_pad|>")

    @property
    def vision_start_token_id(self) -> int | None:
        return self.token_to_id("<|vision_start|>")

    @property
    def vision_end_token_id(self) -> int | None:
        return self.token_to_id("<|vision_end|>")

    # -- chat template --------------------------------------------------------------------------------

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            if self.chat_template is None:
                raise ValueError("this checkpoint has no chat template")
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        return self._template

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render `messages` with the checkpoint's chat template, as transformers' `apply_chat_template(...,
        tokenize=False)` does: message keys whose value is None are dropped, the special tokens
        (`eos_token`, ...) are template variables, and `extra` (e.g. `tools`, `add_vision_id`) is passed through.
        `continue_final_message` ends the text right after the last message's text (no end-of-turn tokens).
        Whatever the template refuses (its `raise_exception`, or data of the wrong type) is a ValueError."""
        if not messages:
            raise ValueError("cannot render an empty conversation")
        messages = [{k: v for k, v in _plain(message).items() if v is not None} for message in messages]
        variables = {"tools": None, "documents": None, **self._special_tokens, **_plain(extra)}
        try:
            rendered = self._compiled_template().render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
            # the template ran on the caller's data (messages, tools, kwargs): what it refuses is their fault
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None
        return _cut_after(rendered, messages[-1]) if continue_final_message else rendered
