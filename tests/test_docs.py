"""The documentation holds together: every link of the README and of ``docs/`` resolves to a file (and an
anchor to a heading of it), every setting a page names exists in the schema, every YAML recipe a page shows
loads, ``docs/cli.md`` names every command and option of the ``obow`` parser, and ``docs/api.md`` lists
exactly what ``obow`` exports."""

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

import obow
from obow.cli import build_parser
from obow.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
#: The pages written for readers (not the measurement records under docs/results/).
GUIDES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SETTING = re.compile(r"`((?:model|views|moco|bownet|data|optim|train)\.[a-z_]+)(?=[`=:\s])")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (a link or a key in a code block is code, not a reference, and
    a fence's backticks would pair with an inline span's)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    headings = [line.lstrip("#").strip() for line in _prose(path.read_text()).splitlines() if line.startswith("#")]
    return {_slug(h) for h in headings}


def _links(path: Path) -> list[str]:
    return [m[1] for m in LINK.finditer(_prose(path.read_text()))]


def test_every_guide_page_is_a_few_screens():
    """Each page of docs/ says what a feature does, how to use it and what to expect in under 200 lines; runs,
    tables and measurements live in docs/results/ (not checked), linked."""
    lines = {page.relative_to(ROOT).as_posix(): len(page.read_text().splitlines()) for page in DOCS.glob("*.md")}
    long = {name: n for name, n in lines.items() if n >= 200}
    assert not long, long


def test_the_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/cli.md", "docs/api.md", "docs/results/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:: outside the repository
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.is_file():
            broken.append(f"{target} (no file {path})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no heading #{anchor} in {path.name})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_check_sees_links_and_headings(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A `title`: here\n\n[x](other.md#part) ![pic](a.png) [web](https://x.org)\n```\n[no](code.md)\n```\n"
    )
    assert _links(page) == ["other.md#part", "a.png", "https://x.org"]
    assert _anchors(page) == {"a-title-here"}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


#: The recipe's sections and their dataclasses (``model`` -> ModelConfig, ...).
SECTIONS = {name: cls for name, cls in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(cls)}


@pytest.mark.parametrize("page", GUIDES, ids=[p.relative_to(ROOT).as_posix() for p in GUIDES])
def test_every_setting_named_exists(page):
    """A setting written as `section.key` (alone, or with `=value` / `: value`) is a field of the schema."""
    unknown = []
    for name in sorted(set(SETTING.findall(page.read_text()))):
        section, key = name.split(".")
        if section not in SECTIONS or key not in _fields(SECTIONS[section]):
            unknown.append(name)
    assert not unknown, f"{page.relative_to(ROOT)} names settings the schema does not have: {unknown}"


def test_the_setting_check_reads_settings_and_knows_the_sections():
    assert SETTING.findall("`data.pipeline: auto` and `train.precision=bf16`, `model.arch`") == [
        "data.pipeline",
        "train.precision",
        "model.arch",
    ]
    assert set(SECTIONS) == {"model", "views", "moco", "bownet", "data", "optim", "train"}
    assert "pipeline" in _fields(SECTIONS["data"]) and "no_such_key" not in _fields(SECTIONS["data"])


@pytest.mark.parametrize("page", GUIDES, ids=[p.relative_to(ROOT).as_posix() for p in GUIDES])
def test_every_yaml_recipe_shown_loads(page, tmp_path):
    blocks = [b for b in re.findall(r"^```yaml\n(.*?)^```", page.read_text(), re.S | re.M) if "base:" in b]
    for i, block in enumerate(blocks):
        path = tmp_path / f"recipe{i}.yaml"
        path.write_text(block)
        load_config(str(path))  # raises on an unknown key or a bad value


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("obow",)):
    """Every command of the parser: (its words, its option strings and positional names)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = [
        s
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        for s in a.option_strings
    ]
    yield path, options
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*path, name))


def test_the_cli_page_names_every_command_and_option():
    page = (DOCS / "cli.md").read_text()
    # the words of the page's code spans and blocks: `--k`, `obow tables run NAME --minutes M`, ...
    code = " ".join(FENCE.findall(page) + re.findall(r"`([^`]+)`", _prose(page)))
    named = set(re.split(r"[\s|()\[\],]+", code))
    missing = []
    for words, options in _commands(build_parser()):
        command = " ".join(words)
        missing += [f"command {command}" for word in words[1:] if word not in named]
        missing += [f"{command} {option}" for option in options if option not in named]
    assert not missing, f"docs/cli.md does not name: {missing}"


def test_the_api_page_lists_exactly_what_obow_exports():
    page = (DOCS / "api.md").read_text()
    listed = set()
    for line in page.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            listed |= set(re.findall(r"`(\w+)`", first_cell))
    assert listed == set(obow.__all__), (
        f"in docs/api.md, not exported: {sorted(listed - set(obow.__all__))}; "
        f"exported, not in docs/api.md: {sorted(set(obow.__all__) - listed)}"
    )


def test_the_gpu_page_names_the_data_pipelines_the_schema_allows():
    from obow.config.choices import PIPELINES

    page = (DOCS / "gpu.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)`(?: \(default\))? \|", page, re.M))
    assert rows == set(PIPELINES)
    assert {"data.pipeline", "data.cache_dir", "data.cache_size"} <= set(SETTING.findall(page))
