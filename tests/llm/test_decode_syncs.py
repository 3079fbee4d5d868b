"""A decode step never makes the host wait for the device: between launching a batch and reading its tokens
(`SampleOutput.tolist`, after the next batch is launched), nothing on the decode path reads device data on
the host — no `.item()`, `.tolist()`, `.cpu()`, `int(t)`, `if t:`, `nonzero`, boolean-mask indexing.

On CPU every tensor is on the host, so the guard is a torch-function mode that records those calls made while
a decode batch's `forward_batch_generation` runs (the future ids resolved, the forward launched, the logits,
the sampler with penalties, bias, min-p, log-probs), the model's own forward left out: on CUDA that is a
CUDA graph's replay, checked by the GPU test at the end, which turns torch's sync debug mode to errors. The
one exception by design: a seeded row draws on the CPU, from its own logits (so that its tokens depend on
nothing else), and that copy waits."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from vlm_serve.engine import Engine
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.overlap import FutureMap

# the tensor calls that wait for the device where the tensor is on one
SYNCING = frozenset(
    {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere"}
    | {"masked_select", "unique", "unique_consecutive", "repeat_interleave", "equal", "allclose"}
)

UNSEEDED = [  # every kind of row a decode batch samples, but a seeded one
    dict(temperature=0),
    dict(temperature=0.8, top_p=0.9, top_k=20),
    dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
    dict(temperature=0, logprobs=True, top_logprobs=3),
    dict(temperature=1.0, min_p=0.1, logit_bias={5: 2.0}, frequency_penalty=0.2, logprobs=True),
    dict(temperature=0, min_tokens=4),
]


class SyncRecorder(TorchFunctionMode):
    """Where each syncing call was made (file:line, function), unless paused."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        masked = name == "__getitem__" and _has_bool_index(args[1:])
        if not self.paused and (name in SYNCING or masked):
            frame = traceback.extract_stack(limit=2)[0]
            self.calls.append(f"{name} at {Path(frame.filename).name}:{frame.lineno} ({frame.name})")
        return func(*args, **kwargs)


def _has_bool_index(index) -> bool:
    items = index[0] if index and isinstance(index[0], tuple) else index
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> SyncRecorder:
    """Records in decode batches' `forward_batch_generation`, the model's forward paused (patched before an
    engine binds the method)."""
    recorder = SyncRecorder()
    generate, forward = ModelRunner.forward_batch_generation, ModelRunner.forward_with_aux

    def recorded_generate(self, batch):
        if not batch.forward_mode.is_decode():
            return generate(self, batch)
        with recorder:
            return generate(self, batch)

    def unrecorded_forward(self, batch):
        recorder.paused = True
        try:
            return forward(self, batch)
        finally:
            recorder.paused = False

    monkeypatch.setattr(ModelRunner, "forward_batch_generation", recorded_generate)
    monkeypatch.setattr(ModelRunner, "forward_with_aux", unrecorded_forward)
    return recorder


def decode(model_dir: Path, rows: list[dict], overlap: bool, tokens: int = 8) -> list[list[int]]:
    with Engine(model_dir, vit_dp=0, disable_overlap_schedule=not overlap) as engine:
        prompt = engine.processor.process_messages([{"role": "user", "content": "count"}], add_generation_prompt=True)
        submissions = [engine.submit(prompt, max_tokens=tokens, ignore_eos=True, **row) for row in rows]
        while not all(s.done for s in submissions):
            engine.step()
        return [engine.result(s).choices[0].token_ids for s in submissions]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_a_decode_step_makes_the_host_wait_for_nothing(tiny_dense_dir, recorder, overlap):
    decode(tiny_dense_dir, UNSEEDED, overlap)
    assert recorder.calls == []


def test_a_seeded_row_waits_for_its_logits_only_where_it_draws(tiny_dense_dir, recorder):
    decode(tiny_dense_dir, [*UNSEEDED, dict(temperature=0.7, top_k=20, seed=5)], overlap=True)
    assert recorder.calls
    assert all("(_sample)" in call or "(_seeded_draws)" in call for call in recorder.calls), recorder.calls


def test_the_guard_finds_a_wait_planted_on_the_decode_path(tiny_dense_dir, recorder, monkeypatch):
    store = FutureMap.store

    def store_and_look(self, start, next_token_ids):
        next_token_ids[0].item()
        return store(self, start, next_token_ids)

    monkeypatch.setattr(FutureMap, "store", store_and_look)
    decode(tiny_dense_dir, UNSEEDED[:1], overlap=True, tokens=3)
    assert recorder.calls and all(call.startswith("item at ") for call in recorder.calls), recorder.calls


def test_penalties_count_the_token_still_on_the_device_as_the_normal_loop_does(tiny_dense_dir):
    """Under overlap a penalized row's last token is the batch before's, not yet on the host: counted on the
    device, it gives the normal loop's (greedy) tokens."""
    rows = [
        dict(temperature=0, repetition_penalty=2.0),
        dict(temperature=0, frequency_penalty=1.5, presence_penalty=1.0),
        dict(temperature=0),
    ]
    assert decode(tiny_dense_dir, rows, overlap=True, tokens=12) == decode(
        tiny_dense_dir, rows, overlap=False, tokens=12
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch's sync debug mode)")
def test_on_cuda_a_decode_step_with_its_graph_replay_makes_no_synchronizing_call(tiny_dense_dir, monkeypatch):
    """The normal loop (one thread): each decode batch's forward_batch_generation, CUDA graph included, under
    `torch.cuda.set_sync_debug_mode("error")`."""
    generate = ModelRunner.forward_batch_generation

    def strict_generate(self, batch):
        if not batch.forward_mode.is_decode():
            return generate(self, batch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return generate(self, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(ModelRunner, "forward_batch_generation", strict_generate)
    with Engine(tiny_dense_dir, vit_dp=0, disable_overlap_schedule=True, dtype="bfloat16") as engine:
        prompt = engine.processor.process_messages([{"role": "user", "content": "count"}], add_generation_prompt=True)
        submissions = [engine.submit(prompt, max_tokens=8, ignore_eos=True, **row) for row in UNSEEDED]
        while not all(s.done for s in submissions):
            engine.step()
        for s in submissions:
            assert len(engine.result(s).choices[0].token_ids) == 8
