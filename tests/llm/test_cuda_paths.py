"""What the GPU kit (vlm_serve.tools.gpu_check) found on CUDA, kept as specifications. The CUDA tests run
on a GPU (the kit's suite part runs this file first) and are skipped elsewhere; the choice of backend and
its error are checked on any device."""

from __future__ import annotations

import importlib.util
import tempfile

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from vlm_serve.config import ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.kv_cache.memory_pool import KVPoolLayout, ReqToTokenPool, TokenToKVPool
from vlm_serve.llm.cuda_graph_runner import bucket_for, capture_sizes
from vlm_serve.llm.layers.attention import TorchAttnBackend, create_attention_backend
from vlm_serve.llm.layers.attention.flashinfer_backend import padded_decode_indices
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.multimodal.image_processor import image_normalizer
from vlm_serve.multimodal.pixels import PatchPixels, PixelNormalizer
from vlm_serve.testing.media import make_image
from vlm_serve.testing.tiny_model import create_tiny_model


def pools(device: str, dtype: torch.dtype, head_dim: int):
    device = torch.device(device)
    return ReqToTokenPool(4, 128, device), TokenToKVPool(256, KVPoolLayout(1, 2, head_dim, 1, dtype), device)


def test_flashinfer_asked_for_where_it_cannot_run_is_refused_naming_what_it_needs():
    with pytest.raises(
        ValueError,
        match=r"bfloat16 or float16 KV cache and a head size of 64, 128, 256 \(here: torch.float32, head size 32, on cpu\)",
    ):
        create_attention_backend("flashinfer", *pools("cpu", torch.float32, 32), 8, 2, 32, 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 128), (torch.bfloat16, 32)])
def test_auto_takes_torch_on_cuda_where_flashinfer_cannot_run(dtype, head_dim):
    """FlashInfer has no float32 kernels, and its Hopper prefill kernels no head size 32 (both crashed
    on an H200 when auto picked FlashInfer for them)."""
    backend = create_attention_backend("auto", *pools("cuda", dtype, head_dim), 8, 2, head_dim, head_dim**-0.5)
    assert isinstance(backend, TorchAttnBackend)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python (the gpu extra)")
def test_auto_takes_flashinfer_on_cuda_for_half_precision_at_its_head_sizes():
    from vlm_serve.llm.layers.attention.flashinfer_backend import FlashInferAttnBackend

    backend = create_attention_backend("auto", *pools("cuda", torch.bfloat16, 128), 8, 2, 128, 128**-0.5)
    assert isinstance(backend, FlashInferAttnBackend)


@pytest.mark.gpu
def test_torch_attention_on_cuda_never_runs_cudnn_attention():
    """cuDNN's attention builds a plan for each new shape: 90% of a decode step's time on an H200."""
    path = create_tiny_model(tempfile.mkdtemp(), arch="dense", size="small", dtype="bfloat16")
    with Engine(path, device="cuda", attention_backend="torch", vit_dp=0, disable_overlap_schedule=True) as engine:
        engine.generate("Count to ten:", max_tokens=2, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            engine.generate("Count to twenty:", max_tokens=8, ignore_eos=True)
    names = {event.key for event in trace.key_averages()}
    assert not [n for n in names if "cudnn_attention" in n]
    assert any("attention" in n for n in names)  # (the profile saw the attention)


def test_decode_batches_replay_the_smallest_captured_size_that_holds_them():
    sizes = capture_sizes(20)
    assert sizes == [1, 2, 4, 8, 12, 16, 20]
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 17, 20, 21)] == [1, 4, 8, 12, 20, 20, None]
    assert capture_sizes(1) == [1] and capture_sizes(160)[-3:] == [128, 144, 160]


def test_padding_rows_of_a_graph_batch_read_and_write_the_dummy_slot_alone():
    indptr, indices = padded_decode_indices(
        torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([7, 8, 9, 4, 5]), 4
    )
    assert indptr.tolist() == [0, 3, 5, 6, 7] and indices.tolist() == [7, 8, 9, 4, 5, 0, 0]
    assert padded_decode_indices(torch.tensor([0], dtype=torch.int32), torch.tensor([], dtype=torch.int64), 2)[
        0
    ].tolist() == [0, 1, 2]


def test_cuda_graph_settings_are_checked():
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 1, not 0"):
        ServerArgs(cuda_graph_max_bs=0)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python (the gpu extra)")
@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_decode_replayed_from_cuda_graphs_gives_the_eager_tokens(arch):
    """Batches of 1 to 5 requests (padded to the captured sizes 1, 2, 4, 8), as the requests finish at
    different lengths, in bfloat16 with FlashInfer."""
    path = create_tiny_model(tempfile.mkdtemp(), arch=arch, size="small", dtype="bfloat16")
    prompts = [f"{i}: count the shapes" + " and colours" * i for i in range(5)]
    answers = {}
    for eager in (True, False):
        with Engine(path, device="cuda", disable_cuda_graph=eager, cuda_graph_max_bs=8) as engine:
            assert (engine.scheduler.runner.cuda_graphs is None) == eager
            outs = [
                engine.submit(
                    engine.processor.process_messages([{"role": "user", "content": p}], add_generation_prompt=True),
                    max_tokens=6 + 3 * i,
                    ignore_eos=True,
                    temperature=0,
                )
                for i, p in enumerate(prompts)
            ]
            while not all(o.done for o in outs):
                engine.step()
            answers[eager] = [engine.result(o).token_ids for o in outs]
    assert answers[False] == answers[True]


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python (the gpu extra)")
def test_an_engine_with_cuda_graphs_gives_its_device_memory_back_at_shutdown():
    """A KV pool can take most of the free memory: on an H200 the next engine ran out of memory while the
    last one's graphs held its runner in a cycle, and a process started after an engine's shutdown (an
    encoder rank, a user's script) did while torch kept the freed blocks for the process that freed them.
    Here its pool takes 4 GiB; what stays is loaded once a process (kernel code, library workspaces: 620
    MiB on an H200)."""
    path = create_tiny_model(tempfile.mkdtemp(), arch="dense", size="small", dtype="bfloat16")

    def free_after_an_engine() -> int:
        engine = Engine(path, device="cuda", vit_dp=0, max_total_tokens=1 << 20)
        assert engine.scheduler.runner.cuda_graphs is not None
        engine.generate("Count to three:", max_tokens=4, ignore_eos=True)
        engine.shutdown()
        return torch.cuda.mem_get_info()[0]

    free_before, _ = torch.cuda.mem_get_info()
    first, second = free_after_an_engine(), free_after_an_engine()
    assert free_before - first < 2**30
    assert abs(first - second) < 256 * 2**20


@pytest.mark.gpu
def test_a_small_models_kv_pool_on_a_gpu_holds_the_running_requests_whole_contexts_and_no_more():
    """It took 85% of the free memory whatever the model: in one process on an H200, a second engine's
    encoder rank, started after its pool, found no memory left."""
    path = create_tiny_model(tempfile.mkdtemp(), arch="dense", size="small", dtype="bfloat16")
    with Engine(path, device="cuda", max_running_requests=4) as first, Engine(path, device="cuda") as second:
        assert first.scheduler.runner.max_total_tokens == 4 * first.model_config.text.max_position_embeddings
        assert second.chat(
            [{"role": "user", "content": [{"type": "image", "image": make_image(64, 64)}]}], max_tokens=2
        ).finish_reason in ("length", "stop")


@pytest.mark.gpu
def test_the_moe_block_on_cuda_gives_the_same_output_every_time():
    """Each token's experts' rows are summed in a fixed order (atomic adds changed the rounding from run to
    run, and the greedy tokens of a random bfloat16 MoE with them)."""
    moe = SparseMoeBlock(256, 64, 128, 8).cuda()
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for weight in (moe.gate.weight, moe.w13, moe.w2):
            weight.copy_(torch.randn(weight.shape, generator=generator, device="cuda") * 0.1)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(512, 256, generator=generator, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        first = moe(x)
        assert all(torch.equal(moe(x), first) for _ in range(5))


@pytest.mark.gpu
@pytest.mark.parametrize("frames", [1, 2])
def test_pixel_values_made_on_cuda_equal_the_hosts_bit_for_bit(frames):
    """A picture's bytes become the tower's values on its device: by the affine passes or the table, the same
    float32 values as on the host (which equal transformers')."""
    affine = image_normalizer(1 / 255, (0.5,) * 3, (0.5,) * 3)
    table_only = PixelNormalizer(torch.from_numpy(affine.table), [])
    data = torch.randint(0, 256, (64, 3, frames, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for normalizer in (affine, table_only):
        pixels = PatchPixels(data, 2, normalizer)
        assert torch.equal(pixels.values("cuda").cpu(), pixels.values("cpu"))
