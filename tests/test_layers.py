"""The package's layers: imports only go down, adapters stay apart, and nothing hides a cycle.

    faces      roundel.tensorflow   (TensorFlow 2; Horovod's names for the Keras adapter make it stand on Keras's)
               roundel.keras        (Keras 3 on TensorFlow or PyTorch; on TensorFlow through roundel.tfops)
    adapters   roundel.torch · roundel.tfops · roundel.jax · roundel.mxnet   (and roundel.timeline, a tool)
               (roundel.tfops: TensorFlow tensors' collectives as TensorFlow ops)
    core       roundel.common   (its control wire, roundel.common.control, stands below its engine:
                                 the standard library and the ground modules only)
    below it   roundel.transport · roundel.rendezvous               (not each other)
    ground     roundel.errors · roundel.excepthook · roundel.ops · roundel.authwire · roundel.retry ·
               the roundel package itself
    trainers   roundel.lightning (a trainer's strategy on top of the torch adapter)
    launcher   roundel.runner (may use everything but the adapters; no worker needs it)
    drivers    roundel.spark · roundel.ray (launchers inside Spark and on Ray: use roundel.runner)

Read from the source with ``ast`` (every import, at module level or inside a
function), and checked in fresh interpreters for what importing an adapter loads.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "roundel"

GROUND = ("roundel", "roundel.authwire", "roundel.errors", "roundel.excepthook", "roundel.ops", "roundel.retry")
LEVELS = {
    "ground": 0,
    "roundel.transport": 1, "roundel.rendezvous": 1,
    "roundel.common": 2,
    "roundel.torch": 3, "roundel.tfops": 3, "roundel.timeline": 3,
    "roundel.keras": 4, "roundel.tensorflow": 5,
    "roundel.jax": 3,
    "roundel.mxnet": 3,
    "roundel.lightning": 4,
    "roundel.runner": 4,
    "roundel.spark": 5,
    "roundel.ray": 5,
}
ADAPTERS = ("roundel.torch", "roundel.tfops", "roundel.tensorflow", "roundel.keras", "roundel.jax", "roundel.mxnet")

# (importing module, imported package or module) allowed across packages of one layer: none. (roundel.keras
# and roundel.tensorflow were: Keras used TensorFlow's collectives, and TensorFlow's Horovod names the Keras
# adapter. The collectives now sit below both in roundel.tfops, and roundel.tensorflow stands on roundel.keras.)
SIDEWAYS: set[tuple[str, str]] = set()
# Inside roundel.common, the engine and the control wire are rooms of their own; adapters use only the face.
ROOMS = ("roundel.common.engine", "roundel.common.control")
# The control wire (its records, messages, codec and channel) stands below the engine and the face: of roundel
# it imports only itself and these ground modules, which need nothing but the standard library (the frame
# tags, the reduction operators, the errors, the retry pauses); of the rest, only the standard library (no NumPy, no torch).
CONTROL = "roundel.common.control"
CONTROL_MAY_IMPORT = ("roundel.authwire", "roundel.errors", "roundel.ops", "roundel.retry")
# The top-level package's lazy attributes (roundel.run) reach the launcher.
LAZY = {("roundel", "roundel.runner.run_api")}
# Imports inside a function, each for a reason other than a cycle.
IN_FUNCTION = {
    ("roundel", "roundel.runner.run_api"): "roundel.run loads the launcher only when used",
    ("roundel.transport.factory", "roundel.transport.mpi"): "mpi4py is optional and starts MPI when imported",
    ("roundel.timeline.__main__", "roundel.timeline.plot"): "matplotlib only when a plot is asked for",
    ("roundel.keras.core", "roundel.tfops.gradients"): "TensorFlow backend only",
    ("roundel.keras.elastic", "roundel.tfops.tf_errors"): "TensorFlow backend only",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _package(module: str) -> str:
    if module in GROUND:
        return "ground"
    return max((p for p in LEVELS if module == p or module.startswith(p + ".")), key=len, default="unknown")


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported roundel module, whether the import is inside a function) for each import in ``module``."""
    tree = ast.parse(MODULES[module].read_text())
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names if a.name.split(".")[0] == "roundel")
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{module}: relative import (use absolute roundel.* imports)"
                if child.module and child.module.split(".")[0] == "roundel":
                    for alias in child.names:
                        target = f"{child.module}.{alias.name}"
                        found.append((target if target in MODULES else child.module, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


EDGES = {m: _imports(m) for m in MODULES}


def test_the_layout_is_what_this_test_knows():
    assert len(MODULES) > 80
    unknown = [m for m in MODULES if _package(m) == "unknown"]
    assert not unknown, f"modules outside every layer: {unknown}"
    assert "roundel.common.collectives" in MODULES and "roundel.rendezvous.bootstrap" in MODULES


def test_imports_only_go_down():
    wrong = []
    for module, imports in EDGES.items():
        package = _package(module)
        for target, _ in imports:
            other = _package(target)
            if other == package or (module, target) in LAZY or any(
                    module == m and (target == t or target.startswith(t + ".")) for m, t in SIDEWAYS):
                continue
            if LEVELS[other] >= LEVELS[package]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(wrong)


def test_adapters_use_only_the_face_of_roundel_common():
    wrong = [f"{m} -> {t}" for m, imports in EDGES.items() if _package(m) in ADAPTERS + ("roundel.timeline",)
             for t, _ in imports if any(t == room or t.startswith(room + ".") for room in ROOMS)]
    assert not wrong, "adapters reaching into the engine or the control wire:\n" + "\n".join(wrong)


def _in_control(module: str) -> bool:
    return module == CONTROL or module.startswith(CONTROL + ".")


def test_the_control_wire_stands_below_the_engine():
    control = [m for m in MODULES if _in_control(m)]
    assert "roundel.common.control.records" in control and "roundel.common.control.codec" in control
    wrong = [f"{m} -> {t}" for m in control for t, _ in EDGES[m]
             if not _in_control(t) and not any(t == g or t.startswith(g + ".") for g in CONTROL_MAY_IMPORT)]
    assert not wrong, "the control wire reaching above itself:\n" + "\n".join(wrong)
    outside = []
    for module in control:
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            outside += [f"{module} -> {name}" for name in names
                        if name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != "roundel"]
    assert not outside, "the control wire importing beyond the standard library:\n" + "\n".join(outside)


def test_importing_the_control_wire_loads_neither_the_engine_nor_numpy_nor_torch():
    code = ("import sys\nimport roundel.common.control.channel, roundel.common.control.codec\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch') or "
            "m.startswith('roundel.') and not m.startswith('roundel.common.control'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    beyond = {m if m.startswith("roundel.") else m.split(".")[0] for m in result.stdout.split()} - \
        {"roundel.common", *GROUND}
    assert not beyond, f"importing the control wire loaded {sorted(beyond)}"


def test_launcher_imports_no_adapter():
    wrong = [f"{m} -> {t}" for m, imports in EDGES.items() if _package(m) == "roundel.runner"
             for t, _ in imports if _package(t) in ADAPTERS]
    assert not wrong, wrong


def test_imports_inside_functions_are_the_listed_ones():
    found = {(m, t) for m, imports in EDGES.items() for t, inside in imports if inside}
    assert found == set(IN_FUNCTION), (f"not listed: {sorted(found - set(IN_FUNCTION))}; "
                                       f"listed but gone: {sorted(set(IN_FUNCTION) - found)}")


def _assert_no_cycle(graph: dict[str, set[str]], what: str) -> None:
    """Fail naming the first cycle found in ``graph`` (node -> the nodes it imports)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(f"{what}: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_cycle_among_module_level_imports():
    graph = {m: {t for t, inside in imports if not inside and t in MODULES and t != m}
             for m, imports in EDGES.items()}
    # a package's __init__ importing its own submodules is how packages re-export; drop those edges
    graph = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in graph.items()}
    _assert_no_cycle(graph, "import cycle")


def test_no_cycle_between_packages():
    """Every import, inside functions too, as an edge between the packages of LEVELS: none comes back round
    (roundel.keras and roundel.tensorflow once did). The top-level package's lazy attributes aside."""
    graph: dict[str, set[str]] = {}
    for module, imports in EDGES.items():
        for target, _ in imports:
            if (module, target) not in LAZY and _package(module) != _package(target):
                graph.setdefault(_package(module), set()).add(_package(target))
    assert {"roundel.keras", "roundel.tfops"} <= graph["roundel.tensorflow"], graph["roundel.tensorflow"]
    _assert_no_cycle(graph, "import cycle between packages")


def _loaded_after(statement: str) -> str:
    code = (f"import sys, torch\nthreads = torch.get_num_threads()\n{statement}\n"
            "print(sorted({m.rsplit('.', 1)[0] if m.count('.') > 1 else m for m in sys.modules "
            "if m.startswith('roundel')}), torch.get_num_threads() == threads, 'tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("adapter", ["roundel.tensorflow", "roundel.keras"])
def test_tensorflow_adapters_load_no_other_adapter_and_leave_torch_threads_alone(adapter):
    line = _loaded_after(f"import {adapter}")
    assert "roundel.torch" not in line and "roundel.runner" not in line, line
    assert line.endswith("True True"), f"importing {adapter} changed torch's thread count: {line}"


def test_torch_adapter_loads_neither_tensorflow_nor_the_launcher():
    line = _loaded_after("import roundel.torch")
    assert "roundel.tensorflow" not in line and "roundel.keras" not in line and "roundel.runner" not in line, line
    assert line.endswith("True False"), line


def test_jax_adapter_loads_no_other_adapter_nor_the_launcher_and_leaves_torch_threads_alone():
    line = _loaded_after("import roundel.jax")
    assert not any(f"'{p}" in line for p in ("roundel.torch", "roundel.tensorflow", "roundel.keras",
                                              "roundel.runner")), line
    assert line.endswith("True False"), line
