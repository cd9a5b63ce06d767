"""The MXNet tests run in their own environment (.venv-mxnet; see .ci/run), never in the main one.

They share tests/launch_util.py with the main suite, one directory up.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
