"""The README's commands keep working: every shell command of its code blocks is either run here on tiny images
(the ``obow`` flow on your own folder: recipes, pretrain, evaluate, export, the feature-extraction example) or
checked without running (each ``obow`` subcommand and option exists, each ``key=value`` is a setting of the
schema with a valid value, each recipe named exists, each file of the repository named exists; ``pip``,
``pytest``, ``ruff`` and ``mypy`` lines name what ``pyproject.toml`` and ``tests/conftest.py`` provide). A command of a
kind this file does not know fails the suite, so a new README command gets a check when it is written."""

import argparse
import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, before it joined the standard library
    import tomli as tomllib

import obow
from obow.cli import build_parser, parse_args
from obow.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONFTEST = (ROOT / "tests" / "conftest.py").read_text()

#: Changes that make the README's pretraining command a few seconds' run on the test's images (24 of 32 px).
TINY = ["optim.epochs=1", "data.batch_size=8", "data.num_workers=0"]
#: The folders the README's own-images commands name; the flow test writes the first and the others appear.
IMAGES, RUN = "my_images", "runs/mine"


def code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [m[2] for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m[1] in languages]


def commands(block: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, ``a && b`` split in two."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(words[:cut])
            words = words[cut + 1 :]
    return found


COMMANDS = [c for block in code_blocks(README, ("bash", "sh", "shell")) for c in commands(block)]


def kind(argv: list[str]) -> str:
    if argv[0] == "obow" or argv[:3] == ["python", "-m", "obow"]:
        return "obow"
    if argv[:3] == ["python", "-m", "pytest"]:
        return "pytest"
    if argv[:3] == ["python", "-m", "venv"]:
        return "venv"
    if argv[0] == "python" and argv[1].endswith(".py"):
        return "script"
    return {"pip": "pip", "source": "source", "ruff": "ruff", "mypy": "mypy"}.get(argv[0], "unknown")


def obow_args(argv: list[str]) -> list[str]:
    return argv[1:] if argv[0] == "obow" else argv[3:]


def ids(argv: list[str]) -> str:
    return " ".join(argv)[:60]


def test_the_readme_has_the_commands_a_newcomer_needs():
    found = {" ".join(c) for c in COMMANDS}
    for expected in ("pip install -e .[dev]", "obow demo", "python -m pytest -q", "python -m pytest -q --runslow"):
        assert expected in found, f"README: no `{expected}` in a code block"
    subcommands = {obow_args(c)[0] for c in COMMANDS if kind(c) == "obow" and obow_args(c)}
    assert {"demo", "recipes", "pretrain", "eval", "export"} <= subcommands


def test_the_command_reader_joins_lines_and_drops_comments():
    block = 'obow pretrain --data d \\\n    --out "runs/a b"   # a comment\nruff check . && ruff format --check .\n'
    assert commands(block) == [
        ["obow", "pretrain", "--data", "d", "--out", "runs/a b"],
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
    ]


@pytest.mark.parametrize("argv", COMMANDS, ids=ids)
def test_every_command_is_of_a_kind_this_file_checks(argv):
    assert kind(argv) != "unknown", f"README command {' '.join(argv)!r}: add its check to tests/test_readme.py"


def check_obow(argv: list[str]) -> None:
    """``argv`` parses with the ``obow`` parser; its recipe exists and its ``key=value`` changes load with it."""
    words = obow_args(argv)
    parser = build_parser()
    if "--help" in words or "-h" in words:
        with pytest.raises(SystemExit) as exit_:
            parse_args(parser, words)
        assert exit_.value.code == 0
        return
    try:
        args = parse_args(parser, words)
    except SystemExit as exit_:
        raise AssertionError(f"README: `{' '.join(argv)}` does not parse (exit {exit_.code})") from None
    recipe = getattr(args, "config", None) or getattr(args, "recipe", None)
    if words[0] == "demo":
        recipe = args.recipe or ("demo" if args.dataset == "digits" else "demo_cifar10")
    if words[0] == "recipes" and args.name:
        recipe = args.name
    if recipe is not None or getattr(args, "overrides", None):
        load_config(recipe, list(getattr(args, "overrides", [])))  # unknown recipe, key or value: an error


def check_repository_paths(argv: list[str]) -> None:
    for word in argv:
        if re.match(r"^(examples|docs|benchmarks|tests|src)/", word):
            assert (ROOT / word).exists(), f"README: `{' '.join(argv)}` names {word}, which does not exist"


@pytest.mark.parametrize("argv", COMMANDS, ids=ids)
def test_every_command_parses(argv):
    check_repository_paths(argv)
    what = kind(argv)
    if what == "obow":
        check_obow(argv)
    elif what == "script":
        script = ROOT / argv[1]
        assert script.is_file(), f"README: {argv[1]} does not exist"
        defined = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", script.read_text()))
        unknown = [w for w in argv[2:] if w.startswith("--") and w not in defined]
        assert not unknown, f"README: {argv[1]} has no option {unknown}"
        ast.parse(script.read_text())
    elif what == "pip":
        assert argv[1] == "install"
        if "-e" in argv:
            target = argv[argv.index("-e") + 1]
            path, _, extras = target.partition("[")
            assert (ROOT / path / "pyproject.toml").is_file()
            assert set(extras.rstrip("]").split(",")) <= set(PYPROJECT["project"]["optional-dependencies"])
        else:
            wanted = [w for w in argv[2:] if not w.startswith("-") and not w.startswith("http")]
            declared = {re.split(r"[<>=!\[ ]", d)[0] for d in PYPROJECT["project"]["dependencies"]}
            assert wanted and set(wanted) <= declared, f"README installs {wanted}, pyproject declares {declared}"
    elif what == "pytest":
        for option in (w for w in argv[3:] if w.startswith("--")):
            assert f'addoption("{option}"' in CONFTEST, f"README: pytest {option} is not an option of conftest.py"
        assert all(w in ("-q", "-x", "-v") or w.startswith("--") for w in argv[3:])
    elif what == "ruff":
        assert any(d.startswith("ruff") for d in PYPROJECT["project"]["optional-dependencies"]["dev"])
    elif what == "mypy":  # installed by the dev extra, told by pyproject.toml what to check
        assert any(d.startswith("mypy") for d in PYPROJECT["project"]["optional-dependencies"]["dev"])
        assert argv == ["mypy"] and PYPROJECT["tool"]["mypy"]["files"] == ["src/obow"]
    elif what == "venv":
        folder = argv[3]
        sources = [c for c in COMMANDS if kind(c) == "source"]
        assert sources and all(c[1] == f"{folder}/bin/activate" for c in sources)
    elif what == "source":
        assert argv[1].endswith("/bin/activate")


INLINE = sorted({m for m in re.findall(r"`((?:obow|python -m obow) [^`]*)`", README)})


@pytest.mark.parametrize("text", INLINE)
def test_every_inline_obow_command_names_a_real_command(text):
    """Inline `obow ...` spans of the prose: the subcommands named exist, and a span with options (a whole
    command, e.g. `obow show run runs/mine --out curves.png`) parses."""
    words = obow_args(shlex.split(text))
    parser = build_parser()
    for word in words:
        if word.startswith("-") or "=" in word:
            break
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            break
        assert word in actions[0].choices, f"README: `{text}`: no command {word!r}"
        parser = actions[0].choices[word]
    if any(w.startswith("-") for w in words):
        check_obow(shlex.split(text))


def test_the_python_example_uses_public_names_and_compiles():
    blocks = code_blocks(README, ("python",))
    assert blocks
    for block in blocks:
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "obow":
                assert {a.name for a in node.names} <= set(obow.__all__)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "load_config":
                load_config(node.args[0].value)


def own_images_flow() -> list[list[str]]:
    """The README's commands on your own folder, in its order: those that name ``my_images`` or ``runs/mine``."""
    return [c for c in COMMANDS if any(IMAGES in w or RUN in w for w in c)]


@pytest.mark.slow
def test_the_own_images_flow_runs_on_tiny_images(tmp_path, monkeypatch, write_images, obow_cli):
    """Pretrain (with :data:`TINY` appended), evaluate beside the random-init baseline (``--with-random-init``),
    export, and the feature extraction example, as the README writes them, in a folder where ``my_images`` holds
    24 training and 6 validation images; then ``obow recipes`` and ``obow recipes cifar10_fast`` as written."""
    write_images(tmp_path / IMAGES / "train", per_class=12, classes=2, size=32, seed=0)
    write_images(tmp_path / IMAGES / "val", per_class=3, classes=2, size=32, seed=1)
    monkeypatch.chdir(tmp_path)
    flow = own_images_flow()
    assert [obow_args(c)[:2] for c in flow if kind(c) == "obow"] == [
        ["pretrain", "--config"],
        ["eval", "knn"],
        ["export", "--checkpoint"],
    ]
    outputs = []
    for argv in flow:
        if kind(argv) == "obow":
            extra = TINY if obow_args(argv)[0] == "pretrain" else []
            outputs.append(obow_cli(*obow_args(argv), *extra).out)
        else:
            assert kind(argv) == "script", argv
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
            script = [sys.executable, str(ROOT / argv[1]), *argv[2:]]
            done = subprocess.run(script, capture_output=True, text=True, env=env, timeout=120)
            assert done.returncode == 0, done.stderr
            outputs.append(done.stdout)
    run = tmp_path / RUN
    assert (run / "checkpoint.pt").is_file() and (run / "eval" / "knn.json").is_file()
    assert json.loads((run / "eval" / "knn_random_init.json").read_text())["source"]["kind"] == "random_init"
    assert (run / "backbone.pth").is_file() and (run / "backbone.pth.json").is_file()
    assert "logistic regression on the pretrained features" in outputs[-1]
    assert "6 test images" in outputs[-1]

    listed = [c for c in COMMANDS if kind(c) == "obow" and obow_args(c)[:1] == ["recipes"]]
    assert len(listed) == 2
    names = obow_cli(*obow_args(listed[0])).out
    assert "cifar10_fast" in names and "imagenette_fast" in names
    one = obow_cli(*obow_args(listed[1])).out
    assert "description: CIFAR-10 in an hour of CPU" in one
