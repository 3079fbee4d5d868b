"""Test helpers shared by several test files."""

from __future__ import annotations

import base64
import contextlib
import ctypes
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import torch
from PIL import Image, ImageDraw

from vlm_serve.multimodal.video import write_video
from vlm_serve.server.ports import free_port
from vlm_serve.testing.deployments import router_command
from vlm_serve.tokenizer import Tokenizer

# ---- every process a test starts ---------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children, grandchildren, ...), whichever thread started each."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # (the thread has ended)
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def process_name(pid: int) -> str:
    """The name a process gave itself (`vlm-scheduler-0`, `vlm-encoder-1`, `vlm-detokenizer`...)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def survivors(pids: list[int], timeout: float = 15) -> list[str]:
    """The names and states of those of `pids` still running after `timeout` seconds."""
    return [f"{pid} {process_name(pid)} ({state(pid)})" for pid in still_running(pids, timeout)]


def still_running(pids: list[int], timeout: float = 0) -> list[int]:
    """Those of `pids` still running after `timeout` seconds (at once, as soon as none is)."""
    deadline = time.monotonic() + timeout
    while True:
        running = [pid for pid in pids if "Z" not in state(pid)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def command_line(pid: int) -> str:
    """A process's name and command line, for a message."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        words = []
    return f"{process_name(pid)}: {' '.join(words).strip()[:200]}"


def state(pid: int) -> str:
    """A process's state letter (R, S, D...), "Z" for a zombie or a process that has gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (OSError, IndexError):
        return "Z"


STARTED: list[subprocess.Popen] = []  # what `start_process` started since conftest.py's hook last stopped them


def as_test_child() -> None:
    """Runs in every process a test starts, before exec. Ctrl-C gets its default handling back: a suite
    started with SIGINT ignored (`nohup ... &`, a background job of a script) would pass that on through
    exec, and a Python child would not even install its KeyboardInterrupt handler. And the process gets
    SIGTERM when the test process dies (the thread that started it, in fact: tests start processes from
    their own thread): a killed pytest must not leave servers behind."""
    PR_SET_PDEATHSIG = 1
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_process(command: list[str], **options) -> subprocess.Popen:
    """`subprocess.Popen` for a test: `as_test_child` runs in the process, and one still running when the
    test ends (an assertion failed first, say) is stopped then, with everything below it (conftest.py)."""
    process = subprocess.Popen(command, preexec_fn=as_test_child, **options)
    STARTED.append(process)
    return process


def run_process(command: list[str], **options) -> subprocess.CompletedProcess:
    """`subprocess.run` for a test: `as_test_child` runs in the process."""
    return subprocess.run(command, preexec_fn=as_test_child, **options)


def run_triton_script(script: str, on_gpu: str = "", on_cpu: str = "") -> None:
    """Runs a Triton kernel's check `script` in a process of its own (Triton reads TRITON_INTERPRET when a
    kernel is defined): its tensors on the GPU where there is one, else on CPU under Triton's interpreter
    (which checks the arithmetic and masks, not the speed), with `on_gpu` or `on_cpu` run first. It passes
    when the script prints ok."""
    if torch.cuda.is_available():
        env, prefix = dict(os.environ), "import torch\ntorch.set_default_device('cuda')\n" + on_gpu
    else:
        env, prefix = {**os.environ, "TRITON_INTERPRET": "1"}, on_cpu
    done = run_process([sys.executable, "-c", prefix + script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def stop_processes(pids: list[int], timeout: float = 30) -> list[str]:
    """Stops those of `pids` still running: SIGTERM (on which a server's children end cleanly), then
    SIGKILL to any still there `timeout` seconds later. Returns the ones that were running, named."""

    def send(sig: signal.Signals, targets: list[int]) -> None:
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    running = still_running(pids)
    named = [f"{pid} {command_line(pid)}" for pid in running]
    send(signal.SIGTERM, running)
    send(signal.SIGKILL, still_running(running, timeout))
    return named


def stop_tree(process: subprocess.Popen, timeout: float = 30) -> list[str]:
    """`stop_processes` for `process`, if it still runs, and every process below it; it is waited for."""
    if process.poll() is not None:
        return []
    named = stop_processes([process.pid, *descendants(process.pid)], timeout)
    process.wait()
    return named


def stop_started() -> list[str]:
    """Stops what `start_process` started since the last call (with every process below each), and
    names those that were still running."""
    named = [name for process in STARTED for name in stop_tree(process)]
    STARTED.clear()
    return named


# ---- a real `vlm-serve serve` subprocess ------------------------------------------------------------


@dataclass
class ServerProcess:
    """A server started by `start_server`: its process (leading a process group of its own), base URL
    and output lines (stdout and stderr), read by `reader`."""

    process: subprocess.Popen
    url: str
    output: list[str]
    reader: threading.Thread
    after_stop: list[str] = field(default_factory=list)  # the output lines that followed `stop`'s signal

    def stop(self, sig: signal.Signals = signal.SIGTERM, group: bool = False, timeout: float = 30) -> int:
        """Sends `sig` to the server, or with `group` to its whole process group (as a terminal sends
        Ctrl-C, or a service manager SIGTERM), and returns its exit code once every process that shares
        its output has closed it (multiprocessing's resource tracker prints after the server's exit).
        A server still running `timeout` seconds later is stopped with its children (`stop_tree`), and
        subprocess.TimeoutExpired raised."""
        said = len(self.output)
        if self.process.poll() is None:
            if group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_tree(self.process)
            raise
        self.reader.join(timeout)
        self.after_stop = self.output[said:]
        return code


class ReplayDrafts:
    """Drafts read off answers known in advance (the answers without drafts, run longer): the next
    tokens of the one that the request's tokens so far begin, with the second token of every third
    proposal changed; so verification keeps all of some drafts, part of others, and none of some."""

    def __init__(self, sequences: list[list[int]], num_draft_tokens: int = 8) -> None:
        self.sequences, self.k = sequences, num_draft_tokens
        self.proposals = 0

    def propose(self, token_ids: list[int]) -> list[int]:
        n = len(token_ids)
        following = next((seq[n : n + self.k] for seq in self.sequences if seq[:n] == list(token_ids)), [])
        self.proposals += 1
        if self.proposals % 3 == 0 and len(following) > 1:
            following[1] = int(following[1] == 0)  # (another token)
        return following


def spawn_serve(
    model_dir: Path, *flags: str, port: int | None = None, env: dict[str, str] | None = None
) -> ServerProcess:
    """Starts `vlm-serve serve` (on a free loopback port unless given; in `env` if given) and returns at
    once; its output lines collect in `.output`."""
    port = port or free_port()
    command = [sys.executable, "-m", "vlm_serve.cli", "serve", "--model", str(model_dir), "--port", str(port), *flags]
    process = start_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    output: list[str] = []

    def read() -> None:
        for line in process.stdout:
            output.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return ServerProcess(process, f"http://127.0.0.1:{port}", output, reader)


def start_server(
    model_dir: Path, *flags: str, timeout: float = 180, env: dict[str, str] | None = None
) -> ServerProcess:
    """Runs `vlm-serve serve` on a free loopback port and returns once it prints where it listens."""
    server = spawn_serve(model_dir, *flags, env=env)
    deadline = time.monotonic() + timeout
    while not any("serving" in line and server.url.rsplit(":", 1)[1] in line for line in server.output):
        if server.process.poll() is not None or time.monotonic() > deadline:
            stop_tree(server.process)
            raise RuntimeError("the server did not start:\n" + "".join(server.output))
        time.sleep(0.2)
    return server


@contextlib.contextmanager
def running_server(model_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """`start_server` for a `with` block (a module's server fixture): at the end SIGTERM must stop it
    cleanly and silently."""
    server = start_server(model_dir, *flags, env=env)
    try:
        yield server
    finally:
        assert server.stop() == 0 and not server.after_stop, "".join(server.output)


def openai_client(server: ServerProcess, api_key: str = "EMPTY") -> openai.OpenAI:
    """The official client for a server, without retries (a test sees each answer as it is)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


# ---- sglang-router in front of servers ---------------------------------------------------------------

QUESTION = "What colour is the circle?"
# the chat template's text of QUESTION about one image, as an SGLang user sends it to /generate
PROMPT = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def circle_image() -> Image.Image:
    """The README's picture: a red circle on white."""
    image = Image.new("RGB", (96, 96), "white")
    ImageDraw.Draw(image).ellipse([35, 35, 61, 61], fill="red")
    return image


def circle_url() -> str:
    buffer = io.BytesIO()
    circle_image().save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


MESSAGES = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": circle_url()}}, {"type": "text", "text": QUESTION},
]}]  # fmt: skip


@contextlib.contextmanager
def running_router(*args: str, workers: int = 2, timeout: float = 60) -> Iterator[str]:
    """`python -m sglang_router.launch_router ARGS` on a free loopback port: its URL once it reports
    `workers` healthy workers. SIGTERM stops it at the end."""
    port = free_port()
    process = start_process(router_command(port, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while _healthy_workers(url) < workers:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the router did not start:\n" + process.communicate()[0])
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.communicate(timeout=30)


def metric(url: str, name: str) -> float:
    """The sum of the server's `/metrics` samples whose name (with labels) starts with `vlm_serve:NAME`."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"vlm_serve:{name}"))


def _healthy_workers(url: str) -> int:
    try:
        return httpx.get(url + "/readiness", timeout=5).json()["healthy_workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


def client_answers(base_url: str, tokenizer: Tokenizer) -> dict:
    """What a client gets from `base_url` for each kind of request (greedy): chat with an image (`MESSAGES`),
    with n=2, streamed; batched completions; SGLang's /generate, batched, with an image, streamed."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    greedy = {"max_tokens": 24, "temperature": 0}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, **greedy)
    # no model (the router sends "unknown"), n=2 (in PD mode the router gives each choice its own room)
    two = httpx.post(base_url + "/v1/chat/completions", json={"messages": MESSAGES, "n": 2, **greedy}, timeout=60)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **greedy)
    # batches of prompts with n=2 (in PD mode the router gives each prompt its own room)
    completion = client.completions.create(model=model, prompt=["A red circle", "A blue square"], n=2, **greedy)
    sampling = {"max_new_tokens": 24, "temperature": 0}
    ids = [tokenizer.encode(text) for text in ("A red circle", "A blue square")]
    batch_body = {"input_ids": ids, "sampling_params": {**sampling, "n": 2}}
    batch = httpx.post(base_url + "/generate", json=batch_body, timeout=60)
    body = {"text": PROMPT, "image_data": circle_url(), "sampling_params": sampling}
    generate = httpx.post(base_url + "/generate", json=body, timeout=60).json()
    with httpx.stream("POST", base_url + "/generate", json={**body, "stream": True}, timeout=60) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    return {
        "chat": (chat.choices[0].message.content, chat.usage.prompt_tokens, chat.usage.completion_tokens),
        "chat n=2": [choice["message"]["content"] for choice in two.json()["choices"]],
        "chat streamed": "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices),
        "completions": [choice.text for choice in completion.choices],
        "generate": (generate["text"], generate["output_ids"], generate["meta_info"]["finish_reason"]),
        "generate batch": [out["text"] for out in batch.json()],
        "generate streamed": (json.loads(events[-2])["text"], events[-1]),
    }


def clip_url() -> str:
    """A green square moving left to right, as the built-in model was trained on."""
    frames = []
    for i in range(8):
        frame = Image.new("RGB", (96, 96), "white")
        ImageDraw.Draw(frame).rectangle([8 + 8 * i, 36, 32 + 8 * i, 60], fill="green")
        frames.append(frame)
    buffer = io.BytesIO()
    write_video(buffer, frames, fps=4)
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


VIDEO = {"type": "video_url", "video_url": {"url": clip_url()}}
TOOLS = [{"type": "function", "function": {
    "name": "report_colour", "description": "Report the colour of the shape.",
    "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]},
}}]  # fmt: skip


def deployment_answers(url: str, tokenizer: Tokenizer, cached_tokens: bool = True) -> dict:
    """What a client gets from `url` for each kind of request a deployment serves: `client_answers`'
    battery, then a repeated image, a video, an image and a video, structured output, a named tool and a
    burst of 32 concurrent requests (greedy). Without `cached_tokens` the usage leaves out how many prompt
    tokens a prefix cache served (behind replicas, that depends on which replica took the request). How
    a speculating server's drafts fared is left out too."""
    greedy = {"max_tokens": 24, "temperature": 0}

    def chat(content: list[dict], **extra) -> dict:
        body = {"messages": [{"role": "user", "content": content}], **greedy, **extra}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        del answer["usage"]["speculative"]
        if not cached_tokens:
            del answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        return {"choices": [c["message"] for c in answer["choices"]], "usage": answer["usage"]}

    image, question = MESSAGES[0]["content"]
    text = question["text"]
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    burst = [[image, {"type": "text", "text": f"{text} ({i})"}] for i in range(32)]
    with ThreadPoolExecutor(32) as pool:  # (their cached tokens depend on the order they arrive in)
        concurrent = [answer["choices"] for answer in pool.map(chat, burst)]
    return {
        **client_answers(url, tokenizer),
        "image again": chat([image, question]),
        "video": chat([VIDEO, {"type": "text", "text": "Describe the video."}]),
        "image and video": chat([image, VIDEO, {"type": "text", "text": "Describe."}]),
        "json_schema": chat(
            [image, question], response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
        ),
        "named tool": chat(
            [image, question], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "report_colour"}}
        ),
        "32 at once": concurrent,
    }


# ---- the README's code blocks ------------------------------------------------------------------------

README = Path(__file__).parent.parent / "README.md"
COLLECTED = pytest.StashKey[int]()  # the session's tests as collected, before -m and -k deselect any (conftest)
README_URL = "http://127.0.0.1:30000"  # where the README's examples find the server


@dataclass
class Block:
    """A fenced code block of the README; `output` is the ```text block right after it, if any."""

    language: str
    code: str
    line: int
    output: str | None = None

    @property
    def name(self) -> str:
        return f"line{self.line}-{self.language}"


def readme_blocks() -> list[Block]:
    """The README's code blocks but ```text ones, which become the `output` of the block before them."""
    text = README.read_text()
    blocks: list[Block] = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        language, code = m.group(1), m.group(2)
        if language == "text":
            blocks[-1].output = code
        else:
            blocks.append(Block(language, code, text.count("\n", 0, m.start()) + 1))
    return blocks


def block_command(block: Block, replacements: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run `block` (python with python, bash with bash, stopping at
    the first failing command) as a reader would, with this Python's `python` and `vlm-serve` first on
    PATH, each key of `replacements` in its code (a URL, a port) replaced by its value."""
    code = block.code
    for old, new in replacements.items():
        code = code.replace(old, new)
    interpreter = {"python": [sys.executable, "-c"], "bash": ["bash", "-e", "-o", "pipefail", "-c"]}[block.language]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}  # (no network)
    return [*interpreter, code], env


def hf_inputs(engine, processed) -> dict:
    """What transformers' Qwen VL classes take for the processed input `processed` of `engine` (with the
    seconds between a video's patch groups, where its processor gives them: Qwen2.5-VL's)."""
    cfg = engine.model_config
    ids = torch.tensor([processed.input_ids])
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int(),
    }
    for modality, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        items = [it for it in processed.mm_items if it.modality == modality]
        if items:
            inputs[key] = torch.cat([it.pixel_values for it in items])
            inputs[f"{modality}_grid_thw"] = torch.tensor([it.grid_thw for it in items])
    videos = [it for it in processed.mm_items if it.modality == "video" and it.second_per_grid is not None]
    if videos:
        inputs["second_per_grid_ts"] = torch.tensor([it.second_per_grid for it in videos])
    return inputs
