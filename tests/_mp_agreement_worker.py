"""One of 2 processes whose bucket-save agreements about several roots interleave as two callbacks' do.

Run by tests/test_agreement_multiprocess.py: argv = process id, port, folder.
No bucket is written: the agreements go through JAX's coordination service
only (the roots are names). Scenarios, each with roots of its own:

* "order": process 0 opens its first save of root A, then of root B;
  process 1 opens B, then A. Each root's saves run on a thread of their own
  (as each callback's on its worker), concurrently; process 1's write into
  A fails. Then a second save into each root, where nothing fails.
* "deletion": on one thread, root C's save settles its write, then a save
  into root D settles its write (process 0 deletes the keys of earlier saves
  there) before process 1 reads C's commit verdict; then a second save into C.
* "shutdown": both processes shut `jax.distributed` down while a save's
  agreement is open; process 1 then waits for its verdict.

Each process writes what each save raised, and the keys left, to `agree<id>.json`.
"""

import json
import os
import threading

from tests.mp import start_worker

process_id, folder = start_worker(devices=1)

import jax  # noqa: E402

from shardckpt._jax import distributed_client  # noqa: E402
from shardckpt.training.agreement import Agreement, root_keys  # noqa: E402

client = distributed_client()
WAIT_MS = 120_000  # the barriers between scenarios (process start-up differs under load)


def outcome(action):
    """What `action()` raised: None, or its type, message and the processes it names."""
    try:
        action()
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e), "processes": getattr(e, "processes", None)}
    return None


def save(root, step, error=None):
    """One save's agreement, as `StepCheckpointer.save_checkpointables` makes it."""
    agreement = Agreement(root, step, f"Saving checkpoint step {step} to {root!r}")
    agreement.settle("clean", None, everyone=False)
    agreement.settle("write", error, everyone=True)
    agreement.settle("commit", None, everyone=False)


def order():
    roots = {"A": "gs://bucket/frequent", "B": "s3://bucket/per_epoch"}
    first, second = ("A", "B") if process_id == 0 else ("B", "A")
    opened = {name: threading.Event() for name in roots}
    got = {}

    def run(name, after):
        if after is not None:
            opened[after].wait()
        agreement = Agreement(roots[name], 2, f"Saving checkpoint step 2 to {roots[name]!r}")
        opened[name].set()
        error = OSError(f"disk full writing {name}") if process_id == 1 and name == "A" else None

        def phases():
            agreement.settle("write", error, everyone=True)
            agreement.settle("commit", None, everyone=False)

        got[name] = [outcome(phases), outcome(lambda: save(roots[name], 4))]

    threads = [threading.Thread(target=run, args=(first, None)), threading.Thread(target=run, args=(second, first))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def deletion():
    c, d = "gs://bucket/c", "gs://bucket/d"
    got = {}
    first = Agreement(c, 2, "saving C")
    got["c_write"] = outcome(lambda: first.settle("write", None, everyone=True))
    if process_id == 0:
        got["c_commit"] = outcome(lambda: first.settle("commit", None, everyone=False))
        got["d"] = outcome(lambda: Agreement(d, 3, "saving D").settle("write", None, everyone=True))
    else:
        got["d"] = outcome(lambda: Agreement(d, 3, "saving D").settle("write", None, everyone=True))
        got["c_commit"] = outcome(lambda: first.settle("commit", None, everyone=False))
    got["c_again"] = outcome(lambda: save(c, 4))
    client.wait_at_barrier("deletion done", WAIT_MS)
    # The keys left: the last save into each root, nothing of the earlier one.
    got["keys"] = {name: sorted({k.split("/")[3] for k, _ in client.key_value_dir_get(f"{root_keys(root)}/")})
                   for name, root in (("c", c), ("d", d))}
    return got


client.wait_at_barrier("start", WAIT_MS)
result = {"order": order()}
client.wait_at_barrier("order done", WAIT_MS)
result["deletion"] = deletion()
# "shutdown": a save is agreeing when the coordination service shuts down
# (as JAX's exit handler does): the client's wait is cancelled, which is no
# silence of process 0's.
late = Agreement("gs://bucket/late", 8, "saving late")
jax.distributed.shutdown()
if process_id == 1:
    result["shutdown"] = outcome(lambda: late.settle("commit", None, everyone=False))
with open(os.path.join(folder, f"agree{process_id}.json"), "w") as f:
    json.dump(result, f)
