"""A decoder layer on CPU as two decoder_cpu.c calls (its attention half and its MLP or MoE half) computes
what its modules compute one kernel call at a time, bit for bit: the layer's output, its residual stream
and the K/V it writes to the pool, for decode, prefill on a cached prefix and both in one batch, dense and
MoE layers, weights in float32, bfloat16, FP8 and 4- and 8-bit integers (llm-compressor's W4A16 and W8A16:
their checkpoints are made in a process, so those cases are marked `server`), on every ISA the kernels are built for
(cpu_targets.py). Where a part is not on the kernels, the layer runs its modules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlm_serve.config import ModelConfig
from vlm_serve.engine import Engine
from vlm_serve.kv_cache.memory_pool import KVPoolLayout, ReqToTokenPool, TokenToKVPool
from vlm_serve.llm.kernels import attention_cpu, decoder_cpu
from vlm_serve.llm.kernels.decoder_cpu import DecoderStep
from vlm_serve.llm.layers.attention import CpuAttnBackend
from vlm_serve.llm.models.loader import load_model
from vlm_serve.quantization import Fp8Config
from vlm_serve.testing.tiny_model import create_tiny_model

FORMATS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "fp8": {"quantize": "fp8"}}
INT_FORMATS = {"w4a16": "w4a16-asym", "w8a16": "w8a16", "w8a8": "w8a8"}  # (conftest.py's INT_RECIPES)
BATCHES = {  # (tokens per request, new ones)
    "decode": ([9, 1, 40], [1, 1, 1]),
    "prefill on a prefix": ([30, 12], [18, 12]),
    "mixed": ([25, 7, 70], [25, 1, 1]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, request) -> dict:
    """(arch, format) -> a tiny checkpoint's folder, made on first use."""
    made = {}

    def get(arch: str, form: str):
        if form in INT_FORMATS:
            return request.getfixturevalue("int_checkpoints")[f"{arch}-{INT_FORMATS[form]}"]
        if (arch, form) not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{form}")
            made[arch, form] = create_tiny_model(folder, arch=arch, seed=3, **FORMATS[form])
        return made[arch, form]

    return get


def text_model_and_batch(path, seq_lens: list[int], ext_lens: list[int], seed: int = 0):
    """The model's text model (its layers' weights packed for the current target), and a batch over a KV pool
    whose prefixes hold random K/V, its new tokens' slots scattered."""
    config = ModelConfig.from_pretrained(path)
    weight_dtype = torch.bfloat16 if isinstance(config.quantization, Fp8Config) else getattr(torch, config.torch_dtype)
    model = load_model(config, torch.device("cpu"), torch.float32, weight_dtype)
    text = config.text
    g = torch.Generator().manual_seed(seed)
    slots = 4 * sum(seq_lens) + 16
    layout = KVPoolLayout(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, 1, torch.float32)
    pool = TokenToKVPool(slots, layout, torch.device("cpu"))
    for buffer in pool.buffers():
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    rows = (torch.randperm(slots - 1, generator=g)[: len(seq_lens) * max(seq_lens)] + 1).view(len(seq_lens), -1).int()
    new = torch.cat([row[n - e : n] for row, n, e in zip(rows, seq_lens, ext_lens)]).long()
    backend = CpuAttnBackend(ReqToTokenPool(len(seq_lens), max(seq_lens), torch.device("cpu")), pool)
    paged = attention_cpu.paged_batch(rows, seq_lens, ext_lens, new)
    batch = SimpleNamespace(attn_backend=backend, attn_metadata=paged)
    tokens = sum(ext_lens)
    x = torch.randn(tokens, text.hidden_size, generator=g)
    residual = torch.randn(tokens, text.hidden_size, generator=g)
    cos, sin = model.model.language_model.rotary_emb(torch.randint(0, 100, (3, tokens), generator=g), torch.float32)
    return model.model.language_model, batch, pool, (x, residual, cos, sin)


@torch.inference_mode()  # (as the model runs)
def run_layer(layer, inputs, batch, fused: bool, with_residual: bool):
    x, residual, cos, sin = inputs
    residual = residual.clone() if with_residual else None
    if not fused:
        out, stream = layer(x.clone(), residual, cos, sin, batch)
    else:
        step = DecoderStep(layer.fused.kernel, x.shape[0], cos, sin, batch.attn_metadata)
        k_cache, v_cache = batch.attn_backend.token_to_kv_pool.get_kv(layer.self_attn.layer_id)
        out, stream = step.layer(layer.fused, x.clone(), residual, k_cache, v_cache)
    return out.clone(), stream.clone()


@pytest.mark.slow
@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("form", [*FORMATS, *(pytest.param(f, marks=pytest.mark.server) for f in INT_FORMATS)])
@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_the_two_calls_compute_what_the_modules_do_bit_for_bit(arch, form, batch_name, checkpoints, kernel_target):
    seq_lens, ext_lens = BATCHES[batch_name]
    text_model, batch, pool, inputs = text_model_and_batch(checkpoints(arch, form), seq_lens, ext_lens)
    layers = text_model.layers
    assert all(layer.fused is not None for layer in layers)
    buffers = pool.buffers()
    before = [c.clone() for c in buffers]

    def run(layer, fused: bool, with_residual: bool):
        for cache, start in zip(buffers, before):
            cache.copy_(start)
        return run_layer(layer, inputs, batch, fused, with_residual), [c.clone() for c in buffers]

    for layer in layers:
        for with_residual in (True, False):
            (want, want_stream), want_caches = run(layer, False, with_residual)
            (got, got_stream), got_caches = run(layer, True, with_residual)
            assert torch.equal(got, want) and torch.equal(got_stream, want_stream)
            assert all(torch.equal(c, w) for c, w in zip(got_caches, want_caches))
            assert not all(torch.equal(c, b) for c, b in zip(got_caches, before))  # (the new K/V were written)


def test_the_layers_run_their_modules_where_the_batch_is_not_the_kernels(checkpoints, native_kernels):
    """(A batch of the torch attention backend: its metadata is not the kernel's paged batch.)"""
    text_model, batch, _, (x, _, cos, sin) = text_model_and_batch(checkpoints("dense", "float32"), [5], [5])
    assert text_model.fused_step(x, cos, sin, batch) is not None
    assert text_model.fused_step(x, cos, sin, SimpleNamespace(attn_metadata=None)) is None
    text_model.layers[1].fused = None
    assert text_model.fused_step(x, cos, sin, batch) is None


def test_under_overlap_a_layer_runs_on_the_forward_threads_team(tiny_dense_dir, native_kernels, monkeypatch):
    """The batch is made on the scheduler's thread, which runs with one OpenMP thread while the forward
    thread computes: the layer takes the thread count where it runs (torch's, here), not where its batch
    was made. (On a one-core machine both are one.)"""
    kernel, threads = decoder_cpu.LIBRARY.get(), []
    call = kernel.attention_block_f32

    def recording(*args):
        threads.append(getattr(args[-1], "value", args[-1]))  # (its last argument: a C int, bound once a step)
        return call(*args)

    monkeypatch.setattr(kernel, "attention_block_f32", recording)  # (before the layers bind it)
    with Engine(tiny_dense_dir, vit_dp=0) as engine:  # (the overlap loop: the default)
        assert engine.scheduler.forward_thread is not None
        engine.chat([{"role": "user", "content": "Count to three."}], max_tokens=3, temperature=0)
    assert threads and set(threads) == {torch.get_num_threads()}
