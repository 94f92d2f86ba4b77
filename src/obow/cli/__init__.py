"""The ``obow`` command.

obow demo [--dataset cifar10]                    # built-in demo: no download, a few minutes on a CPU
obow pretrain --config imagenette_resnet18 --data DIR --out runs/x [key=value ...]
obow recipes [NAME]                              # list the built-in recipes, or print one
obow eval knn|linear|fewshot|finetune --checkpoint runs/x/checkpoint.pt --data DIR
obow export --checkpoint runs/x/checkpoint.pt --out backbone.pth --format torchvision
obow show words|run|neighbours|views ...         # pictures of what a run learned, and of its views
obow import-official FILE --out CKPT             # the authors' released weights as an obow checkpoint
obow tables [run NAME --data DIR --minutes M]    # the paper's Tables 1-5 and MoCo v2 comparison, measured

The parser imports nothing heavy (no PyTorch), so that ``obow --help`` and argument errors are instant; each
command imports what it needs when it runs. ``key=value`` overrides may stand anywhere on the line.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from obow.notices import notices_held, route_warnings

#: Errors that only a write meets: a read-only file system, a full disk or quota, a file size limit.
WRITE_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

#: ``obow demo --dataset`` choices, the keys of :data:`obow.experiments.demo.DATASETS` (spelt out here so that
#: the parser imports nothing; a test keeps the two equal).
DEMO_DATASETS = ("digits", "cifar10")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    route_warnings()  # obow's warnings as one log line each; the libraries' out of sight (obow.notices)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    # A log line (and so a warning) on the console clears the progress bar first instead of being glued onto it;
    # tqdm's redirect adds a console handler where there is none (pytest's), so it is used only where there is one.
    console = any(
        isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr) for h in logging.root.handlers
    )
    try:
        with logging_redirect_tqdm() if console else contextlib.nullcontext():
            return int(args.func(args) or 0)
    except (ValueError, RuntimeError, MemoryError) as err:  # ConfigError is a ValueError, WriteError a RuntimeError
        line = out_of_memory_line(err) or one_line(err)
        tqdm.write(f"obow: error: {line}", file=sys.stderr)  # on its own line, a bar still open or not
        return 2
    except BrokenPipeError as err:
        if stdout_closed():  # `obow recipes | head`: the reader has what it wanted; nothing to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the flush at exit would raise again)
            return 141  # what a process killed by SIGPIPE reports
        tqdm.write(f"obow: error: {os_error_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:  # a file operation that no command wraps with its own message
        tqdm.write(f"obow: error: {os_error_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def stdout_closed() -> bool:
    """Whether the reader of this process's standard output has gone (a pipe into ``head`` that has its lines)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):  # a closed or odd stream: not a pipe's reader gone
        return False
    try:
        import select

        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR)
        return any(event & select.POLLERR for _, event in poller.poll(0))  # a pipe whose reader closed
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no file descriptor
        return False


def one_line(err: BaseException) -> str:
    """The message of ``err``, without the worker traceback that a ``DataLoader`` worker's error carries."""
    text = str(err)
    if "Original Traceback" in text:  # torch re-raises a worker's error with its traceback in the message
        last = text.rstrip().splitlines()[-1]
        text = last.partition(": ")[2] or last
    return text


def out_of_memory_line(err: BaseException) -> str | None:
    """One line for an out-of-memory error that no command said in its own words (those that train or evaluate
    name what lowers their memory): Python's ``MemoryError``, which would otherwise be a traceback, or PyTorch's
    allocator's; ``None`` for any other error."""
    asked: str | None = None
    if isinstance(err, MemoryError):
        asked = ""
    elif "torch" in sys.modules:  # an allocator's error can only come from a command that imported PyTorch
        from obow.training.cost import allocation_failed

        asked = allocation_failed(err)
    if asked is None:
        return None
    return (
        f"out of memory{asked}: this command needs more memory than is free here; close other programs, or run it "
        "on a machine with more memory"
    )


def os_error_line(err: OSError) -> str:
    """``FILE: CAUSE`` for an ``OSError`` (``cannot write FILE: CAUSE`` when the cause is one only writes meet)."""
    from obow.files import write_failure_cause

    if err.filename is None:
        return str(err)
    path = Path(os.fsdecode(err.filename))
    if err.errno in WRITE_ERRNOS:
        return f"cannot write {path}: {write_failure_cause(path, err)}"
    return f"{path}: {err.strerror}"


#: A ``key=value`` override: a dotted setting name, ``=``, then anything (a path such as ``runs/a=1`` is not one).
OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes options by their full names only (``--minute`` is not ``--minutes``); its
    sub-commands' parsers are of this class too (``add_subparsers`` makes them of the parser's class)."""

    def __init__(self, *args: Any, allow_abbrev: bool = False, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = allow_abbrev
        super().__init__(*args, **kwargs)


def takes_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """Whether the command that ``argv`` names (``pretrain``, ``tables run``, ...) has ``key=value`` overrides."""
    for token in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            parser = subs[0].choices[token]
        elif not token.startswith("-"):
            break
    return any(action.dest == "overrides" for action in parser._actions)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args``, except that ``key=value`` overrides may stand anywhere on the line.

    argparse fills a positional list once, so ``--out X a=1 --config R b=2`` would leave ``b=2`` unrecognised,
    and an option of several values takes what follows it (``--seeds 0 optim.lr=0.1`` would read the override
    as a seed): for a command with overrides, every ``key=value`` item is taken out of the line before it is
    parsed and joins the command's overrides, in its order. Any other leftover is an error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if takes_overrides(parser, argv):
        overrides = [item for item in argv if OVERRIDE.match(item)]
        args = parser.parse_args([item for item in argv if not OVERRIDE.match(item)])
        if args.overrides:  # what the positional list took is no override
            parser.error(f"unrecognized arguments: {' '.join(args.overrides)}")
        args.overrides = overrides
        return args
    return parser.parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    from obow import __version__
    from obow.cli.evaluate import add_eval_parser
    from obow.cli.show import add_show_parser
    from obow.cli.weights import add_export_parser, add_import_parser

    parser = Parser(prog="obow", description="OBoW self-supervised pretraining and evaluation")
    parser.add_argument("--version", action="version", version=f"obow {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    p = sub.add_parser("pretrain", help="pretrain a network with OBoW on a folder of images")
    p.add_argument("--config", help="a built-in recipe name (see `obow recipes`) or a YAML file")
    p.add_argument("--data", help="training images: class folders or any folder tree (sets data.path)")
    p.add_argument("--val", help="labelled validation images for the kNN monitor (sets data.val_path)")
    p.add_argument("--out", help="output folder; rerunning on the same folder resumes (default runs/<recipe>)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. optim.lr=0.05 model.num_words=4096")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("demo", help="pretrain on generated digit images and compare with random init")
    p.add_argument(
        "--dataset",
        choices=DEMO_DATASETS,
        default="digits",
        help="digits: scikit-learn's digits at random placements, no download (default); cifar10: a CIFAR-10 "
        "subset that torchvision downloads",
    )
    p.add_argument("--out", help="output folder (default runs/demo, or runs/demo-cifar10)")
    p.add_argument(
        "--recipe",
        help="the recipe to pretrain with (default for the digits: the best of demo, demo_fp32, demo_short that a "
        "probe of this machine estimates within 3 minutes; docs/demo.md)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="changes to the demo recipe")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("recipes", help="list the built-in recipes, or print one")
    p.add_argument("name", nargs="?")
    p.set_defaults(func=cmd_recipes)

    add_eval_parser(sub)
    add_export_parser(sub)
    add_import_parser(sub)
    add_show_parser(sub)

    p = sub.add_parser("tables", help="list the paper's comparison tables, or run one (every row, same budget)")
    p.set_defaults(func=cmd_tables_list)
    tables = p.add_subparsers(title="table commands", metavar="run | status | curves | budgets | levers | paired")
    r = tables.add_parser("run", help="train and evaluate every row of a table; resumes, skips finished rows")
    r.add_argument("name", help="table1 ... table5 or mocov2 (see `obow tables`)")
    r.add_argument("--data", required=True, help="a folder with train/ and test/ (or val/) class folders")
    budget = r.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, help="minutes of this machine per row and seed (fair on a CPU)")
    budget.add_argument("--budget", type=int, help="epochs of pretraining per row (the same for all)")
    r.add_argument("--seeds", nargs="+", type=int, default=[0], help="train every row once per seed (default 0)")
    r.add_argument("--curve-every", type=int, default=0, help="kNN on the test images every N epochs (curves)")
    r.add_argument("--recipe", default="cifar10_fast", help="the base recipe, read as the paper's full setting")
    r.add_argument("--out", default="runs/tables", help="output folder (default runs/tables)")
    r.add_argument("--per-class", type=int, default=None, help="pretrain on the first N images of each class")
    r.add_argument("--test-per-class", type=int, default=None, help="evaluate on the first N test images per class")
    r.add_argument("--rows", nargs="+", default=None, help="only these rows (numbers, labels or folder names)")
    r.add_argument("--k", type=int, default=200, help="kNN neighbours (default 200)")
    r.add_argument("--episodes", type=int, default=200, help="few-shot episodes (default 200)")
    r.add_argument(
        "--plan-only", action="store_true", help="time the rows and write plan.json, train nothing (see docs)"
    )
    r.add_argument(
        "--replan",
        action="store_true",
        help="discard the folder's plan.json and plan again (a wrong budget), while no row has trained there",
    )
    r.add_argument(
        "--timing-from",
        metavar="TABLE_DIR",
        help="plan --minutes from the timed steps in another budget's table folder (no re-timing)",
    )
    r.add_argument(
        "--results-from",
        metavar="TABLE_DIR",
        help="continue a table from its table.json and plan.json (e.g. a published one): its finished rows count",
    )
    r.add_argument(
        "--shared-from",
        metavar="TABLE_DIR",
        help="another table's folder: the rows with the same configuration take its plan and results, "
        "the other rows are timed against one of them",
    )
    r.add_argument(
        "--time-against",
        metavar="TABLE_DIR",
        help="plan a lever that changes a step's cost (batch, words, views) at the budget of the same rows in "
        "another folder of this table: each row timed here in turns as there and as here, planned at the ratio",
    )
    r.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="train this many row-seed runs at once, each in its own process with cores/JOBS threads (default 1)",
    )
    r.add_argument(
        "--random-init",
        choices=("first", "last"),
        default="first",
        help="evaluate each seed's random init before its rows (first, the default) or after every row (last: a "
        "call that may be stopped spends its time on the rows first)",
    )
    r.add_argument("overrides", nargs="*", metavar="key=value", help="changes to the base recipe for every row")
    r.set_defaults(func=cmd_tables_run)
    st = tables.add_parser("status", help="where a table folder stands: each row and seed, and the minutes left")
    st.add_argument("folder", help="the table's folder, <out>/<table> (e.g. runs/tables/mocov2)")
    st.add_argument("--seeds", nargs="+", type=int, help="these seeds (default: every seed with a folder there)")
    st.set_defaults(func=cmd_tables_status)
    cu = tables.add_parser("curves", help="the kNN monitor of every row: at equal steps, and with planned minutes")
    cu.add_argument("folder", help="the table's folder, <out>/<table>, run with --curve-every N")
    cu.add_argument("--seeds", nargs="+", type=int, help="these seeds (default: every seed with a folder there)")
    cu.set_defaults(func=cmd_tables_curves)
    for command, help_text, first, versus, func in (
        (
            "budgets",
            "one table at several --minutes budgets: gain against budget, and where two rows cross",
            "each budget's table.json (or the folder holding it)",
            "the two rows whose gap A - B is extrapolated",
            cmd_tables_budgets,
        ),
        (
            "levers",
            "one table at one budget, as it is and with key=value levers: each row's change, same seed",
            "the base table.json (or its folder) first, then each lever's",
            "the two rows whose gap A - B is compared",
            cmd_tables_levers,
        ),
    ):
        c = tables.add_parser(command, help=help_text)
        c.add_argument("tables", nargs="+", help=first)
        c.add_argument("--score", default="knn", help="knn (default), linear, fewshot_1 or fewshot_5")
        c.add_argument("--versus", nargs=2, metavar=("A", "B"), help=versus)
        c.set_defaults(func=func)
    pa = tables.add_parser("paired", help="every row of a table minus one of its rows, seed by seed, with verdicts")
    pa.add_argument("table", help="a table.json (or the folder holding it)")
    pa.add_argument("--against", required=True, help="the reference row (number, label or folder name; random_init)")
    pa.add_argument(
        "--scores", nargs="+", default=["knn", "linear", "fewshot_1", "fewshot_5"], help="scores (default all four)"
    )
    pa.set_defaults(func=cmd_tables_paired)
    return parser


def cmd_pretrain(args: argparse.Namespace) -> int:
    from obow.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.data is not None:
        overrides.append(f"data.path={args.data}")
    if args.val is not None:
        overrides.append(f"data.val_path={args.val}")
    # the recipe's warnings wait until the training images are found: a bad --data is then the only line
    with notices_held():
        cfg = load_config(args.config, overrides)
        if cfg.data.path is None:
            raise ConfigError(
                "no training images: pass --data DIR (or set data.path in the recipe); "
                "`obow demo` pretrains on built-in images"
            )
        if args.config is None:  # obow's defaults are the paper's ResNet-50 run, refused as an empty recipe is
            raise ConfigError(
                "no recipe: pass --config NAME (`obow recipes` lists them: imagenet_resnet50_full is the paper's "
                "ResNet-50 run, hours a step on a CPU; the *_fast ones are minutes) or --config FILE.yaml"
            )
        out = Path(args.out or Path("runs") / Path(args.config).stem)
        from obow.evaluate.monitor import KNNMonitor
        from obow.training.cost import out_of_memory
        from obow.training.loop import Interrupted, pretrain

        try:
            result = finished_read_only(cfg, out) or pretrain(cfg, out, monitor=KNNMonitor)
        except Interrupted as err:
            return err.exit_code
        except (RuntimeError, MemoryError) as err:  # the allocator's, before the first step too: one line
            if (oom := out_of_memory(err, cfg)) is not None:
                raise oom from None
            raise
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, the main process alone says what is next
        return 0
    epochs = result["epochs"]
    print(f"done: {epochs} epoch{'' if epochs == 1 else 's'}, checkpoint {result['checkpoint']}")
    print(f"next: obow eval knn --checkpoint {result['checkpoint']} --data {eval_data(cfg.data.path)}")
    print(f"      obow export --checkpoint {result['checkpoint']} --out {out / 'backbone.pth'}")
    return 0


def finished_read_only(cfg: Any, out: Path) -> dict[str, Any] | None:
    """The summary of the finished run in ``out`` when this process cannot write that folder (a read-only file
    system or folder): with nothing to train, nothing is written, so the run folder is not locked either, and the
    command ends as it does for a finished run. ``None`` otherwise (the run is trained, or refused, as usual)."""
    from obow.config import from_dict, to_dict
    from obow.config.schema import Config
    from obow.training.run.settings_check import check_same_run
    from obow.weights.checkpoint import load_checkpoint

    path = out / "checkpoint.pt"
    if not path.is_file() or os.access(out, os.W_OK):
        return None
    ckpt = load_checkpoint(path)
    if "optimizer" not in ckpt or (ckpt.get("epoch") or 0) < cfg.optim.epochs:
        return None  # it has steps to train, which need the folder written: the usual refusal says so
    asked = to_dict(cfg)
    for section, key in (("train", "precision"), ("data", "pipeline")):  # `auto`: what the run resolved it to
        if asked[section][key] == "auto":
            asked[section][key] = (ckpt["config"].get(section) or {}).get(key, "auto")
    check_same_run(from_dict(Config, asked), ckpt["config"], path, warmup_as_asked="data" in ckpt)
    logging.getLogger("obow").info(
        "%s is finished (%d of %d epochs, iteration %d); its folder is read-only, so nothing was written: raise "
        "optim.epochs in a writable copy of it to extend it",
        out,
        ckpt["epoch"],
        cfg.optim.epochs,
        ckpt["iteration"],
    )
    return {"epochs": ckpt["epoch"], "checkpoint": str(path), "already_finished": True}


def cmd_demo(args: argparse.Namespace) -> int:
    from obow.experiments.demo import run_demo
    from obow.training.cost import out_of_memory
    from obow.training.loop import Interrupted

    try:
        out = args.out or ("runs/demo" if args.dataset == "digits" else f"runs/demo-{args.dataset}")
        run_demo(Path(out), list(args.overrides), args.dataset, getattr(args, "recipe", None))
    except Interrupted as err:
        return err.exit_code
    except (RuntimeError, MemoryError) as err:  # the allocator's, in one line
        if (oom := out_of_memory(err, None)) is not None:
            raise oom from None
        raise
    return 0


def eval_data(train: str | None) -> str:
    """What ``obow eval`` takes as ``--data`` after a run on ``train``: the folder that holds it beside a ``val/`` or
    ``test/`` (``my_images`` after ``--data my_images/train``, :func:`~obow.cli.common.splits_folder`), else what such
    a folder holds."""
    from obow.cli.common import splits_folder

    folder = splits_folder(train) if train else None
    return shlex.quote(str(folder)) if folder is not None else "<folder with train/ and val/>"


def cmd_recipes(args: argparse.Namespace) -> int:
    import yaml

    from obow.config import RECIPES_DIR, ConfigError, available_recipes, load_config
    from obow.config.schema import to_dict

    if args.name:
        path = RECIPES_DIR / f"{args.name}.yaml"
        if not path.exists():
            raise ConfigError(f"unknown recipe {args.name!r}; choose one of: {', '.join(available_recipes())}")
        text = path.read_text()
        header = itertools.takewhile(lambda line: line.startswith("#"), text.splitlines())  # what it is for
        base = (yaml.safe_load(text) or {}).get("base")
        print("\n".join(header))
        start = f"{base}'s settings with this recipe's changes" if base else "this recipe's settings"
        print(f"# Every setting of a run of {args.name}:\n# {start}, obow's defaults for the rest.")
        print(yaml.safe_dump(to_dict(load_config(args.name)), sort_keys=False, default_flow_style=None, width=116))
        return 0
    for name, description in available_recipes().items():
        print(f"{name:30s} {description}")
    return 0


def cmd_tables_list(args: argparse.Namespace) -> int:
    from obow.experiments.tables import list_tables

    print(list_tables())
    print(
        "\nrun one: obow tables run NAME --data DIR (--minutes M | --budget EPOCHS) [--seeds 0 1] [--per-class N] "
        "[--jobs 2] [key=value ...]"
    )
    return 0


def _table_records(items: list[str]) -> list[dict]:
    records = []
    for item in items:
        path = Path(item)
        path = path / "table.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"no table.json at {item} (give a table.json or the folder that holds one)")
        records.append(json.loads(path.read_text()))
    return records


def cmd_tables_status(args: argparse.Namespace) -> int:
    from obow.experiments.tables import table_status

    print(table_status(args.folder, args.seeds), end="")
    return 0


def cmd_tables_curves(args: argparse.Namespace) -> int:
    from obow.experiments.tables import curves_text

    print(curves_text(args.folder, args.seeds), end="")
    return 0


def cmd_tables_budgets(args: argparse.Namespace) -> int:
    from obow.experiments.tables import compare_budgets

    records = _table_records(args.tables)
    print(compare_budgets(records, args.score, tuple(args.versus) if args.versus else None), end="")
    return 0


def cmd_tables_levers(args: argparse.Namespace) -> int:
    from obow.experiments.tables import compare_levers

    records = _table_records(args.tables)
    print(compare_levers(records, args.score, tuple(args.versus) if args.versus else None), end="")
    return 0


def cmd_tables_paired(args: argparse.Namespace) -> int:
    from obow.experiments.tables import compare_rows

    print(compare_rows(_table_records([args.table])[0], args.against, tuple(args.scores)), end="")
    return 0


def cmd_tables_run(args: argparse.Namespace) -> int:
    from obow.experiments.tables import TABLES, markdown, run_table
    from obow.training.cost import out_of_memory
    from obow.training.loop import Interrupted

    try:
        record = run_table(
            args.name,
            args.data,
            args.budget,
            minutes=args.minutes,
            seeds=args.seeds,
            curve_every=args.curve_every,
            recipe=args.recipe,
            out=args.out,
            per_class=args.per_class,
            test_per_class=args.test_per_class,
            rows=args.rows,
            overrides=list(args.overrides),
            k=args.k,
            episodes=args.episodes,
            plan_only=args.plan_only,
            timing_from=args.timing_from,
            results_from=args.results_from,
            shared_from=args.shared_from,
            jobs=args.jobs,
            time_against=args.time_against,
            replan=args.replan,
            random_init=args.random_init,
        )
    except Interrupted as err:
        return err.exit_code
    except (RuntimeError, MemoryError) as err:  # the allocator's or Python's, in a run of a row: one line
        if (oom := out_of_memory(err, None)) is not None:
            raise oom from None
        raise
    if args.plan_only:
        print(json.dumps(record, indent=2))
        print(f"written: {Path(args.out) / args.name / 'plan.json'}; the same command without --plan-only trains it")
        return 0
    print(markdown(record, TABLES[args.name].columns))
    print(f"written: {Path(args.out) / args.name / 'table.md'} and table.json")
    return 0
