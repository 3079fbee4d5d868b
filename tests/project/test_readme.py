"""The README's examples run as written.

Its code blocks run in the order they come, in one fresh folder, as a reader who follows the README from
the top would run them (the built-in model's example makes `circle.png` and `clip.mp4`, which the later
ones use): python blocks with python, bash blocks with bash (stopping at the first failing command). A
real `vlm-serve serve` of the built-in model with the default settings answers them, as in the README; it
listens on a free port rather than the README's 30000, which may be taken on a test machine, so each
block's `http://127.0.0.1:30000` is rewritten to the test server's address.

What a block promises is checked: a `vlm-serve generate ...  # ANSWER` line prints ANSWER, and a ```text
block right after a block is what that block prints. Blocks that cannot run on a test machine are skipped
by a rule in `SKIPPED`, which gives the reason; a rule that skips no block fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (
    COLLECTED,
    README,
    README_URL,
    Block,
    ServerProcess,
    block_command,
    readme_blocks,
    run_process,
    running_server,
)
from vlm_serve.builtin import BUILTIN_MODEL

# (language, text in the block) -> why a block holding it is not run here
SKIPPED = {
    ("bash", "pip install"): "installs packages (the set-up)",
    ("bash", "vlm-serve serve --model Qwen/Qwen3-VL-8B-Instruct"): (
        "serves until stopped, from a Hugging Face download, a /models folder and an 8-GPU config"
    ),
    ("bash", "sglang_router.launch_router"): (
        "servers and a router that serve until stopped, on fixed ports (tests/deployments/test_router.py starts such a "
        "set-up, tests/disaggregation/test_pd_serving.py runs the PD one on free ports)"
    ),
}
_GENERATE_ANSWER = re.compile(r"^vlm-serve generate .*  # (.+)$", re.MULTILINE)


def skip_reason(block: Block) -> str | None:
    return next((why for (lang, text), why in SKIPPED.items() if lang == block.language and text in block.code), None)


BLOCKS = readme_blocks()


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with running_server(BUILTIN_MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reader's folder, shared by the blocks in order."""
    return tmp_path_factory.mktemp("readme")


def run_block(block: Block, folder: Path, server: ServerProcess) -> subprocess.CompletedProcess:
    """Runs `block` in `folder` against `server`."""
    command, env = block_command(block, {README_URL: server.url})
    return run_process(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_the_readme_has_python_and_bash_blocks_only_and_every_skip_rule_is_used():
    assert {b.language for b in BLOCKS} == {"python", "bash"}
    for (language, text), why in SKIPPED.items():
        assert any(b.language == language and text in b.code for b in BLOCKS), f"no block to skip for: {why}"


@pytest.mark.server
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_a_readme_block_runs_as_written_and_prints_what_it_says(block, folder, server):
    if reason := skip_reason(block):
        pytest.skip(reason)
    result = run_block(block, folder, server)
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"error":' not in result.stdout, result.stdout  # curl exits 0 on an HTTP error
    printed = result.stdout.splitlines()
    for answer in _GENERATE_ANSWER.findall(block.code):
        assert answer in printed
    if block.output is not None:
        assert result.stdout == block.output


def test_ci_runs_exactly_the_readmes_test_command():
    (command,) = [b.code.strip() for b in BLOCKS if "python -m pytest" in b.code]
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == command


def suite_size(config: pytest.Config) -> int:
    """How many tests the suite has: as this session collected them where it collected the whole suite (no
    paths given), else as a fresh collection counts them."""
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        return config.stash[COLLECTED]
    collected = run_process(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    count = re.search(r"^(\d+) tests collected", collected.stdout, re.M)
    assert count, collected.stdout[-2000:] + collected.stderr[-2000:]
    return int(count.group(1))


@pytest.mark.server  # (run on part of the suite, it collects the whole in a pytest process of its own)
def test_the_test_count_the_readme_states_is_the_suites(request):
    stated = re.search(r"\(([\d,]+) tests,\s+\d+\s+of\s+which\s+skip", README.read_text())
    assert stated, "the README no longer states the suite's test count"
    assert int(stated.group(1).replace(",", "")) == suite_size(request.config), "update the README's test count"
