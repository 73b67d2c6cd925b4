"""core/workarounds/paddle_serving.py's server fixes: one waiting Op thread woken per request (every request still
taken exactly once), Paddle Serving's per-request log records gone, and the off switch.

Run in a child process: importing Paddle Serving's pipeline reconfigures the root logger (dictConfig), which must
not leak into the rest of the test session."""
import json
import os
import subprocess
import sys

from core.workarounds.paddle_serving import FIXES_ENV
from core import REPO_ROOT

CHILD = r'''
import json, logging, sys, threading, time
import serving  # (Paddle Serving's own workarounds first)
from core.workarounds import paddle_serving
from paddle_serving_server.pipeline import channel

class Item:
    def __init__(self, i):
        self.id, self.log_id = i, 0

def run(items=40, threads=8):
    """`threads` consumer threads of one Op wait on the channel; `items` pushes, each once the threads are waiting.
    Returns (what each consumer took, how many times consumers tried the queue)."""
    ch = channel.ThreadChannel(name="in")
    ch.add_producer("@DAGExecutor")
    ch.add_consumer("generate")
    tries, taken, lock = [0], [], threading.Lock()
    shipped_get = ch.get
    def counting_get(*a, **k):
        with lock:
            tries[0] += 1
        return shipped_get(*a, **k)
    ch.get = counting_get
    def consume():
        try:
            while True:
                got = ch.front("generate")
                with lock:
                    taken.append(got["@DAGExecutor"].id)
        except channel.ChannelStopError:
            pass
    def settled(done):  # (every consumer waits on the channel's condition again; `done` items taken; a child
        # program of its own, so not tests/helpers.py wait_until)
        deadline = time.time() + 5
        while (len(taken) < done or len(ch._cv._waiters) < threads) and time.time() < deadline:
            time.sleep(0.001)
    workers = [threading.Thread(target=consume) for _ in range(threads)]
    for w in workers:
        w.start()
    settled(0)
    start = tries[0]
    for i in range(items):
        ch.push(Item(i), "@DAGExecutor")
        settled(i + 1)
    ch.stop()
    for w in workers:
        w.join(5)
    return sorted(taken), tries[0] - start

shipped = run()
applied = paddle_serving.server_fixes()
fixed = run()
log = logging.getLogger("paddle_serving_server.pipeline.dag")
print(json.dumps({"applied": applied, "shipped": shipped, "fixed": fixed,
                  "info": log.isEnabledFor(logging.INFO), "debug": log.isEnabledFor(logging.DEBUG),
                  "warning": log.isEnabledFor(logging.WARNING),
                  "patched": getattr(channel.ThreadChannel.push, "wakes_one", False)}))
'''


def _child(tmp_path, fixes: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), SERVING_LOG_PATH=str(tmp_path), **{FIXES_ENV: fixes})
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_op_thread_is_woken_per_request_and_every_request_is_taken_once(tmp_path):
    result = _child(tmp_path, "on")
    items = list(range(40))
    (shipped_taken, shipped_tries), (fixed_taken, fixed_tries) = result["shipped"], result["fixed"]
    assert result["applied"] and result["patched"]
    assert shipped_taken == items and fixed_taken == items  # each request taken by exactly one thread
    # shipped: all 8 waiting threads try the queue for each request (9 tries); fixed: the one woken, which takes it
    # and tries once more before waiting again (2 tries; a little slack for a loaded machine)
    assert shipped_tries >= 4 * len(items), shipped_tries
    assert fixed_tries <= 2 * len(items) + 8, fixed_tries
    # Paddle Serving's per-request debug records and INFO lines are off; its warnings still go to its log
    assert not result["debug"] and not result["info"] and result["warning"]


def test_the_off_switch_leaves_paddle_serving_as_shipped(tmp_path):
    result = _child(tmp_path, "off")
    assert not result["applied"] and not result["patched"]
    assert result["debug"]  # (Paddle Serving's root logger at DEBUG, as shipped)
    assert result["fixed"][1] >= 4 * 40
