"""Faults injected into one request's own path, chosen by the request itself:

- a stop string `SAMPLE`: sampling its rows raises (the whole batch's try, then its own);
- a stop string `OUTPUT`: processing its third token raises (the scheduler's output processing);
- the token `DETOKENIZE` in its answer (forced by `logit_bias`): decoding its text raises (the detokenizer).

`install` puts them in: in a test with pytest's `monkeypatch.setattr`, in every process of a server by
fault_plugin/sitecustomize.py (with this folder and that one on PYTHONPATH: `server_env()`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

SAMPLE = "<fault:sample>"
OUTPUT = "<fault:output>"
DETOKENIZE = "<|video_pad|>"  # (never in an answer otherwise)
OUTPUT_AT = 3  # the token whose processing raises


def install(setattr: Callable[[Any, str, Any], None] = setattr) -> None:
    from vlm_serve.llm.layers.sampler import Sampler
    from vlm_serve.scheduler.schedule_batch import Req
    from vlm_serve.server.detokenizer_manager import DetokenizerManager

    sample, check_finished, detokenize_one = Sampler.__call__, Req.check_finished, DetokenizerManager._one

    def faulty_sample(self, logits, reqs):
        if any(SAMPLE in r.sampling_params.stop for r in reqs):
            raise RuntimeError("injected sampling fault")
        return sample(self, logits, reqs)

    def faulty_check_finished(req, token, eos_token_ids):
        if OUTPUT in req.sampling_params.stop and len(req.output_ids) == OUTPUT_AT:
            raise RuntimeError("injected output fault")
        return check_finished(req, token, eos_token_ids)

    def faulty_detokenize_one(self, out):
        if self.tokenizer.token_to_id(DETOKENIZE) in out.new_ids:
            raise RuntimeError("injected detokenizer fault")
        return detokenize_one(self, out)

    setattr(Sampler, "__call__", faulty_sample)
    setattr(Req, "check_finished", faulty_check_finished)
    setattr(DetokenizerManager, "_one", faulty_detokenize_one)


def server_env() -> dict[str, str]:
    """The environment of a server whose every process has the faults installed."""
    here = Path(__file__).parent
    path = os.pathsep.join(filter(None, [str(here / "fault_plugin"), str(here), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}
