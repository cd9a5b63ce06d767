"""Test worker: ``worker.py PIDDIR ACTION0 ACTION1 ...``; rank r performs ACTION<r>.

Every rank first starts a grandchild (``sleep 60``) and writes
``PIDDIR/<rank>.pid`` holding its own pid and the grandchild's. Actions:
``sleep`` (wait 60 s), ``exit:N`` (exit N after 0.3 s), ``sigkill`` (kill
itself with SIGKILL after 0.3 s), ``trap`` (on SIGTERM print a line and exit
0), ``ignore`` (ignore SIGTERM).
"""

import os
import signal
import subprocess
import sys
import time

rank = int(os.environ["ROUNDEL_RANK"])
piddir, action = sys.argv[1], sys.argv[2 + rank]

if action == "trap":
    def on_term(signum, frame):
        print(f"rank {rank} got SIGTERM", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
elif action == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

grandchild = subprocess.Popen(["sleep", "60"])
tmp = os.path.join(piddir, f"{rank}.tmp")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {grandchild.pid}")
os.rename(tmp, os.path.join(piddir, f"{rank}.pid"))
print(f"rank {rank} ready", flush=True)

if action.startswith("exit:"):
    time.sleep(0.3)
    sys.exit(int(action.split(":")[1]))
if action == "sigkill":
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(600):
    time.sleep(0.1)
