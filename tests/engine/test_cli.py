"""The `vlm-serve` command: creating a tiny model, answering a prompt offline, and its settings."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import descendants, process_name, run_process, start_process
from vlm_serve.builtin.scenes import Scene, Shape, render
from vlm_serve.cli import build_parser, main, parse_args, server_args_from, server_args_of
from vlm_serve.config import SETTING_GROUPS, ServerArgs, setting_docs
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image


def _vlm_serve(*args: str) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "-m", "vlm_serve.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.server
def test_create_tiny_model_writes_a_hugging_face_checkpoint(tmp_path):
    out = tmp_path / "dense"
    result = _vlm_serve("create-tiny-model", str(out), "--arch", "dense", "--seed", "3")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    for name in (
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "preprocessor_config.json",
    ):
        assert (out / name).is_file()


@pytest.mark.server
def test_generate_answers_about_an_image_with_the_built_in_model(tmp_path):
    image = tmp_path / "picture.png"
    render(Scene([Shape("star", "blue", "large", 0, 2)], background_seed=4)).save(image)
    result = _vlm_serve("generate", "--image", str(image), "--prompt", "Describe the picture.", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "A large blue star at the top right.\n"
    assert "prompt tokens" in result.stderr and "generated" in result.stderr


@pytest.mark.server
def test_generate_reports_a_missing_image_clearly(tmp_path):
    result = _vlm_serve("generate", "--image", str(tmp_path / "nope.png"), "--prompt", "hi")
    assert result.returncode == 2
    assert "nope.png" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.server
@pytest.mark.slow
def test_ctrl_c_stops_generate_silently(tmp_path, tiny_moe_dir):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) once the encoder rank runs (one, as on a
    GPU by default), while the model loads or answers: exit code 130, and not a line from it or its encoder rank."""
    image = tmp_path / "picture.png"
    make_image(64, 64).save(image)
    command = [
        sys.executable,
        "-m",
        "vlm_serve.cli",
        "generate",
        "--model",
        str(tiny_moe_dir),
        "--image",
        str(image),
        "--prompt",
        "Describe.",
        "--max-tokens",
        "4000",
        "--vit-dp",
        "1",
    ]
    process = start_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not any(process_name(pid) == "vlm-encoder-0" for pid in descendants(process.pid)):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    assert process.communicate(timeout=60) == ("", "")
    assert process.returncode == 130


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
    configs = sorted((Path(__file__).parents[2] / "configs").rglob("*.yaml"))
    assert configs
    for config in configs:
        # as launched: a multi-node file gets each node's address of node 0 on the command line
        args = server_args_of(
            parse_args(build_parser(), ["serve", "--config", str(config), "--dist-init-addr", "10.0.0.1:5000"])
        )
        assert args.tp_size % args.nnodes == 0


def test_prefill_chunks_default_to_2048_tokens_on_cpu_and_8192_on_gpu():
    def chunk(*flags: str) -> int | None:
        return server_args_of(parse_args(build_parser(), ["serve", *flags])).prefill_chunk

    assert chunk("--device", "cpu") == 2048
    assert chunk("--device", "cuda") == 8192
    assert chunk("--device", "cpu", "--chunked-prefill-size", "512") == 512
    assert chunk("--chunked-prefill-size", "-1") is None


@pytest.mark.server
@pytest.mark.slow
def test_a_wrong_model_is_one_line_naming_it_in_every_command(tmp_path):
    missing = str(tmp_path / "no-such-model")
    image = tmp_path / "picture.png"
    make_image(32, 32).save(image)
    for command in (
        ["serve", "--tp-size", "2"],
        ["serve"],
        ["generate", "--prompt", "hi"],
        ["caption", str(image), "--output", str(tmp_path / "c.jsonl")],
    ):
        result = _vlm_serve(*command, "--model", missing)
        assert result.returncode == 2, result.stderr
        assert result.stderr == f"vlm-serve: error: model {missing}: no such folder\n"


@pytest.mark.server
@pytest.mark.slow
def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, tiny_moe_dir):
    # weights that cannot load: had the model been loaded first, the error would be about them
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_moe_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _vlm_serve("serve", "--model", str(broken), "--port", str(port))
    assert result.returncode == 2
    assert result.stderr == f"vlm-serve: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


@pytest.mark.server
def test_serve_help_shows_every_setting_with_its_meaning_default_and_choices():
    help_text = " ".join(_vlm_serve("serve", "--help").stdout.split())  # argparse wraps lines
    docs = setting_docs()
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in help_text
        assert docs[f.name] and " ".join(docs[f.name].split()) in help_text, f.name
    assert "--port PORT port the HTTP server listens on (default: 30000)" in help_text
    assert "{auto,float32,bfloat16,float16}" in help_text and "{fcfs,lpm,dfs-weight,lof,random}" in help_text


def test_every_flag_and_argument_of_every_command_has_a_help_text():
    (commands,) = [a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands) == {"serve", "demo", "generate", "caption", "create-tiny-model"}
    for name, command in commands.items():
        for action in command._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"vlm-serve {name}: {action.dest}"


@pytest.mark.parametrize(
    "command",
    [
        ["serve"],
        ["demo"],
        ["generate", "--prompt", "hi"],
        ["caption", "x.png", "--output", "c.jsonl"],
        ["create-tiny-model", "out"],
    ],
)
def test_an_unknown_flag_is_refused_with_the_usage_of_its_command(command, capsys):
    with pytest.raises(SystemExit) as refused:
        main([*command, "--bogus", "1"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: vlm-serve {command[0]} ")
    assert err.endswith(f"vlm-serve {command[0]}: error: unrecognized arguments: --bogus 1\n")


def test_generate_caption_and_demo_take_only_the_settings_an_engine_reads(tmp_path):
    parser = build_parser()
    for command in (["generate", "--prompt", "hi"], ["caption", "x.png", "--output", "c.jsonl"], ["demo"]):
        # (the demo's --api-key, --reasoning-parser and --max-media-mb are its own: the key of the server it
        # fronts with --api-base, how it shows the engine's reasoning, and the largest upload its page takes)
        own = ("--api-key", "--reasoning-parser", "--max-media-mb") if command == ["demo"] else ()
        for flag in {"--tp-size", "--api-key", "--max-media-mb", "--reasoning-parser"} - set(own):
            with pytest.raises(SystemExit):
                parser.parse_args([*command, flag, "2"])
        assert parse_args(parser, [*command, "--vit-dp", "0", "--page-size", "4"]).page_size == 4
    assert parse_args(parser, ["demo", "--port", "8000"]).port == 8000  # the page's own port
    assert server_args_from(parse_args(parser, ["demo", "--max-media-mb", "8"]))["max_media_mb"] == 8
    config = tmp_path / "serve.yaml"
    config.write_text("tp-size: 8\nchunked-prefill-size: 512\n")
    with pytest.raises(ValueError, match="only `vlm-serve serve` takes: tp_size"):
        parse_args(parser, ["generate", "--prompt", "hi", "--config", str(config)])


def test_every_setting_is_in_one_titled_group_of_the_help_after_the_commands_own_flags():
    grouped = [name for names in SETTING_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(ServerArgs))  # each once, every one
    help_text = build_parser()._subparsers._group_actions[0].choices["caption"].format_help()
    assert help_text.index("--output") < help_text.index("model settings:") < help_text.index("--model ")
    assert "HTTP server settings:" not in help_text  # (caption takes an engine's settings only)


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"vlm-serve {importlib.metadata.version('vlm_serve')}"


@pytest.mark.server
def test_a_bad_choice_names_the_choices():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, not 'float8'"):
        ServerArgs(dtype="float8")
    result = _vlm_serve("serve", "--attention-backend", "triton")
    assert result.returncode == 2 and "invalid choice: 'triton'" in result.stderr


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"hicache_storage_backend": "file"}, "hicache_storage_backend is a tier under the host pool"),
        ({"enable_hierarchical_cache": True, "hicache_ratio": 0.5}, "hicache_ratio must be >= 1"),
        ({"enable_hierarchical_cache": True, "hicache_write_policy": "always"}, "hicache_write_policy must be one of"),
        (
            {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"},
            "it needs page_size >= 16 .64 is a good size., not 1",
        ),
        (
            {"enable_hierarchical_cache": True, "hicache_storage_backend": "s3", "page_size": 16},
            "hicache_storage_backend must be one of file, mooncake",
        ),
        ({"hicache_storage_prefetch_policy": "eager"}, "hicache_storage_prefetch_policy must be one of"),
        ({"hicache_storage_prefetch_timeout": 0}, "hicache_storage_prefetch_timeout must be > 0"),
    ],
)
def test_hierarchical_cache_settings_that_cannot_work_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**settings)


def test_a_host_pool_smaller_than_the_kv_pool_is_refused(tiny_moe_dir):
    with pytest.raises(ValueError, match="fewer than the KV pool's 8192"):
        Engine(tiny_moe_dir, max_total_tokens=8192, enable_hierarchical_cache=True, hicache_size=0.0001)


def test_lora_flags_take_vllm_and_sglang_names_and_each_form_of_an_adapter():
    """`--lora-modules` (vLLM) is `--lora-paths` (SGLang), `--max-loras-per-batch` (SGLang) is `--max-loras`;
    an adapter is NAME=FOLDER, FOLDER (named after it), or vLLM's JSON object."""
    spec = '{"name": "charts", "path": "/ckpt/charts", "base_model_name": "qwen"}'
    flags = ["serve", "--enable-lora", "--lora-modules", "docs=/ckpt/docs-v2", "/ckpt/style", spec]
    args = server_args_of(parse_args(build_parser(), [*flags, "--max-loras-per-batch", "3"]))
    assert args.max_loras == 3
    assert args.lora_adapters() == {"docs": "/ckpt/docs-v2", "style": "/ckpt/style", "charts": "/ckpt/charts"}


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"lora_paths": ["a=/x"]}, "lora_paths needs enable_lora"),
        ({"enable_lora": True, "lora_paths": ["a=/x", "a=/y"]}, "lora_paths names two adapters 'a'"),
        ({"enable_lora": True, "lora_paths": ['{"name": "a"}']}, "not a JSON object with name and path"),
        ({"enable_lora": True, "lora_paths": ["a=/x", "b=/y"], "max_loras": 1}, "do not fit in max_loras 1"),
    ],
)
def test_lora_settings_that_cannot_work_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**settings)
