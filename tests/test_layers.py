"""The package's layers, checked: imports go down (docs/development.md, "The package"), and the light entry points
(`import obow`, `import obow.config`, the command's parser) do not import PyTorch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "obow"

#: The floors of the package, bottom first: a module imports only from the floors below its own
#: (docs/development.md, "The package"). ``obow/__init__``, the facade that names the public objects and holds
#: the version, stands outside them.
FLOORS = (
    ("checks", "files", "notices", "schedules", "distributed", "diagnostics", "graphs", "version"),
    ("backbones",),
    ("config",),
    ("bow", "data"),
    ("weights",),
    ("methods",),
    ("training", "evaluate"),
    ("show",),
    ("experiments",),
    ("cli",),
    ("__main__",),
)
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
#: The package's face (``obow/__init__``): ``from obow import X`` of anything but a subpackage or module imports it.
FACE = "obow"


def face_floor(package: Path = PACKAGE) -> int:
    """The face's floor: that of the highest module it names (``_EXPORTS``, ``_SUBMODULES``), whose names it
    imports on first use."""
    tree = ast.parse((package / "__init__.py").read_text())
    named = [
        value.value
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)
        for value in node.value.values
        if isinstance(value, ast.Constant) and isinstance(value.value, str)
    ]
    assert named, "obow/__init__ names no module"
    return max(FLOOR[room(module)] for module in named)


def imported_modules(path: Path) -> set[str]:
    """Every obow module ``path`` imports, at its top, under ``TYPE_CHECKING`` or inside a function."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from obow import distributed`` imports the module obow.distributed; ``from obow import __version__``
            # the face
            found.update(f"obow.{a.name}" if a.name in FLOOR else FACE for a in node.names if node.module == "obow")
            if node.module != "obow":
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == FACE or m.startswith("obow.")}


def room(path_or_module: str) -> str:
    """The subpackage or top-level module (``methods``, ``schedules``) a file or a module belongs to."""
    return path_or_module.removeprefix("obow.").replace("/", ".").split(".")[0].removesuffix(".py")


def import_graph(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """``(importer, imported)`` rooms -> the imports behind that arrow (``file imports module``)."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "__init__.py":
            continue
        for module in sorted(imported_modules(path)):
            if room(rel) != room(module):
                arrows.setdefault((room(rel), room(module)), []).append(f"{rel} imports {module}")
    return arrows


def find_circle(arrows) -> list[str] | None:
    """One circle of rooms (``[a, b, ..., a]``) in the graph, or None when it has none (depth-first search)."""
    below: dict[str, list[str]] = {}
    for a, b in arrows:
        below.setdefault(a, []).append(b)
    done: set[str] = set()

    def visit(node, path):
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in below.get(node, ()):
            if circle := visit(nxt, path + [node]):
                return circle
        done.add(node)
        return None

    for start in sorted(below):
        if circle := visit(start, []):
            return circle
    return None


def test_every_room_has_a_floor():
    rooms = {room(p.relative_to(PACKAGE).as_posix()) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert rooms == set(FLOOR)


def assert_no_circle(arrows) -> None:
    """No circle in the import graph ``arrows``; else the circle and the import lines that make it."""
    circle = find_circle(arrows)
    assert circle is None, (
        " -> ".join(circle) + ": " + "; ".join(arrows[a, b][0] for a, b in zip(circle, circle[1:], strict=False))
    )


def test_the_package_has_no_import_circle():
    assert_no_circle(import_graph())


def test_imports_go_down_the_floors():
    """No import climbs, not even inside a function, nor to the package's face (``from obow import __version__``
    imports everything the face names)."""
    floor = {**FLOOR, FACE: face_floor()}
    climbs = [why for (a, b), why in import_graph().items() if floor[a] <= floor[b]]
    assert not climbs, climbs


def test_the_checks_see_circles_and_imports_inside_functions(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "methods").mkdir()
    (tmp_path / "config" / "schema.py").write_text("from obow.methods import METHODS\n")
    (tmp_path / "methods" / "obow.py").write_text("def f():\n    from obow.config import ModelConfig\n")
    (tmp_path / "methods" / "rotnet.py").write_text("from obow import distributed as D\n")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "export.py").write_text("from obow import __version__\n")
    arrows = import_graph(tmp_path)
    assert set(arrows) == {
        ("config", "methods"),
        ("methods", "config"),
        ("methods", "distributed"),
        ("weights", FACE),
    }
    assert face_floor() >= FLOOR["methods"] > FLOOR["weights"]  # the face import of weights climbs
    assert find_circle(arrows) in (["config", "methods", "config"], ["methods", "config", "methods"])
    assert find_circle({k: v for k, v in arrows.items() if k != ("config", "methods")}) is None


def test_light_entry_points_do_not_import_torch():
    code = (
        "import sys, obow, obow.config, obow.bow, obow.methods, obow.data, obow.training; "
        "from obow.cli import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ------------------------------------------------------------------------------------- inside obow.training

TRAINING = PACKAGE / "training"

#: The floors of obow.training, bottom first (docs/development.md): the run (its folder and settled settings),
#: what the step's modes share, the modes and the compile watch, the step's package (its call and
#: ``build_step``), the parts the loop is built from, the loop. A module imports only from floors below its own,
#: except the run's modules, which import one another (without a circle).
TRAINING_FLOORS = (
    (
        "run",
        "run.state",
        "run.signals",
        "run.random_states",
        "run.folder",
        "run.settings_check",
        "run.data_check",
        "run.checkpoints",
        "run.lock",
        "run.logger",
        "run.guards",
        "run.settle",
        "run.busy",
        "run.threads",
        "run.precision",
    ),
    ("step.shared",),
    ("step.eager", "step.compiled", "step.graphed", "step.watch"),
    ("step",),
    ("step_cost",),
    ("build", "cost"),
    ("loop",),
)
TRAINING_FLOOR = {m: i for i, modules in enumerate(TRAINING_FLOORS) for m in modules}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``obow.training.step.shared`` for ``.../obow/training/step/shared.py``; a package for its ``__init__``."""
    parts = ("obow", *path.relative_to(package).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def training_modules(package: Path = PACKAGE) -> list[str]:
    return sorted(module_name(p, package) for p in (package / "training").rglob("*.py"))


def training_imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """The obow.training modules ``path`` imports, anywhere in it; ``from obow.training.run import precision``
    imports the module ``obow.training.run.precision`` (a package's ``__init__`` runs first, as for any dotted
    import; it is not counted as imported)."""
    known = set(training_modules(package))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & known
            found.update(submodules or {node.module})
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known}


def training_graph(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """``(importer, imported)`` modules of obow.training (names without ``obow.training.``) -> the import."""
    arrows = {}
    for path in sorted((package / "training").rglob("*.py")):
        importer = module_name(path, package).removeprefix("obow.training").removeprefix(".")
        for module in training_imports(path, package):
            imported = module.removeprefix("obow.training").removeprefix(".")
            if imported and imported != importer:
                arrows[importer, imported] = [f"{path.relative_to(package).as_posix()} imports {module}"]
    return arrows


def test_every_training_module_has_a_floor():
    names = {m.removeprefix("obow.training").removeprefix(".") for m in training_modules()} - {""}
    assert names == set(TRAINING_FLOOR)


def test_training_has_no_import_circle():
    assert_no_circle(training_graph())


def test_training_imports_go_down():
    """The shared module imports no mode, a mode no other mode nor the step's package, the step nothing of the
    loop, the run nothing of the step."""
    arrows = training_graph()
    run = TRAINING_FLOOR["run"]
    climbs = [
        why
        for (a, b), [why] in arrows.items()
        if TRAINING_FLOOR[a] <= TRAINING_FLOOR[b] and not TRAINING_FLOOR[a] == TRAINING_FLOOR[b] == run
    ]
    assert not climbs, climbs


def test_the_training_checks_see_a_mode_imported_by_the_shared_module(tmp_path):
    """The static check is not blind: the layout before the split (a shared function in a mode's module, a mode
    imported inside a function) is a circle and a climb."""
    step = tmp_path / "training" / "step"
    step.mkdir(parents=True)
    (tmp_path / "training" / "__init__.py").write_text("")
    (step / "__init__.py").write_text("")
    (step / "shared.py").write_text("def build():\n    from obow.training.step import compiled\n")
    (step / "compiled.py").write_text("from obow.training.step.shared import build\n")
    arrows = training_graph(tmp_path)
    assert set(arrows) == {("step.shared", "step.compiled"), ("step.compiled", "step.shared")}
    assert find_circle(arrows) is not None
    assert TRAINING_FLOOR["step.shared"] < TRAINING_FLOOR["step.compiled"]


@pytest.mark.slow  # a fresh process imports torch and its libraries: about 10 s on 2 cores
def test_every_training_module_imports_first_in_a_fresh_process():
    """Each obow.training module imported first (nothing of obow loaded yet; it imports what it needs), then all
    of them forwards and backwards: an import circle that only bites in some order fails here. One process: torch
    stays loaded, obow's modules are forgotten before each."""
    modules = training_modules()
    code = (
        "import importlib, sys, torch\n"
        f"modules = {modules!r}\n"
        "orders = [[first] for first in modules] + [modules, modules[::-1]]\n"
        "for order in orders:\n"
        "    for name in [n for n in sys.modules if n == 'obow' or n.startswith('obow.')]:\n"
        "        del sys.modules[name]\n"
        "    for name in order:\n"
        "        importlib.import_module(name)\n"
        "print(len(orders))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(len(modules) + 2)


# ------------------------------------------------------------- the training loop and the model: Method's calls only


def names_a_model(node: ast.expr) -> bool:
    """Whether ``node`` names a model: ``model``, ``step_model``, ``run.model``, ``self.model``, ..."""
    if isinstance(node, ast.Name):
        return node.id.endswith("model")
    return isinstance(node, ast.Attribute) and node.attr.endswith("model")


def model_pokes(source: str) -> list[str]:
    """The lines of ``source`` that set, delete or probe an attribute of a model (``model.x = ...``,
    ``getattr(model, ...)``, ``hasattr``, ``setattr``, ``delattr``) rather than call what the method contract
    (``obow.methods.base.Method``) offers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        while any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):
            targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        if any(isinstance(t, ast.Attribute) and names_a_model(t.value) for t in targets):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and node.args
            and names_a_model(node.args[0])
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_training_sets_and_probes_nothing_on_the_model():
    """What a step needs from the loop goes through ``Method.begin_step``, a method's own count through
    ``Method.realign_iteration``, a compiled step's tensors through ``use_momentum_input`` and
    ``write_host_inputs``: nothing in obow.training sets an attribute on a model or probes one."""
    pokes = {
        path.relative_to(PACKAGE).as_posix(): found
        for path in sorted(TRAINING.rglob("*.py"))
        if (found := model_pokes(path.read_text()))
    }
    assert not pokes, pokes


def test_the_poke_check_sees_sets_and_probes():
    source = (
        "def f(run, model, self):\n"
        "    run.model.diagnose = True\n"
        "    model.a, model.b = 1, 2\n"
        "    self.model.c += 1\n"
        "    buffer = getattr(model, 'iteration', None)\n"
        "    hasattr(run.step_model, 'x')\n"
        "    model.begin_step(True, 3)\n"
        "    x = model.student\n"
        "    getattr(record, 'shape')\n"
    )
    assert [line.split(":")[0] for line in model_pokes(source)] == [f"line {n}" for n in (2, 3, 4, 5, 6)]


def test_no_training_file_is_over_400_lines():
    lines = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in TRAINING.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > 400}
    assert not long, long
