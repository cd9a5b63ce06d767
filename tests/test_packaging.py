"""What the distribution declares: its license, framework ranges that keep a user's own builds, and the
extra that installs what the examples import."""

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


FRAMEWORKS = ("torch", "tensorflow", "tensorflow-cpu", "keras", "jax", "jaxlib", "mxnet")


def _requirements():
    from packaging.requirements import Requirement
    project = _project()
    listed = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [Requirement(r) for r in listed]


def test_no_framework_is_pinned_to_one_version():
    for requirement in _requirements():
        if requirement.name.lower() in FRAMEWORKS:
            operators = {spec.operator for spec in requirement.specifier}
            assert operators and operators <= {">=", ">", "<", "!="}, \
                f"{requirement} pins a framework: ask for a range, so that a user's own build is kept"


@pytest.mark.parametrize("installed", ["2.13.0+cpu", "2.14.1", "2.6.0+cu124", "2.6.0a0+ecf3bae40a.nv25.01",
                                       "2.8.0a0+5228986c39.nv25.06", "3.0.0"])
def test_the_torch_range_keeps_builds_users_have(installed):
    # pip counts an installed pre-release (NGC's 2.6.0a0+...nv25.01) as meeting a range: prereleases=True
    (torch,) = [r for r in _requirements() if r.name == "torch"]
    assert torch.specifier.contains(installed, prereleases=True), f"torch {installed} would be replaced"


def test_the_constraints_pin_the_tested_builds_within_the_ranges():
    from packaging.requirements import Requirement
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pin = Requirement(line)
            (spec,) = pin.specifier
            assert spec.operator == "==", f"constraints.txt: {line} is not one version"
            pins[pin.name] = spec.version
    assert pins["torch"] == "2.13.0" and pins["tensorflow-cpu"] == "2.21.0"
    for requirement in _requirements():
        if requirement.name in pins:
            assert requirement.specifier.contains(pins[requirement.name]), \
                f"constraints.txt pins {requirement.name}=={pins[requirement.name]} outside {requirement}"
