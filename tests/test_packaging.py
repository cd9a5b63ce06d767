"""What the distribution declares: its license, and the extra that installs what the examples import."""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what each third-party module the PyTorch examples import comes from (a new one fails the test below)
DISTRIBUTIONS = {"torch": "torch", "sklearn": "scikit-learn", "tqdm": "tqdm", "torch.utils.tensorboard": "tensorboard",
                 "numpy": "numpy"}
PYTORCH_EXAMPLES = ("pytorch_mnist.py", "pytorch_mnist_elastic.py", "pytorch_synthetic_benchmark.py",
                    "progress_bar.py", "datasets.py", "models.py")


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_file_is_the_declared_one():
    assert _project()["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_examples_extra_installs_what_the_pytorch_examples_import():
    project = _project()
    provided = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower()
                for r in project["optional-dependencies"]["examples"] + project["dependencies"]}
    local = {p.stem for p in (ROOT / "examples").glob("*.py")}
    needed = set()
    for name in PYTORCH_EXAMPLES:
        for node in ast.walk(ast.parse((ROOT / "examples" / name).read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for module in modules:
                top = module.split(".")[0]
                if top in local or top in sys.stdlib_module_names or top == "roundel":
                    continue
                key = max((k for k in DISTRIBUTIONS if module == k or module.startswith(k + ".")), key=len,
                          default=None)
                assert key is not None, f"examples/{name} imports {module}: add its distribution to [examples]"
                needed.add(DISTRIBUTIONS[key])
    assert needed <= provided, f"[examples] lacks {sorted(needed - provided)}"
