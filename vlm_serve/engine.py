"""The in-process engine: chat template, media preprocessing and the scheduler, without HTTP."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.scheduler.schedule_batch import Req
from vlm_serve.llm.scheduler.scheduler import Scheduler
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.testing.tiny_model import default_model_path
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.items import ProcessedInput
from vlm_serve.vision.processor import MultimodalProcessor

# OpenAI-style keyword -> SamplingParams field
_SAMPLING_KEYS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str


class Engine:
    """`Engine(model=path, dtype="float32").chat(messages, max_tokens=16, temperature=0).text`.

    `model=None` uses the built-in tiny MoE checkpoint. Other keywords are `ServerArgs` fields.
    """

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        path = Path(model) if model is not None else default_model_path()
        self.server_args = ServerArgs(model=str(path), **options)
        self.model_config = ModelConfig.from_pretrained(path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.processor = MultimodalProcessor.from_pretrained(path, self.tokenizer)
        runner = ModelRunner(self.server_args, self.model_config)
        self.scheduler = Scheduler(runner, self.model_config.eos_token_ids)
        self.default_sampling = _generation_defaults(path)
        self._ids = itertools.count()

    def chat(self, messages: list[dict], **sampling: Any) -> GenerateOutput:
        """One conversation in OpenAI form (image/video parts as paths, data URLs or PIL images)."""
        return self.chat_batch([messages], **sampling)[0]

    def chat_batch(self, conversations: list[list[dict]], **sampling: Any) -> list[GenerateOutput]:
        inputs = [self.processor.process_messages(m, add_generation_prompt=True) for m in conversations]
        return self.generate_processed(inputs, **sampling)

    def generate(self, prompt: str, images: list | None = None, videos: list | None = None, **sampling: Any):
        """Raw prompt text containing one `<|image_pad|>` / `<|video_pad|>` per image / video."""
        processed = self.processor.process(prompt, images=images or [], videos=videos or [])
        return self.generate_processed([processed], **sampling)[0]

    def generate_processed(self, inputs: list[ProcessedInput], **sampling: Any) -> list[GenerateOutput]:
        params = self.sampling_params(**sampling)
        reqs = [
            Req(str(next(self._ids)), list(x.input_ids), params, list(x.mm_items)) for x in inputs
        ]
        for req in reqs:
            self.scheduler.add_request(req)
        while not all(r.finished for r in reqs):
            self.scheduler.step()
        return [
            GenerateOutput(
                self.tokenizer.decode(r.output_ids), r.output_ids, len(r.origin_input_ids), r.finished_reason
            )
            for r in reqs
        ]

    def sampling_params(self, **sampling: Any) -> SamplingParams:
        unknown = set(sampling) - set(_SAMPLING_KEYS)
        if unknown:
            raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
        fields = dict(self.default_sampling)
        fields.update({_SAMPLING_KEYS[k]: v for k, v in sampling.items() if v is not None})
        return SamplingParams(**fields)

    def shutdown(self) -> None:
        self.scheduler = None  # type: ignore[assignment]


def _generation_defaults(path: Path) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json, as vLLM and SGLang apply them."""
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return {}
    gen = json.loads(gen_file.read_text())
    if not gen.get("do_sample", False):
        return {"temperature": 0.0}
    return {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}
