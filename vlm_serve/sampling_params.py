"""Per-request sampling settings."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_N = 128
MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
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
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, not {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], not {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
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
        if self.top_logprobs > 0 and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True")

    def per_choice(self) -> list[SamplingParams]:
        """The settings of each of the `n` choices: with a seed, choice i uses seed + i."""
        if self.seed is None:
            return [self] * self.n
        return [dataclasses.replace(self, seed=self.seed + i) for i in range(self.n)]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


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
    "ignore_eos": "ignore_eos",
    "n": "n",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
}


def sampling_params_from_openai(defaults: dict[str, Any], sampling: dict[str, Any]) -> SamplingParams:
    """OpenAI-named sampling keywords (None = not given) over `defaults` (SamplingParams fields)."""
    unknown = set(sampling) - set(OPENAI_SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
    fields = dict(defaults)
    fields.update({OPENAI_SAMPLING_KEYS[k]: v for k, v in sampling.items() if v is not None})
    return SamplingParams(**fields)


def generation_defaults(path: Path) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json, as vLLM and SGLang apply them."""
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return {}
    gen = json.loads(gen_file.read_text())
    if not gen.get("do_sample", False):
        return {"temperature": 0.0}
    return {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}
