"""Side by side with a peer server: `vlm-serve serve` and vLLM's OpenAI server (its CPU build, found by
`--vllm VENV`) on the same checkpoint, one server at a time, through the same workloads, in alternating
rounds; one table of medians and ratios (ours / vLLM) at the end.

`--vllm-dtype` is the dtype vLLM computes in (float32 by default; `bfloat16` to serve a bfloat16 checkpoint
as stored, where its CPU build takes it); ours serves a checkpoint's weights as stored (`--dtype auto`).

Each round starts each server in turn (the order alternates round by round), sends one untimed warm-up
run, then every workload through our client (`bench_serving.py`) and, where vLLM's own client has a
dataset for it, through `vllm bench serve` too, and stops the server. Both servers get the machine's
cores to themselves: ours with its defaults (on CPU the vision tower in the scheduler's process: one
process's threads, as vLLM's engine has) and `--ours-args`, vLLM with `VLLM_CPU_OMP_THREADS_BIND` over
the same cores. All requests stream, greedy,
with `ignore_eos`, so both servers generate the same number of tokens.

Workloads (`--workloads`, comma list; request counts scaled by `--prompts-scale`):
  image-repeat   one 448x448 image + 32 words, 64 tokens, half the requests reuse 4 pool images, conc 8
  image-fresh    the same with a new image per request (vLLM's client: random-mm)
  chat-longtail  one image + text of 64 words median (log-normal), answers of 96 tokens median with a
                 long tail (log-normal, sigma 0.8, up to 8x), conc 8
  text-burst     256 words in, 128 tokens out, all requests at once, conc 16 (vLLM's client: random,
                 256 +- 25% in, 128 +- 25% out)
  video          one 16-frame 448x448 video + 32 words, 64 tokens, conc 4 (vLLM's client: random-mm
                 with a 16-frame bucket)

A run is dropped as disturbed when other processes used more than `--max-foreign-cpu` of the cores
during it (measured from /proc: all busy CPU time minus the server's and the client's); each cell of
the table is the median of the runs kept (their count in brackets when fewer than the rounds).

    python benchmarks/compare_peer.py --model /tmp/small-moe --vllm ~/peers/vllm-cpu --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from cpu_isa import ISAS, environment

from vlm_serve.server.ports import free_port

HERE = Path(__file__).resolve().parent
CORES = len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Workload:
    """One workload: the flags of our client, and of vLLM's client where it has an equivalent dataset."""

    ours: str
    peer: str | None
    prompts: int


IMAGE = "--image-size 448x448 --input-len 32 --output-len 64 --max-concurrency 8"
RANDOM_MM = (
    "--dataset-name random-mm --random-input-len 32 --random-output-len 64 --random-range-ratio 0 "
    "--max-concurrency {conc} --random-mm-base-items-per-request 1 "
)
WORKLOADS = {
    "image-repeat": Workload(f"{IMAGE} --repeat-image-ratio 0.5 --image-pool-size 4", None, 32),
    "image-fresh": Workload(
        IMAGE,
        RANDOM_MM.format(conc=8) + """--random-mm-limit-mm-per-prompt '{"image": 1, "video": 0}' """
        """--random-mm-bucket-config '{(448, 448, 1): 1.0}'""",
        32,
    ),
    "chat-longtail": Workload(
        "--image-size 448x448 --input-len 64 --input-len-sigma 0.5 --output-len 96 --output-len-sigma 0.8 "
        "--max-concurrency 8",
        None,
        32,
    ),
    "text-burst": Workload(
        "--images-per-request 0 --input-len 256 --output-len 128 --max-concurrency 16",
        "--dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 0.25 "
        "--max-concurrency 16",
        48,
    ),
    "video": Workload(
        "--images-per-request 0 --videos-per-request 1 --video-frames 16 --video-size 448x448 --input-len 32 "
        "--output-len 64 --max-concurrency 4",
        RANDOM_MM.format(conc=4) + """--random-mm-limit-mm-per-prompt '{"image": 0, "video": 1}' """
        """--random-mm-bucket-config '{(448, 448, 16): 1.0}'""",
        12,
    ),
}
METRICS = ("output_tps", "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "itl_p99_ms")
LABELS = ("tok/s", "TTFT mean", "TTFT p99", "TPOT mean", "ITL p99")


@dataclass
class Figures:
    """What one benchmark run measured."""

    output_tps: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    itl_p99_ms: float
    failed: int
    foreign_cpu: float = 0.0  # share of the cores other processes used during the run


# ---- servers -----------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str  # "ours" | "vllm"
    command: list[str]
    env: dict[str, str]
    url: str


def our_server(model: Path, name: str, extra: str, isa: str) -> Server:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vlm_serve.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        name,
        *shlex.split(extra),
    ]
    return Server("ours", command, environment(isa), f"http://127.0.0.1:{port}")


def vllm_server(venv: Path, model: Path, name: str, extra: str, isa: str, dtype: str) -> Server:
    """vLLM's CPU build as ../shared/PEERS.md runs it."""
    port = free_port()
    command = [
        str(venv / "bin" / "python"),
        str(HERE / "vllm_launcher.py"),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        "4096",
        "--served-model-name",
        name,
        *shlex.split(extra),
    ]
    return Server("vllm", command, vllm_env(venv, CORES) | environment(isa), f"http://127.0.0.1:{port}")


def vllm_env(venv: Path, threads: int) -> dict[str, str]:
    """What vLLM's CPU build needs (../shared/PEERS.md): tcmalloc and its venv's OpenMP preloaded,
    its OpenMP threads bound to `threads` cores, 2 GiB of KV cache."""
    preload = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(venv / "lib" / "libiomp5.so")]
    return {
        "LD_PRELOAD": ":".join(p for p in preload if Path(p).exists()),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_HOST_IP": "127.0.0.1",
    }


class VllmScript:
    """One of our scripts run by the vLLM venv's `python` (benchmarks/vllm_offline.py, vllm_caption.py) on a
    spec file: it loads vLLM once and answers each line sent to its stdin with one JSON line; vLLM's own
    output goes to `log`. It runs in a session of its own, its OpenMP threads bound to `threads` cores."""

    def __init__(self, python: Path, script: str, spec_file: Path, log: Path, threads: int) -> None:
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [str(python), str(Path(__file__).parent / script), str(spec_file)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
                env=os.environ | vllm_env(python.parent.parent, threads),
                start_new_session=True,
            )

    def reply(self) -> dict:
        """Its next JSON line; if it exited instead, the end of its log (SystemExit)."""
        line = self.process.stdout.readline()
        if not line:
            tail = "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-30:])
            raise SystemExit(f"vLLM exited (status {self.process.wait()}); the end of {self.log}:\n{tail}")
        return json.loads(line)

    def ask(self, line: str) -> dict:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.reply()

    def close(self) -> None:
        """Ends it: it exits at the end of its stdin; its process group is killed if it has not after a minute."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@contextlib.contextmanager
def running(server: Server, log: Path, timeout: float) -> Iterator[int]:
    """Starts the server (its output into `log`), waits until it lists its model; yields its pid."""
    with open(log, "a") as out:
        process = subprocess.Popen(
            server.command, env=os.environ | server.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{server.name} exited during start-up (status {process.returncode}); see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/v1/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} was not ready after {timeout:.0f} s; see {log}")
            time.sleep(1)
        yield process.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# ---- CPU accounting ----------------------------------------------------------------------------------


def busy_seconds() -> float:
    """CPU time the whole machine has spent busy (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def tree_seconds(pid: int) -> float:
    """CPU time used so far by `pid` and its living descendants."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += map(int, (task / "children").read_text().split())
        except (OSError, IndexError):
            continue
    return total


def children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---- clients -----------------------------------------------------------------------------------------


def run_client(command: list[str], server_pid: int, log: Path) -> float:
    """Runs a benchmark client to its end; the share of the cores that other processes used meanwhile."""
    start, busy, server, client = time.monotonic(), busy_seconds(), tree_seconds(server_pid), children_seconds()
    with open(log, "a") as out:
        out.write(f"\n$ {shlex.join(command)}\n")
        out.flush()
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if status not in (0, 1):  # (1: some requests failed, which the figures say)
        raise RuntimeError(f"the benchmark client failed (status {status}); see {log}")
    ours = (tree_seconds(server_pid) - server) + (children_seconds() - client)
    return max(0.0, busy_seconds() - busy - ours) / (CORES * (time.monotonic() - start))


def ours_client(url: str, name: str, workload: Workload, prompts: int, server_pid: int, log: Path) -> Figures:
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [
            sys.executable,
            str(HERE / "bench_serving.py"),
            "--base-url",
            url,
            "--model",
            name,
            "--num-prompts",
            str(prompts),
            "--output-json",
            result.name,
            *shlex.split(workload.ours),
        ]
        foreign = run_client(command, server_pid, log)
        s = json.loads(Path(result.name).read_text())
    return Figures(
        s["output_throughput"],
        s["ttft"]["mean_ms"],
        s["ttft"]["p99_ms"],
        s["tpot"]["mean_ms"],
        s["itl"]["p99_ms"],
        s["failed_requests"],
        foreign,
    )


def vllm_client(
    venv: Path, model: Path, url: str, name: str, workload: Workload, prompts: int, server_pid: int, log: Path
) -> Figures:
    with tempfile.TemporaryDirectory() as folder:
        command = [
            str(venv / "bin" / "python"),
            str(HERE / "vllm_launcher.py"),
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--base-url",
            url,
            "--model",
            name,
            "--tokenizer",
            str(model),
            "--num-prompts",
            str(prompts),
            "--ignore-eos",
            "--temperature",
            "0",
            "--save-result",
            "--result-dir",
            folder,
            "--result-filename",
            "r.json",
            *shlex.split(workload.peer),
        ]
        foreign = run_client(command, server_pid, log)
        s = json.loads((Path(folder) / "r.json").read_text())
    return Figures(
        s["output_throughput"],
        s["mean_ttft_ms"],
        s["p99_ttft_ms"],
        s["mean_tpot_ms"],
        s["p99_itl_ms"],
        s["num_prompts"] - s["completed"],
        foreign,
    )


# ---- the comparison ----------------------------------------------------------------------------------


Key = tuple[str, str, str]  # (workload, client, server)


def compare(args: argparse.Namespace) -> dict[Key, list[Figures]]:
    name = args.model.name
    servers = [our_server(args.model, name, args.ours_args, args.isa)]
    if args.vllm is not None:
        servers.append(vllm_server(args.vllm, args.model, name, args.vllm_args, args.isa, args.vllm_dtype))
    runs: dict[Key, list[Figures]] = defaultdict(list)
    for round_ in range(args.rounds):
        for server in servers if round_ % 2 == 0 else servers[::-1]:
            log = args.log_dir / f"{server.name}.log"
            print(f"round {round_ + 1}/{args.rounds}: {server.name}", file=sys.stderr, flush=True)
            with running(server, log, args.startup_timeout) as pid:
                warm = Workload("--image-size 448x448 --input-len 16 --output-len 8 --max-concurrency 4", None, 4)
                ours_client(server.url, name, warm, 4, pid, log)
                for workload_name in args.workloads:
                    workload = WORKLOADS[workload_name]
                    prompts = max(1, round(workload.prompts * args.prompts_scale))
                    figures = ours_client(server.url, name, workload, prompts, pid, log)
                    runs[workload_name, "ours", server.name].append(figures)
                    report(workload_name, "ours", server.name, figures)
                    if workload.peer is not None and args.vllm is not None and not args.no_peer_client:
                        figures = vllm_client(args.vllm, args.model, server.url, name, workload, prompts, pid, log)
                        runs[workload_name, "vllm", server.name].append(figures)
                        report(workload_name, "vllm", server.name, figures)
    return runs


def report(workload: str, client: str, server: str, f: Figures) -> None:
    print(
        f"  {workload:<14} {client:>4} client, {server:>4} server: {f.output_tps:8.1f} tok/s, TTFT "
        f"{f.ttft_mean_ms:7.1f} ms, TPOT {f.tpot_mean_ms:6.1f} ms, ITL p99 {f.itl_p99_ms:6.1f} ms, "
        f"{f.failed} failed, other load {f.foreign_cpu:.0%}",
        file=sys.stderr,
        flush=True,
    )


def medians(runs: list[Figures], max_foreign: float) -> tuple[dict[str, float], int]:
    """Each metric's median over the undisturbed runs (all runs if every one was disturbed)."""
    kept = [f for f in runs if f.foreign_cpu <= max_foreign] or runs
    return {m: statistics.median(getattr(f, m) for f in kept) for m in METRICS}, len(kept)


def table(runs: dict[Key, list[Figures]], args: argparse.Namespace) -> str:
    """A markdown table: per workload and client, ours vs vLLM for each metric, and tok/s ratio."""
    lines = [
        "| workload | client | " + " | ".join(LABELS) + " | tok/s ratio |",
        "|---|---|" + "---|" * (len(LABELS) + 1),
    ]
    for workload in args.workloads:
        for client in ("ours", "vllm"):
            if (workload, client, "ours") not in runs:
                continue
            ours, kept_ours = medians(runs[workload, client, "ours"], args.max_foreign_cpu)
            peer_runs = runs.get((workload, client, "vllm"))
            peer, kept_peer = medians(peer_runs, args.max_foreign_cpu) if peer_runs else ({}, 0)
            cells = []
            for metric in METRICS:
                fmt = ".1f" if metric == "output_tps" else ".0f" if metric.startswith(("ttft", "itl")) else ".1f"
                cell = format(ours[metric], fmt) + (f" vs {peer[metric]:{fmt}}" if peer else "")
                cells.append(cell)
            ratio = f"{ours['output_tps'] / peer['output_tps']:.2f}x" if peer else "n/a"
            kept = "" if min(kept_ours, kept_peer or args.rounds) == args.rounds else f" [{kept_ours}/{kept_peer}]"
            lines.append(f"| {workload}{kept} | {client} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory both servers load")
    parser.add_argument("--vllm", type=Path, default=None, help="the venv of vLLM's CPU build (none: ours alone)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument(
        "--isa",
        choices=ISAS,
        default="native",
        help="avx2: both servers run their AVX2 code on any x86 machine (cpu_isa.py)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--prompts-scale", type=float, default=1.0, help="scales every workload's request count")
    parser.add_argument("--ours-args", default="", help="more flags for `vlm-serve serve`")
    parser.add_argument("--vllm-args", default="", help="more flags for `vllm serve`")
    parser.add_argument(
        "--vllm-dtype",
        default="float32",
        help="vLLM's --dtype (float32; bfloat16 for a bfloat16 checkpoint where its CPU build takes it: "
        "ours keeps such weights in bfloat16 and computes in float32 with its default --dtype auto)",
    )
    parser.add_argument("--no-peer-client", action="store_true", help="only our client (faster)")
    parser.add_argument("--max-foreign-cpu", type=float, default=0.15, help="drop runs with more other load (0.15)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", type=Path, default=None, help="server and client output (a temp folder)")
    parser.add_argument("--output-json", type=Path, default=None, help="every run's figures")
    args = parser.parse_args()
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    if args.vllm is not None and not (args.vllm / "bin" / "python").exists():
        parser.error(f"--vllm {args.vllm}: no bin/python there (the venv of vLLM's CPU build)")
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="compare-peer-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {args.log_dir}", file=sys.stderr)
    try:
        runs = compare(args)
    except RuntimeError as exc:
        print(f"compare_peer: error: {exc}", file=sys.stderr)
        return 2
    print(f"\n{args.model.name}: medians of {args.rounds} alternating rounds, ours vs vLLM (ratio = ours / vLLM)")
    print(table(runs, args))
    if args.output_json:
        records = [
            {"workload": w, "client": c, "server": s, "runs": [asdict(f) for f in fs]} for (w, c, s), fs in runs.items()
        ]
        args.output_json.write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
