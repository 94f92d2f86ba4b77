"""How warnings reach a user of the ``obow`` command (issue 39, finding 6): obow's own as one log line each, without
a source path or a line of code; the libraries' out of sight; Python's display back on request."""

import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from obow import cli
from obow.notices import ObowWarning, show_warning


def raw_format(text: str) -> bool:
    """Whether ``text`` holds a warning in Python's own format (``path.py:LINE: Category: message``)."""
    return re.search(r":\d+: \w*Warning: ", text) is not None


def test_obow_warnings_are_one_log_line_and_library_warnings_are_hidden(tiny_run, obow_cli, tmp_path, monkeypatch):
    """A skipped image and an export without its sidecar are each one WARNING line of obow's log; a library's
    warning raised on the way (here one from the feature extraction) is not shown."""
    import obow.cli.evaluate as cli_eval

    data = tmp_path / "data"
    shutil.copytree(tiny_run.data, data)
    (data / "train" / "class0" / "zz_broken.png").write_bytes(b"not a png")
    export = tmp_path / "backbone.pth"
    obow_cli("export", "--checkpoint", tiny_run.out / "checkpoint.pt", "--out", export)
    Path(f"{export}.json").unlink()
    original = cli_eval._Run.features

    def features_with_a_library_warning(self, *args, **kwargs):
        warnings.warn("TypedStorage is deprecated (a library's internal warning)", UserWarning, stacklevel=1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cli_eval._Run, "features", features_with_a_library_warning)
    args = ["eval", "knn", "--backbone", export, "--stem", "cifar", "--data", data, "--k", "3", "--workers", "0"]
    result = obow_cli(*args)
    assert not raw_format(result.err), result.err
    warned = [line for line in result.err.splitlines() if line.startswith("WARNING ")]
    assert any("has no backbone.pth.json sidecar: recognised from its weights" in line for line in warned), warned
    assert any("1 unreadable image under" in line and "zz_broken.png" in line for line in warned), warned
    assert "TypedStorage" not in result.err and "UserWarning" not in result.err


def test_show_warning_logs_obow_warnings_and_keeps_the_others_at_debug_level(caplog):
    with caplog.at_level(logging.DEBUG, logger="obow"):
        show_warning(ObowWarning("skipped 2 zero-byte image files"), ObowWarning, "/x/folders.py", 107)
        show_warning(UserWarning("an internal detail"), UserWarning, "/torch/x.py", 3)
    (mine, theirs) = caplog.records
    assert (mine.levelname, mine.getMessage()) == ("WARNING", "skipped 2 zero-byte image files")
    assert theirs.levelname == "DEBUG" and "UserWarning: an internal detail (/torch/x.py:3)" in theirs.getMessage()


@pytest.mark.parametrize("python_display", [False, True])
def test_the_command_routes_warnings_unless_python_warnings_are_asked_for(tmp_path, python_display):
    """In a real ``obow`` process: routed by default; ``PYTHONWARNINGS`` (or ``-W``) gives Python's display."""
    # the warnings are given after main() set up the display: main runs a command that fails at once
    code = (
        "import sys, warnings\n"
        "from obow import cli\n"
        "from obow.notices import ObowWarning\n"
        "def cmd(args):\n"
        "    warnings.warn('mine', ObowWarning)\n"
        "    warnings.warn('a library', UserWarning)\n"
        "    return 0\n"
        "import obow.cli as c\n"
        "c.cmd_recipes = cmd\n"
        "sys.exit(c.main(['recipes']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[2])}
    env.pop("PYTHONWARNINGS", None)
    if python_display:
        env["PYTHONWARNINGS"] = "default"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if python_display:
        assert raw_format(proc.stderr) and "a library" in proc.stderr
    else:
        (line,) = proc.stderr.strip().splitlines()
        assert line.endswith(" WARNING mine") and not raw_format(proc.stderr)


def test_held_lines_are_shown_in_order_when_released_and_dropped_after_an_error(caplog):
    """:func:`notices_held`: the ``obow`` log's lines wait for :func:`release_notices` (then come in order, and the
    next ones pass at once); a block that ends with an error drops what it still holds, so the error is alone."""
    from obow.notices import notices_held, release_notices

    log = logging.getLogger("obow")
    with caplog.at_level(logging.INFO, logger="obow"):
        with notices_held():
            log.warning("first")
            log.info("second")
            assert caplog.messages == []
            release_notices()
            assert caplog.messages == ["first", "second"]
            log.warning("third")
        assert caplog.messages == ["first", "second", "third"]
        caplog.clear()
        with pytest.raises(ValueError, match="bad data"), notices_held():
            log.warning("a setting")
            raise ValueError("bad data")
        assert caplog.messages == []
        with notices_held():  # never released: shown when the block ends
            log.warning("kept")
        log.warning("after")
    assert caplog.messages == ["kept", "after"]


def test_counted_nouns_agree_with_their_number():
    from obow.notices import counted

    assert counted(1, "image") == "1 image" and counted(0, "image") == "0 images"
    assert counted(2, "symbolic link") == "2 symbolic links" and counted(12345, "file") == "12,345 files"
    assert counted(1, "box", "boxes") == "1 box" and counted(3, "box", "boxes") == "3 boxes"
