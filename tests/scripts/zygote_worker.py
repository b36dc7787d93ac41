"""A worker forked by ``zygote_agent.py``: ``OUT CODE`` writes what it finds in
``OUT/facts.json`` and exits with CODE; ``OUT sleep`` says so and sleeps."""

import json
import os
import sys
import time

out, what = sys.argv[1], sys.argv[2]
if what == "sleep":
    open(os.path.join(out, "sleeping"), "w").close()
    time.sleep(120)
    sys.exit(0)
facts = {
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "session_leader": os.getsid(0) == os.getpid(),
    "stdin": sys.stdin.read(),
    "stdin_target": os.readlink("/proc/self/fd/0"),
    "order_env": os.environ.get("ZYGOTE_TEST"),
    "c_env": os.getenv("ZYGOTE_TEST"),
    "fd_env": "XMIG_ZYGOTE_FD" in os.environ,
    "cwd": os.getcwd(),
    "argv": sys.argv,
    "path0": sys.path[0],
    "main": __name__,
    "torch_loaded": "torch" in sys.modules,
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
}
with open(os.path.join(out, "facts.json"), "w") as f:
    json.dump(facts, f)
sys.exit(int(what))
