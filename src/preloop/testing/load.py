"""A load engine for the scheduler benchmark: one runner process with a
fixed capacity, claiming and completing jobs until the given runs end, the
way a runner process with `capacity` free slots drives the store: it claims
up to its free capacity in one statement (`Store.claim_jobs`), and reports
each finished batch and claims the next in one transaction
(`Store.complete_and_claim`). Run as `python -m preloop.testing.load URL
RUN_IDS CAPACITY [THREADS]`; it prints "ready", waits for a line on stdin (so
engines start together), and prints one JSON line with its counters and
completion count when done.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

from preloop.control import Lease, open_store

__all__ = ["let_go", "main", "reports", "start_ready", "start_together"]


def start_ready(argvs: list[list[str]]) -> list[subprocess.Popen[str]]:
    """Starts a process per argv that speaks this module's protocol (prints
    "ready", waits for a line on stdin) and waits until every one is ready."""
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for argv in argvs
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return procs


def let_go(procs: list[subprocess.Popen[str]]) -> None:
    """Lets processes `start_ready` started go, one right after the other."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def start_together(argvs: list[list[str]]) -> list[subprocess.Popen[str]]:
    """`start_ready`, then `let_go`: the processes start working together."""
    procs = start_ready(argvs)
    let_go(procs)
    return procs


def reports(procs: list[subprocess.Popen[str]], timeout: float = 300) -> list[dict[str, Any]]:
    """Each process's last output line, a JSON report, once it exited 0."""
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


def main(argv: list[str]) -> int:
    url, runs_arg, capacity_arg, *rest = argv
    runs = [int(r) for r in runs_arg.split(",")]
    capacity = int(capacity_arg)
    threads = int(rest[0]) if rest else 1
    store = open_store(url)
    print("ready", flush=True)
    sys.stdin.readline()
    done = threading.Event()
    completions = [0] * threads
    t0 = time.perf_counter()

    def runner(i: int) -> None:
        name = f"engine-{threading.get_native_id()}-{i}"
        held: list[Lease] = []
        while not done.is_set():
            if held:
                # Every held job "ran" instantly: report them and refill.
                results = [(lease, "success", None) for lease in held]
                finished, held = store.complete_and_claim(results, name, ["linux"], limit=capacity)
                completions[i] += sum(1 for c in finished if c.error is None)
                continue
            held = store.claim_jobs(name, ["linux"], limit=capacity)
            if held:
                continue
            if all(store.get_run(r).status == "completed" for r in runs):
                done.set()
                return
            time.sleep(0.0005)  # idle poll, as a runner would between claims

    pool = [threading.Thread(target=runner, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    snap = store.counters.snapshot()
    ops = ("complete_and_claim", "complete_and_claim.fallback", "complete_and_claim.lock_first")
    print(
        json.dumps(
            {
                "completions": sum(completions),
                "elapsed": elapsed,
                "graph_loads": snap.graph_loads,
                "settle_lock_hold_ns": snap.settle_lock_hold_ns,
                "settle_lock_holds": snap.settle_lock_holds,
                "statement_lock_hold_ns": snap.statement_lock_hold_ns,
                "statement_lock_holds": snap.statement_lock_holds,
                "lock_run_wait_ns": snap.lock_run_wait_ns,
                "lock_run_waits": snap.lock_run_waits,
                "deadlock_retries": snap.deadlock_retries,
                "complete_statements": sum(snap.statements.get(op, 0) for op in ops),
                "complete_ops": snap.operations.get("complete_and_claim", 0),
                "fallbacks": snap.operations.get("complete_and_claim.fallback", 0),
                "lock_first_retries": snap.operations.get("complete_and_claim.lock_first", 0),
                "claim_statements": snap.statements.get("claim_job", 0),
            }
        ),
        flush=True,
    )
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
