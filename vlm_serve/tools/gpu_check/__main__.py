"""The kit's command (`python -m vlm_serve.tools.gpu_check`): the parts asked for, in order, each one's
records under OUT, and OUT/summary.txt."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vlm_serve.tools import gpu_check
from vlm_serve.tools.gpu_check.check import Check, environment
from vlm_serve.tools.gpu_check.figures import run_figures
from vlm_serve.tools.gpu_check.parity import run_parity
from vlm_serve.tools.gpu_check.profiling import run_profile
from vlm_serve.tools.gpu_check.server import run_server
from vlm_serve.tools.gpu_check.suite import SUITE, run_suite

PARTS = ("suite", "parity", "server", "figures", "profile")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_serve.tools.gpu_check", description=gpu_check.__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", type=Path, help="folder for every record (created)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument(
        "--size", default=None, help="model size preset of the figures (default: large on CUDA, tiny on CPU)"
    )
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds per test of the suite part")
    parser.add_argument(
        "--suite-files",
        default=None,
        help="comma-separated names of the suite part's test files "
        "(e.g. test_engine,test_speculative; default: all of SUITE, in its order)",
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; the parts are {', '.join(PARTS)}")
    suite = SUITE
    if args.suite_files is not None:
        by_name = {Path(f).stem: f for f in SUITE}
        names = [name for name in args.suite_files.split(",") if name]
        unknown = [name for name in names if name not in by_name]
        if unknown:
            parser.error(f"--suite-files: not in the suite: {', '.join(unknown)}; it has {', '.join(by_name)}")
        suite = [by_name[name] for name in names]
    device = (
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if args.device == "auto"
        else torch.device(args.device)
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    (args.out / "environment.json").write_text(json.dumps(env, indent=1))
    print("environment: " + json.dumps(env), flush=True)
    checks = []
    for part in parts:
        check = Check(args.out, part)
        began = time.perf_counter()
        if part == "suite":
            if device.type != "cuda":
                print("[suite] skipped: on CPU the test suite itself runs these files (CI)", flush=True)
                continue
            run_suite(check, args.test_timeout, suite)
        elif part == "parity":
            run_parity(check, device)
        elif part == "server":
            run_server(check, device)
        elif part == "figures":
            run_figures(check, device, args.size or ("large" if device.type == "cuda" else "tiny"))
        else:
            run_profile(check, device, args.size or ("large" if device.type == "cuda" else "tiny"))
        print(f"[{part}] {time.perf_counter() - began:.0f} s", flush=True)
        checks.append(check)
    results = [r for c in checks for r in c.results]
    failed = [f"{c.part}: {r['name']}: {r['detail']}" for c in checks for r in c.results if not r["ok"]]
    summary = [
        f"device: {env.get('gpu', env['device'])}; {len(results) - len(failed)} passed, {len(failed)} failed",
        *(f"FAIL {line}" for line in failed),
    ]
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
