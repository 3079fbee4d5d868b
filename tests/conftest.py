"""Session-wide tiny Qwen3-VL checkpoints, tokenizers and a server shared by the test files."""

from __future__ import annotations

from pathlib import Path

import pytest
from cpu_targets import LIBRARIES, require_kernels, targets
from helpers import ServerProcess, openai_client, running_server

from vlm_serve.llm.kernels import Target
from vlm_serve.testing.tiny_model import create_tiny_model
from vlm_serve.tokenizer import Tokenizer


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
def tiny_bf16_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoints in bfloat16, as the published ones are stored, by arch ("moe", "dense")."""
    return {
        arch: create_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-bf16"), arch=arch, seed=0, dtype="bfloat16")
        for arch in ("moe", "dense")
    }


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
