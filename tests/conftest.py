"""Session-wide tiny Qwen3-VL checkpoints, tokenizers and a server shared by the test files; and the rules
that a test not marked `server` starts no process, a test leaves no process running and a test file leaves
torch's thread count as it found it."""

from __future__ import annotations

import gc
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpu_targets import DRIVERS, LIBRARIES, require_kernels, targets
from helpers import (
    COLLECTED,
    STARTED,
    ServerProcess,
    descendants,
    openai_client,
    run_process,
    running_server,
    stop_processes,
    stop_started,
)
from vlm_serve.llm import kernels
from vlm_serve.llm.kernels import Target
from vlm_serve.testing.eagle3_draft import create_eagle3_draft
from vlm_serve.testing.quantized import Recipe, quantize_checkpoints
from vlm_serve.testing.tiny_model import create_tiny_model
from vlm_serve.tokenizer import Tokenizer


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Counts the tests collected (`COLLECTED`, before `-m` and `-k` deselect any); `gpu` tests are skipped,
    saying why, where torch sees no CUDA device."""
    config.stash[COLLECTED] = len(items)
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (the GPU kit runs it on a lent GPU)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


class InProcessRule:
    """A test not marked `server` runs inside pytest's process: it and its fixtures start no process (a
    server, a rank, an encoder pool, a command, a script, a compiler, an emulator), which keeps
    `-m "not server"` the quick loop. Every process start is watched (`subprocess.Popen`, which
    `subprocess.run` and asyncio's subprocesses use, and `multiprocessing`'s); the one exception is the
    CPU kernels' first build, which any engine may need on a machine that has not built them yet. Held
    where torch sees no CUDA device: on one, an engine starts an encoder process by default (`vit_dp` 1)."""

    checking = False
    started: list[str] = []

    @classmethod
    def install(cls) -> None:
        popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

        def watched_popen(popen: subprocess.Popen, args, *more, **options) -> None:
            cls.saw(f"the command {args if isinstance(args, str) else ' '.join(map(str, args))!r}"[:200])
            popen_init(popen, args, *more, **options)

        def watched_start(process: multiprocessing.process.BaseProcess) -> None:
            cls.saw(f"the {type(process).__name__} {process.name!r}")
            process_start(process)

        subprocess.Popen.__init__ = watched_popen
        multiprocessing.process.BaseProcess.start = watched_start

    @classmethod
    def saw(cls, what: str) -> None:
        if cls.checking and not cls.building_kernels():
            cls.started.append(what)

    @staticmethod
    def building_kernels() -> bool:
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__") != kernels.__name__:
            frame = frame.f_back
        return frame is not None


def pytest_configure(config: pytest.Config) -> None:
    import torch

    if not torch.cuda.is_available():
        InProcessRule.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    InProcessRule.started.clear()
    InProcessRule.checking = item.get_closest_marker("server") is None
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """What a test started (`helpers.start_process`) and left running, after a failed assertion say, is
    stopped as the test ends, with every process below it; a test that passed fails for it. (What its
    fixtures started is theirs to stop.) A test not marked `server` that started a process fails."""
    STARTED.clear()  # (what its fixtures started)
    try:
        result = yield
    except BaseException:
        stop_started()
        raise
    finally:
        InProcessRule.checking = False
    if left := stop_started():
        pytest.fail("the test left running: " + "; ".join(left), pytrace=False)
    if InProcessRule.started:
        started = "; ".join(dict.fromkeys(InProcessRule.started))
        pytest.fail(f"the test started {started} but is not marked `server` (pyproject.toml's markers)", pytrace=False)
    return result


@pytest.fixture(scope="module", autouse=True)
def torch_threads_kept() -> Iterator[None]:
    """A test file leaves torch's thread count as it found it: an Engine beside an encoder pool runs on
    fewer threads until it is shut down, and one left running would put every later test on fewer cores
    (and skip those that share them)."""
    import torch

    threads = torch.get_num_threads()
    yield
    if (found := torch.get_num_threads()) != threads:
        torch.set_num_threads(threads)
        pytest.fail(f"the test file left torch with {found} threads, not {threads} (an Engine not shut down?)")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Once every test and fixture has ended, no process the tests started runs on: one that does is an
    error of the session, named, and is stopped. An object dropped without being closed (an Engine that
    a fixture returned) stops its processes once collected, so that comes first; the processes that end
    with pytest are left alone: multiprocessing's fork server and resource tracker (the pipes they read
    close) and the aarch64 kernels' drivers (`cpu_targets.DRIVERS`: their stdin closes)."""
    gc.collect()
    ending_with_pytest = {
        multiprocessing.forkserver._forkserver._forkserver_pid,
        multiprocessing.resource_tracker._resource_tracker._pid,
        *(driver.pid for driver in DRIVERS),
    }
    if left := stop_processes([pid for pid in descendants(os.getpid()) if pid not in ending_with_pytest]):
        message = "\n".join(["processes left running by the tests (now stopped):", *left])
        name = "processes left running"
        report = pytest.TestReport(name, ("", None, name), {}, "failed", message, "teardown")
        session.config.hook.pytest_runtest_logreport(report=report)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def built_kernels() -> None:
    """The CPU kernels are built (or found unavailable) before any test runs, so that no test's output
    depends on being the first to load them (the first load says it builds them)."""
    for library in LIBRARIES:
        library.get()


@pytest.fixture(params=targets())
def kernel_target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Target:
    """Runs the test once per ISA the CPU kernels are tested for (cpu_targets.py), with the kernels built
    for it; a kernel that does not build fails the test."""
    monkeypatch.setattr(Target, "from_env", lambda: request.param)
    require_kernels(request.param)
    return request.param


@pytest.fixture
def native_kernels() -> None:
    """The CPU kernels built for this machine; a kernel that does not build fails the test."""
    require_kernels(Target.from_env())


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MoE checkpoint (seed 0, fp32, untied)."""
    return create_tiny_model(tmp_path_factory.mktemp("tiny-moe"), arch="moe", seed=0)


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense checkpoint (seed 0, fp32, untied)."""
    return create_tiny_model(tmp_path_factory.mktemp("tiny-dense"), arch="dense", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL checkpoint (seed 0, fp32, untied)."""
    return create_tiny_model(tmp_path_factory.mktemp("tiny-qwen2.5"), arch="qwen2.5", seed=0)


@pytest.fixture(scope="session")
def eagle3_drafts(
    tmp_path_factory: pytest.TempPathFactory, tiny_moe_dir: Path, tiny_dense_dir: Path
) -> dict[str, Path]:
    """Random EAGLE-3 draft heads for the tiny checkpoints, by arch ("moe", "dense"): half their vocabulary."""
    return {
        arch: create_eagle3_draft(tmp_path_factory.mktemp(f"eagle3-{arch}"), target, seed=1, draft_vocab_size=1024)
        for arch, target in (("moe", tiny_moe_dir), ("dense", tiny_dense_dir))
    }


@pytest.fixture(scope="session")
def tiny_bf16_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoints in bfloat16, as the published ones are stored, by arch ("moe", "dense")."""
    return {
        arch: create_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-bf16"), arch=arch, seed=0, dtype="bfloat16")
        for arch in ("moe", "dense")
    }


@pytest.fixture(scope="session")
def tiny_fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoints in Qwen's block-wise FP8 layout (from the bfloat16 ones), by arch."""
    return {
        arch: create_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-fp8"), arch=arch, seed=0, quantize="fp8")
        for arch in ("moe", "dense")
    }


@pytest.fixture(scope="session")
def tiny_fp16_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoints in float16, by arch ("moe", "dense"): what the integer ones are quantized from."""
    return {
        arch: create_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-fp16"), arch=arch, seed=0, dtype="float16")
        for arch in ("moe", "dense")
    }


# The integer-quantized test checkpoints: llm-compressor's round-to-nearest schemes over the float16 ones (whose
# scales are then float16, as published). The MoE's experts (intermediate 48) take groups of 16.
INT_RECIPES = {
    "dense-w4a16": Recipe(4, 32, True),
    "dense-w4a16-asym": Recipe(4, 32, False),
    "dense-w8a16": Recipe(8, None, True),
    "dense-w8a16-asym": Recipe(8, 32, False),
    "dense-w8a8": Recipe(8, None, True, int8_activations=True),
    "moe-w4a16": Recipe(4, 16, True),
    "moe-w4a16-asym": Recipe(4, 16, False),
    "moe-w8a16": Recipe(8, None, True),
    "moe-w8a8": Recipe(8, None, True, int8_activations=True),
}


@pytest.fixture(scope="session")
def int_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_fp16_dirs: dict[str, Path]) -> dict[str, Path]:
    """Every checkpoint of INT_RECIPES, made at once by llm-compressor (a process of its own: its tests are
    marked `server`)."""
    root = tmp_path_factory.mktemp("int-checkpoints")
    jobs = [(tiny_fp16_dirs[name.split("-")[0]], root / name, recipe) for name, recipe in INT_RECIPES.items()]
    return dict(zip(INT_RECIPES, quantize_checkpoints(jobs, run=run_process)))


@pytest.fixture(scope="session")
def ours(tiny_moe_dir: Path) -> Tokenizer:
    """Our runtime tokenizer of the tiny MoE checkpoint."""
    return Tokenizer.from_pretrained(tiny_moe_dir)


@pytest.fixture(scope="session")
def theirs(tiny_moe_dir: Path):
    """transformers' tokenizer of the same checkpoint: the oracle."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_moe_dir)


@pytest.fixture(scope="session")
def server(tiny_moe_dir: Path) -> ServerProcess:
    """A real `vlm-serve serve` of the tiny MoE checkpoint with the default flags, shared by every test
    module that does not define its own `server`: its tests leave it serving as they found it (they
    may flush its caches)."""
    with running_server(tiny_moe_dir) as srv:
        yield srv


# For test modules using a `server` (a real `vlm-serve serve` without an API key), theirs or the one above:


@pytest.fixture(scope="module")
def client(server):
    """The official openai client for the module's server."""
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The served model's name."""
    return client.models.list().data[0].id


@pytest.fixture
def transformers_reads_fp8_experts() -> Iterator[None]:
    """transformers 5 reads FP8 MoE checkpoints with experts one per expert (Qwen3-MoE's, Qwen3.5-MoE's)
    through its `qwen2_moe` converters, but for `qwen3_vl_moe` it has only the converters of the bf16
    release's fused experts (huggingface/transformers#44230: dense Qwen3-VL FP8 loads, the MoE does not).
    For the duration of a test, register for `qwen3_vl_moe` what transformers registers for
    `qwen3_5_moe_text`: its own converters plus the per-expert ones; its FP8 dequantization is unchanged."""
    from transformers import conversion_mapping

    own = conversion_mapping.get_checkpoint_conversion_mapping("qwen3_vl_moe")
    if any("mlp.experts.*.gate_proj.weight" in c.source_patterns for c in own):  # transformers has it already
        yield
        return
    per_expert = conversion_mapping.get_checkpoint_conversion_mapping("qwen2_moe")
    conversion_mapping.register_checkpoint_conversion_mapping("qwen3_vl_moe", own + per_expert, overwrite=True)
    try:
        yield
    finally:
        conversion_mapping.register_checkpoint_conversion_mapping("qwen3_vl_moe", own, overwrite=True)
        conversion_mapping.USER_REGISTERED_MAPPINGS.discard("qwen3_vl_moe")
