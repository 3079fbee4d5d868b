"""The `server` part: `vlm-serve serve` with the built-in model and one encoder rank answers pictures, a clip,
a repeated picture and a stream as the in-process engine does on the CPU."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import torch

from vlm_serve.server.ports import free_port
from vlm_serve.tools.gpu_check.check import Check


def run_server(check: Check, device: torch.device) -> None:
    import httpx

    from vlm_serve.builtin.scenes import motion_example, random_example, random_motion
    from vlm_serve.engine import Engine
    from vlm_serve.tools.builtin_train import chat_content, messages

    rng = random.Random(7)
    examples = [random_example(rng) for _ in range(6)] + [motion_example(rng, random_motion(rng))]
    examples.append(examples[0])  # a repeated picture: the second asking is served from the caches
    with Engine(None, device="cpu", dtype="float32", vit_dp=0) as engine:
        expected = [engine.chat(messages(e), max_tokens=48, temperature=0).text for e in examples]
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vlm_serve.cli",
        "serve",
        "--port",
        str(port),
        "--vit-dp",
        "1",
        "--device",
        device.type,
    ]
    log = open(check.out / "server.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def start() -> str:
            began = time.monotonic()
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited during start-up (status {process.returncode})")
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        return f"ready in {time.monotonic() - began:.0f} s"
                except httpx.HTTPError:
                    pass
                if time.monotonic() - began > 300:
                    raise RuntimeError("the server was not ready after 300 s")
                time.sleep(0.5)

        check.run("server starts (built-in model, --vit-dp 1)", start)
        if process.poll() is not None:
            return
        bodies = [
            {"messages": [{"role": "user", "content": chat_content(e)}], "temperature": 0, "max_tokens": 48}
            for e in examples
        ]

        def answers() -> str:
            got = [
                httpx.post(url + "/v1/chat/completions", json=b, timeout=120).json()["choices"][0]["message"]["content"]
                for b in bodies
            ]
            wrong = [(e.kind, a, b) for e, a, b in zip(examples, got, expected) if a != b]
            if wrong:
                raise AssertionError(f"{len(wrong)} answers differ from the engine's on CPU, e.g. {wrong[0]}")
            return f"{len(got)} answers (pictures, a clip, a repeated picture) equal the engine's on CPU"

        def streamed() -> str:
            text = ""
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json=bodies[1] | {"stream": True}, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"]
                        text += "".join(c["delta"].get("content") or "" for c in delta)
            if text != expected[1]:
                raise AssertionError(f"streamed {text!r}, the engine answered {expected[1]!r}")
            return "the streamed answer equals the engine's"

        check.run("answers", answers)
        check.run("streaming", streamed)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
