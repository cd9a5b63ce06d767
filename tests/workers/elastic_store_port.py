"""tests/workers/torch_elastic.py, first printing ``STORE_PORT <port>``: the launcher's rendezvous store port."""

import os
import runpy
from pathlib import Path

print(f"STORE_PORT {os.environ['ROUNDEL_RENDEZVOUS_PORT']}", flush=True)
runpy.run_path(str(Path(__file__).with_name("torch_elastic.py")), run_name="__main__")
