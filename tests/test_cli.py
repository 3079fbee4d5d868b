"""The `vlm-serve` command: creating a tiny model, answering a prompt offline, and its settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vlm_serve.cli import build_parser, parse_args, server_args_of
from vlm_serve.testing.media import make_image


def _vlm_serve(*args: str, env_cache=None) -> subprocess.CompletedProcess:
    env = None if env_cache is None else {**os.environ, "VLM_SERVE_CACHE": str(env_cache)}
    return subprocess.run(
        [sys.executable, "-m", "vlm_serve.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_create_tiny_model_writes_a_hugging_face_checkpoint(tmp_path):
    out = tmp_path / "dense"
    result = _vlm_serve("create-tiny-model", str(out), "--arch", "dense", "--seed", "3")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "preprocessor_config.json"):
        assert (out / name).is_file()


def test_generate_answers_about_an_image_with_the_default_model(tmp_path):
    image = tmp_path / "picture.png"
    make_image(120, 80, seed=7).save(image)
    args = ("generate", "--image", str(image), "--prompt", "What is this?", "--max-tokens", "6", "--temperature", "0")
    first = _vlm_serve(*args, env_cache=tmp_path / "cache")
    assert first.returncode == 0, first.stderr
    assert "prompt tokens" in first.stderr and "generated" in first.stderr
    second = _vlm_serve(*args, env_cache=tmp_path / "cache")  # reuses the cached default model
    assert second.stdout == first.stdout


def test_generate_reports_a_missing_image_clearly(tmp_path):
    result = _vlm_serve("generate", "--image", str(tmp_path / "nope.png"), "--prompt", "hi",
                        env_cache=tmp_path / "cache")
    assert result.returncode == 2
    assert "nope.png" in result.stderr and "Traceback" not in result.stderr


def test_settings_come_from_the_config_file_and_command_line_flags_win(tmp_path):
    config = tmp_path / "deploy.yaml"
    config.write_text("max-running-requests: 8\nport: 31000\nallowed_media_domains: [example.com, .cdn.org]\n")
    ns = parse_args(build_parser(), ["serve", "--config", str(config), "--port", "32000"])
    args = server_args_of(ns)
    assert (args.max_running_requests, args.port, args.host) == (8, 32000, "127.0.0.1")
    assert args.allowed_media_domains == ["example.com", ".cdn.org"]
    flags = server_args_of(parse_args(build_parser(), ["serve", "--allowed-media-domains", "a.com", "b.com"]))
    assert flags.allowed_media_domains == ["a.com", "b.com"]


def test_every_shipped_config_file_is_valid():
    configs = sorted((Path(__file__).parent.parent / "configs").rglob("*.yaml"))
    assert configs
    for config in configs:
        # as launched: a multi-node file gets each node's address of node 0 on the command line
        args = server_args_of(parse_args(build_parser(), ["serve", "--config", str(config), "--dist-init-addr", "10.0.0.1:5000"]))
        assert args.tp_size % args.nnodes == 0


def test_prefill_chunks_default_to_2048_tokens_on_cpu_and_8192_on_gpu():
    def chunk(*flags: str) -> int | None:
        return server_args_of(parse_args(build_parser(), ["serve", *flags])).resolved_chunked_prefill_size()

    assert chunk("--device", "cpu") == 2048
    assert chunk("--device", "cuda") == 8192
    assert chunk("--device", "cpu", "--chunked-prefill-size", "512") == 512
    assert chunk("--chunked-prefill-size", "-1") is None
