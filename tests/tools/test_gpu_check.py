"""The GPU kit's CPU half (`python -m vlm_serve.tools.gpu_check OUT --device cpu`): every part it runs
on CPU passes, and it leaves its records and figures where a lent GPU's run would."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_process

pytestmark = pytest.mark.server  # every test here runs the kit as a command


def test_the_kit_passes_its_cpu_half_and_records_every_part(tmp_path):
    result = run_process(
        [sys.executable, "-m", "vlm_serve.tools.gpu_check", str(tmp_path), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[suite] skipped: on CPU the test suite itself runs these files" in result.stdout
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("device: cpu;") and " 0 failed" in summary
    parity = json.loads((tmp_path / "parity.json").read_text())
    names = [r["name"] for r in parity]
    assert "moe tiny cpu float32 vs transformers" in names and "dense tiny torch bfloat16 vs transformers" in names
    assert any(n.startswith("built-in model torch bfloat16") for n in names)
    assert [r["name"] for r in json.loads((tmp_path / "server.json").read_text())] == [
        "server starts (built-in model, --vit-dp 1)",
        "answers",
        "streaming",
    ]
    figures = json.loads((tmp_path / "figures.json").read_text())
    dense = figures["dense tiny"]
    assert set(dense) == {
        "prompt_tokens",
        "generated_tokens",
        "decode_batch_1",
        "decode_batch_4",
        "ttft_ms_1024px_picture",
        "preprocess_ms_by_stage",
    }
    # a step reads the same weights at batch 4, and more KV: less time per token, more bytes per step
    assert dense["decode_batch_4"]["mb_per_step"] >= dense["decode_batch_1"]["mb_per_step"] > 0
    ttft = dense["ttft_ms_1024px_picture"]
    assert ttft["tower"] > 0 and abs(ttft["engine"] - ttft["tower"] - ttft["prefill_and_rest"]) < 0.11  # (rounded)
    # a JPEG's bytes are decoded, hashed and patchified; each stage's time is within the preprocessing's (the
    # hash of 3 MB can round to 0.0 ms)
    stages = dense["preprocess_ms_by_stage"]
    assert stages["decode"] > 0 and stages["preprocess"] > 0 and stages["hash"] >= 0
    assert sum(stages.values()) <= ttft["preprocess"] + 0.15
    for name in ("dense tiny ITL, encoder pool", "dense tiny ITL, inline"):
        assert figures[name]["itl_p99_ms"] >= figures[name]["itl_p50_ms"] > 0
    assert "aten::" in (tmp_path / "profile-cpu.txt").read_text()


def test_the_kit_refuses_an_unknown_part(tmp_path):
    result = run_process(
        [sys.executable, "-m", "vlm_serve.tools.gpu_check", str(tmp_path), "--parts", "speed"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "unknown part(s) speed" in result.stderr


def test_the_kit_refuses_a_suite_file_it_does_not_have(tmp_path):
    """A misspelt name would otherwise leave that file unrun on a lent GPU, unsaid."""
    command = [
        sys.executable,
        "-m",
        "vlm_serve.tools.gpu_check",
        str(tmp_path),
        "--parts",
        "suite",
        "--suite-files",
        "test_engine,test_engin",
    ]
    result = run_process(command, capture_output=True, text=True)
    assert result.returncode == 2 and "--suite-files: not in the suite: test_engin;" in result.stderr
