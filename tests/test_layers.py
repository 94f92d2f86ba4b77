"""The package's layers, checked: imports go down (docs/development.md, "The package"), and the light entry points
(`import obow`, `import obow.config`, the command's parser) do not import PyTorch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "obow"

#: What each subpackage may not import (directly or lazily inside a function): the layers above it.
FORBIDDEN = {
    "bow": ("obow.methods", "obow.training", "obow.evaluate", "obow.weights", "obow.experiments", "obow.cli"),
    "data": ("obow.methods", "obow.training", "obow.evaluate", "obow.weights", "obow.experiments", "obow.cli"),
    "methods": ("obow.training", "obow.evaluate", "obow.experiments", "obow.cli", "obow.show"),
    "training": ("obow.evaluate", "obow.experiments", "obow.cli", "obow.show"),
    "weights": ("obow.training", "obow.evaluate", "obow.experiments", "obow.cli", "obow.show"),
    "evaluate": ("obow.experiments", "obow.cli"),
    "config": ("obow.evaluate", "obow.weights", "obow.experiments", "obow.cli", "obow.show"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_down_the_layers(package):
    offences = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module.startswith(FORBIDDEN[package])
    ]
    assert not offences, offences


def test_the_check_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from obow.evaluate.knn import knn_accuracy\n")
    assert "obow.evaluate.knn" in imported_modules(sample)


def test_light_entry_points_do_not_import_torch():
    code = (
        "import sys, obow, obow.config, obow.bow, obow.methods, obow.data, obow.training; "
        "from obow.cli import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
