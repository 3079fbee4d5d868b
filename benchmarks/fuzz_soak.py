"""A soak of the combined-feature test's requests: what tests/deployments/test_combined_features.py sends and checks, for
as long as asked, with several clients at once.

For each set-up of `vlm_serve.testing.deployments.SETUPS` asked for (all by default), one after the other:
starts it (and the reference, the overlap loop without drafts, for the whole run: greedy answers must equal
its own), then draws valid requests from `vlm_serve.testing.requests.calls` (hypothesis, seeded by --seed)
and sends them from --concurrency clients until the set-up's share of --requests has been sent or of
--seconds has passed; the default set-up, which most users run, gets three shares, every other one. Each
answer is checked as the test checks it (`vlm_serve.testing.answers.judge`: well-formed, the same again
when deterministic, as the reference when greedy); a set-up a request took down is restarted. At the end of
each set-up its servers must be idle and healthy (`server_problems`). Printed: per set-up the requests,
the failures by kind and the time; each failing request is saved whole as JSON (endpoint, body, set-up,
problems) in --out, where the servers' logs are too. Exit status 1 if any request failed.

    python benchmarks/fuzz_soak.py --requests 2000 --seconds 3600 --out /tmp/soak [--configs default,pd]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings

from vlm_serve.testing.answers import judge, kind, server_problems
from vlm_serve.testing.deployments import CLIENT_TIMEOUT, REFERENCE, SETUPS, Deployment, deployed
from vlm_serve.testing.requests import Call, calls

DEFAULT_SHARES = 3  # the default set-up's shares of the requests and the time; every other one has one


class Tally:
    """One set-up's requests and failures so far (added to from the clients' threads)."""

    def __init__(self, name: str, out: Path) -> None:
        self.name, self.out = name, out
        self.sent = 0
        self.kinds: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def record(self, call: Call, problems: list[str]) -> None:
        with self.lock:
            if not problems:
                return
            self.kinds[kind(problems)] += 1
            number = sum(self.kinds.values())
        saved = {**call.as_json(), "setup": self.name, "problems": problems}
        (self.out / f"failed-{self.name}-{number:04d}.json").write_text(json.dumps(saved, indent=1))

    @property
    def failures(self) -> int:
        return sum(self.kinds.values())


def soak(
    deployment: Deployment,
    reference: Deployment,
    tally: Tally,
    requests: int,
    seconds: float,
    concurrency: int,
    run_seed: int,
) -> None:
    """Sends requests to `deployment` until `requests` have gone or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    client = httpx.Client(timeout=CLIENT_TIMEOUT, limits=httpx.Limits(max_connections=2 * concurrency))
    pool = ThreadPoolExecutor(concurrency)
    in_flight: set[Future] = set()

    def settle(wait_all: bool) -> None:
        """Records the finished requests (all of them with `wait_all`); restarts set-ups found down."""
        while in_flight and (wait_all or len(in_flight) >= concurrency):
            done = next(f for f in (*in_flight,) if f.done()) if any(f.done() for f in in_flight) else None
            if done is None:
                time.sleep(0.01)
                continue
            in_flight.discard(done)
            call, problems = done.result()
            if problems and any(setup.failure() for setup in (deployment, reference)):
                for future in list(in_flight):  # (their answers are the death's too)
                    tally.record(*future.result())
                in_flight.clear()
                died = [failure for setup in (deployment, reference) if (failure := setup.failure())]
                tally.record(call, problems + died)
                for setup in (deployment, reference):
                    if setup.failure():
                        setup.restart()
                continue
            tally.record(call, problems)

    @settings(
        max_examples=requests,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @seed(run_seed)
    @given(call=calls(router=deployment.routed, adapter=deployment.adapter))
    def send(call: Call) -> None:
        if time.monotonic() > deadline:
            return
        settle(wait_all=False)
        tally.sent += 1
        in_flight.add(
            pool.submit(
                lambda: (call, judge(client, deployment.url, call, reference.url if deployment.builtin else None))
            )
        )

    send()
    settle(wait_all=True)
    pool.shutdown()
    idle = [problem for url in deployment.servers for problem in server_problems(client, url)]
    if idle or deployment.failure():
        tally.kinds["not idle and healthy afterwards"] += 1
        print(f"{deployment.name} afterwards:", *idle, deployment.failure(), sep="\n  ", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(SETUPS), help=f"set-ups, of {', '.join(SETUPS)}")
    parser.add_argument("--requests", type=int, default=2000, help="requests in all, shared among the set-ups")
    parser.add_argument("--seconds", type=float, default=3600, help="time in all, shared among the set-ups")
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    parser.add_argument("--seed", type=int, default=0, help="draws the requests (another seed, other requests)")
    parser.add_argument("--out", type=Path, required=True, help="folder for failing requests and the servers' logs")
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = [name for name in names if name not in SETUPS]
    if unknown:
        parser.error(f"unknown set-up {unknown[0]!r}: choose among {', '.join(SETUPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    shares = {name: DEFAULT_SHARES if name == "default" else 1 for name in names}
    total = sum(shares.values())
    counts = {name: args.requests * share // total for name, share in shares.items()}
    counts[names[0]] += args.requests - sum(counts.values())  # (the rest of the division)
    tallies, durations = [], []
    with deployed(REFERENCE, args.out) as reference:
        for name in names:
            share = shares[name] / total
            tally = Tally(name, args.out)
            start = time.monotonic()
            with ExitStack() as stack:
                deployment = reference if name == REFERENCE else stack.enter_context(deployed(name, args.out))
                seconds = args.seconds * share
                soak(deployment, reference, tally, max(1, counts[name]), seconds, args.concurrency, args.seed)
            tallies.append(tally)
            durations.append(time.monotonic() - start)
            print(
                f"{name}: {tally.sent} requests, {tally.failures} failed {dict(tally.kinds)} ({durations[-1]:.0f} s)",
                flush=True,
            )
    print(f"\n{'set-up':<10} {'requests':>8} {'failed':>7} {'seconds':>8}  failures by kind")
    for tally, duration in zip(tallies, durations):
        kinds = ", ".join(f"{k}: {v}" for k, v in tally.kinds.most_common()) or "-"
        print(f"{tally.name:<10} {tally.sent:>8} {tally.failures:>7} {duration:>8.0f}  {kinds}")
    sent, failed = sum(t.sent for t in tallies), sum(t.failures for t in tallies)
    print(f"{'all':<10} {sent:>8} {failed:>7} {sum(durations):>8.0f}  (failing requests: {args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
