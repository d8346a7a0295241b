"""A load engine for the scheduler benchmark: one process, several claimer
threads sharing one store, claiming and completing jobs until the given runs
end. Run as `python -m preloop.testing.load URL RUN_IDS THREADS`; it prints
"ready", waits for a line on stdin (so engines start together), and prints
one JSON line with its counters and completion count when done.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from preloop.control import open_store

__all__ = ["main"]


def main(argv: list[str]) -> int:
    url, runs_arg, threads_arg = argv
    runs = [int(r) for r in runs_arg.split(",")]
    store = open_store(url)
    print("ready", flush=True)
    sys.stdin.readline()
    done = threading.Event()
    completions = [0] * int(threads_arg)
    t0 = time.perf_counter()

    def claimer(i: int) -> None:
        name = f"engine-{threading.get_native_id()}-{i}"
        while not done.is_set():
            lease = store.claim_job(name, ["linux"])
            if lease is None:
                if all(store.get_run(r).status == "completed" for r in runs):
                    done.set()
                    return
                time.sleep(0.0005)  # idle poll, as a runner would between claims
                continue
            store.complete_job(lease, "success", {})
            completions[i] += 1

    pool = [threading.Thread(target=claimer, args=(i,)) for i in range(int(threads_arg))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    snap = store.counters.snapshot()
    print(
        json.dumps(
            {
                "completions": sum(completions),
                "elapsed": elapsed,
                "graph_loads": snap.graph_loads,
                "settle_lock_hold_ns": snap.settle_lock_hold_ns,
                "settle_lock_holds": snap.settle_lock_holds,
                "lock_run_wait_ns": snap.lock_run_wait_ns,
                "lock_run_waits": snap.lock_run_waits,
                "deadlock_retries": snap.deadlock_retries,
                "complete_statements": snap.statements.get("complete_job", 0),
                "complete_ops": snap.operations.get("complete_job", 0),
            }
        ),
        flush=True,
    )
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
