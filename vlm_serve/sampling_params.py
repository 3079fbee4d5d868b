"""Per-request sampling settings."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

MAX_N = 128
MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a signed 64-bit integer, as in vLLM
GREEDY_BELOW = 1e-5  # a temperature below this is greedy, as in vLLM (dividing by it could overflow the logits)


@dataclass
class SamplingParams:
    """One request's sampling settings, from the protocol layer to the sampler (validated when made)."""

    max_new_tokens: int | None = 128  # None: what the context leaves, set once the prompt is known
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = no limit
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # a single str (or None) is accepted too
    stop_regex: list[str] = field(default_factory=list)  # SGLang's: regular expressions; a str (or None) too
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-prob and its top k alternatives
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # structured output (at most one): the answer follows a JSON schema, a regex or an EBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    reasoning: bool = False  # the answer starts with reasoning up to `</think>`: a grammar applies after it

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_regex = check_stop_regex(self.stop_regex)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:  # (the token its prefill samples)
            raise ValueError(f"max_new_tokens (max_tokens) must be >= 1, not {self.max_new_tokens}")
        if self.min_new_tokens < 0 or (self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens):
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], not {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if self.seed is not None and (type(self.seed) is not int or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be a signed 64-bit integer, in [{SEED_MIN}, {SEED_MAX}], not {self.seed!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, not {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], not {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], not {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, not {self.repetition_penalty}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, not {s!r}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], not {self.n}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {self.top_logprobs}")
        if self.logit_bias:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        grammars = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(f"at most one of json_schema, regex and ebnf may be given, not {' and '.join(grammars)}")
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except (TypeError, json.JSONDecodeError) as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {self.prompt_logprobs}")
        if self.top_logprobs > 0 and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True")

    def per_choice(self) -> list[SamplingParams]:
        """The settings of each of the `n` choices: with a seed, choice i uses seed + i (wrapping around
        within the signed 64-bit range; torch's generators take seeds modulo 2**64 anyway)."""
        if self.seed is None:
            return [self] * self.n
        return [dataclasses.replace(self, seed=(self.seed + i - SEED_MIN) % 2**64 + SEED_MIN) for i in range(self.n)]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


class SamplingRequest(Protocol):
    """A request body with sampling settings (the protocol layer's chat, completion and `/generate`)."""

    def to_sampling_params(self, defaults: dict[str, Any], **given: Any) -> SamplingParams: ...


# OpenAI-named sampling keyword -> SamplingParams field (what every front end accepts)
OPENAI_SAMPLING_KEYS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "prompt_logprobs": "prompt_logprobs",
    "logit_bias": "logit_bias",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "reasoning": "reasoning",
}


def check_stop_regex(patterns: str | list[str] | None) -> list[str]:
    """SGLang's `stop_regex` (a pattern, a list of them or None) as a list of patterns; ValueError names a
    pattern that is empty or not a regular expression."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns or [])
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"stop_regex patterns must be non-empty str, not {pattern!r}")
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as exc:  # (the last two: a size or nesting too deep)
            raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None
    return patterns


def _check_logit_bias(bias: dict) -> dict[int, float]:
    """OpenAI's logit_bias (keys are token ids, as strings in JSON) with int keys; values in [-100, 100]."""
    checked = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, not {key!r}") from None
        if token_id < 0:
            raise ValueError(f"logit_bias token id {token_id} is negative")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], not {value!r} (token {token_id})")
        checked[token_id] = float(value)
    return checked


def sampling_params_over(defaults: dict[str, Any], given: dict[str, Any]) -> SamplingParams:
    """SamplingParams' fields as a request gives them (None = not given) over `defaults` (the checkpoint's
    generation config); ValueError names a bad value."""
    return SamplingParams(**(defaults | {name: value for name, value in given.items() if value is not None}))


def sampling_params_from_openai(defaults: dict[str, Any], sampling: dict[str, Any]) -> SamplingParams:
    """OpenAI-named sampling keywords (None = not given) over `defaults`. Without max_tokens an answer
    may run to what the context leaves, as in vLLM. Unknown names raise TypeError, bad values ValueError."""
    unknown = set(sampling) - set(OPENAI_SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
    given = {OPENAI_SAMPLING_KEYS[k]: v for k, v in sampling.items() if v is not None}
    return sampling_params_over({"max_new_tokens": None} | defaults, given)


def generation_defaults(path: Path) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json, as vLLM and SGLang apply them."""
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return {}
    gen = json.loads(gen_file.read_text())
    if not gen.get("do_sample", False):
        return {"temperature": 0.0}
    return {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}
