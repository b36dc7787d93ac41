"""An agent's part around a zygote, for ``tests/test_zygote.py``: a child subreaper that
starts a zygote and forks workers from it, printing what it saw as JSON lines.

``python zygote_agent.py OUT facts``: a worker writes what it finds (``OUT/facts.json``), then
exits with 3; a second is SIGKILLed. ``... OUT orphan``: a worker that sleeps; this process
prints its and the zygote's PIDs and sleeps too (the test kills it). ``... OUT dead``: forks
after the zygote was killed, and from a zygote that cannot start. ``... OUT stalled``: the
zygote forks a worker but stalls before it says its PID; the agent gives up on it.
"""

import ctypes
import json
import os
import signal
import sys
import time

from xmig.agent.zygote import Zygote

out, mode = sys.argv[1], sys.argv[2]
ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER, as an agent is
worker_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_worker.py")
env = {**os.environ, "ZYGOTE_TEST": "only in the worker's order"}


def say(**fields):
    print(json.dumps(fields), flush=True)


if mode == "facts":
    zygote = Zygote(dict(os.environ), out)
    first = zygote.fork(env, worker_script, [out, "3"], out)
    second = zygote.fork(env, worker_script, [out, "sleep"], "/")
    while not os.path.exists(os.path.join(out, "sleeping")):
        time.sleep(0.01)
    os.kill(second.pid, signal.SIGKILL)
    say(
        zygote=zygote.pid,
        first=first.pid,
        first_code=first.wait(timeout=60),
        second=second.pid,
        second_code=second.wait(timeout=60),
        forked=zygote.forked,
    )
    zygote.stop()
elif mode == "orphan":
    zygote = Zygote(dict(os.environ), out)
    worker = zygote.fork(env, worker_script, [out, "sleep"], out)
    say(zygote=zygote.pid, worker=worker.pid)
    time.sleep(120)
elif mode == "dead":
    zygote = Zygote(dict(os.environ), out)
    first = zygote.fork(env, worker_script, [out, "0"], out)
    first.wait(timeout=60)
    os.kill(zygote.pid, signal.SIGKILL)
    started = time.monotonic()
    after_death = zygote.fork(env, worker_script, [out, "0"], out)
    broken = Zygote(dict(os.environ), out, command=[sys.executable, "-c", "raise SystemExit(1)"])
    never = broken.fork(env, worker_script, [out, "0"], out)
    say(
        after_death=after_death is None,
        never=never is None,
        alive=zygote.alive or broken.alive,
        seconds=time.monotonic() - started,
    )
elif mode == "stalled":
    # the real zygote, made to stall for 30 s before each answer it gives about a worker
    stall = (
        "import time, xmig.agent.zygote as z; real = z._answer; "
        "z._answer = lambda fd, text: (time.sleep(30), real(fd, text)); z.main()"
    )
    zygote = Zygote(dict(os.environ), out, command=[sys.executable, "-c", stall], fork_timeout=3.0)
    started = time.monotonic()
    worker = zygote.fork(env, worker_script, [out, "0"], out)
    took = time.monotonic() - started
    children = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the forked worker, told nothing, exits by itself
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if not pid:
                break
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            children = [int(p) for p in f.read().split()]
        if not children:
            break
        time.sleep(0.1)
    for pid in children:  # the worker outlived the bound (our child: its PID is still its)
        os.kill(pid, signal.SIGKILL)
    say(
        forked=worker is not None,
        seconds=took,
        alive=zygote.alive,
        children=children,
        abandoned=zygote.abandoned,
    )
