"""The paper's comparisons as commands: ``obow tables`` and
``obow tables run NAME --data DIR (--minutes M | --budget EPOCHS) [--seeds 0 1]``.

Each table of the paper's analysis (Tables 1-5, ResNet-18 on 20% of ImageNet, 80 epochs) and the appendix
comparison with MoCo v2 is a list of rows. Every row is the same base recipe (the ``--recipe``, read as the
paper's *full* setting: ``conv4`` + ``conv5``, 2 crops + 5 patches) with the row's change applied, trained
for the same reduced budget, once per seed, then measured with one protocol (:mod:`obow.evaluate.protocol`:
linear probe, few-shot episodes, kNN, effective rank) beside the paper's numbers, as the mean and sample
standard deviation over the seeds. A "random init" row measures the base network at its random
initialisation (each seed's), the reference every learning claim needs.

The budget:

* ``--minutes M`` (the fair comparison on a CPU): every row gets the same wall-clock time of this machine,
  not the same epochs (a MoCo v2 step, two views, costs a fraction of an OBoW (full) step). Before a row is
  first trained, its step is timed together with the other rows' in alternating rounds
  (:func:`obow.experiments.budget.seconds_per_step`: loading included), and its epochs are the whole epochs
  that fit in M minutes; a BoWNet row's stages share the M minutes in the proportions below.
* ``--budget EPOCHS``: every row the same epochs (the paper's protocol; fair on equal hardware per step only).

Either way the plan (each row's epochs, warm-up, timed step) is written once to ``<table>/plan.json`` and reused by
every seed and by later calls that complete the table; asking the same folder for another budget or other images is
refused (``--replan`` discards the plan while no row has trained there). ``--plan-only`` writes the plan and stops:
time the rows on the quiet machine with every core, then train however suits the machine. ``--timing-from DIR``
takes the timed steps of another folder of the same table (another budget) instead of timing them again.
``--shared-from DIR`` takes from a folder of *another* table (same images, recipe, changes, protocol and budget) the
rows the two tables have in common (the same configuration: OBoW vanilla is a row of Tables 1, 2, 3, 4 and 5) with
their plan and finished seeds, so that no configuration is trained twice and every table shows the same numbers for
it; this table's other rows are then timed in turns with one shared row and planned at the ratio of their step to
its (:func:`share_rows`): the ratio is measured in one run, the machine's speed on the day is not. The plan fixes
each row's steps, not its threads: on a 2-core machine two tables can train side by side with ``OMP_NUM_THREADS=1``
each; only the wall time in ``table.md`` changes. Measured (2026-11-24): the MoCo v2 table on CIFAR-10 and on
Imagenette side by side, one thread each, ran OBoW (full) at 7.1 and 7.4 s a step, against 3.85 and 4.06 s timed
alone with both cores: about 1.1x the work of one table at a time. ``--jobs N`` does the same within one table: N of
its row-seed runs at once, each in its own process (:func:`run_in_processes`); with ``--jobs 1`` they run in this
process (:func:`run_in_order`). Either way a signal stops the table: training runs at a checkpoint, evaluations at
once; finished results stay and the same command resumes.

Settings the tables change for a short run, the same rule for every row:

* **Warm-up**: the base recipe's warm-up in epochs (``cifar10_fast``: 1 epoch), *not* scaled with the
  budget, and at most half the row's epochs (:func:`obow.experiments.budget.short_run_warmup`). An earlier
  rule kept the recipe's proportion of the run: 8 steps of warm-up for a 117-step row, and OBoW (full) fell
  below its random init (kNN 23.0 against 26.9).
* Nothing else is scaled: the teacher momentum's cosine (0.99 -> 1) and the learning rate's cosine run over
  the row's own steps, as in any run; the temperature statistic's momentum is per step (the recipe's).
* **Precision**: one for the whole table, recorded in ``plan.json`` (:func:`table_precision`): a new table
  takes the recipe's ``train.precision`` (``auto``: bf16 where this machine computes it natively, fp32
  elsewhere), a table that is continued, or shares rows or timed steps with another, keeps that plan's
  (plans that record none are fp32: every table before the key was). A machine that would choose otherwise
  still trains the table at its plan's precision, so that its rows and seeds stay comparable.
* **Data pipeline**: one for the whole table too, recorded in ``plan.json`` the same way
  (:func:`table_pipeline`; ``auto``: the device pipeline on a GPU, loader workers on a CPU; plans that record
  none used loader workers).

How the paper's settings map onto the base recipe:

* *vanilla*: ``model.levels=[conv5]``, one crop, no patches; *full*: the base recipe itself (with
  ``model.levels=[conv4, conv5]``).
* crop sizes: the paper's 224 px crop is the base's teacher view size, its 160 px crop the base's
  ``views.crop_size`` and its 96 px patch the base's ``views.patch_size`` (for CIFAR-10: 40, 28 and 17 px).
  The 224 px crop is a random-resized crop of scale (0.08, 1), torchvision's default.
* Table 2's learning rates 0.03 and 0.01 (paper base 0.05) are 0.6 and 0.2 times the base ``optim.lr``.
* Table 5's BoWNet is three stages within the row's budget, in the paper's proportions (40 + 80 + 80 of 200
  epochs): RotNet pretraining of the teacher (one crop of the teacher-view size), then two BoWNet rounds
  (hard codes, fixed linear head, k-means vocabulary of the previous stage's network), each stage at least one
  epoch. OBoW rows get the same total budget (the paper gave BoWNet 200 epochs and OBoW 80).
* MoCo v2 rows: ``moco.key_momentum=0.99`` (OBoW's teacher momentum, and what MoCo's CIFAR-10 demo uses; 0.999
  would leave the key encoder at its initialisation over a few hundred steps) and a queue of the largest
  multiple of the batch that is at most half the training images (and at most 65,536, MoCo's).

A table's folder holds one folder per row and seed (``<out>/<table>/<row>/seed<N>/``, a pretraining run
each, resumable) with ``result.json`` once finished; re-running the command trains and evaluates only what is
missing (``--rows`` picks rows, ``--seeds`` the seeds), so a table can be completed over several sessions.
``obow tables status <out>/<table>`` (:func:`table_status`) reports, from the files alone, each planned row and
seed's state and the minutes of training left.
``obow tables curves <out>/<table>`` (:func:`curves_text`) prints the kNN monitor of every row (``--curve-every``)
at equal steps and with its planned minutes.
``table.json`` and ``table.md`` hold the whole table: every seed's scores, their mean and spread, the plan,
the protocol and the machine.

``obow tables budgets TABLE ...`` (:func:`compare_budgets`) puts one table measured at several ``--minutes``
budgets side by side: the gain of each row over random init against the budget, and where the gap between two
rows would cross zero, read as a line in log-minutes. ``obow tables levers BASE LEVER ...`` (:func:`compare_levers`)
puts one table at one budget beside the same table run with ``key=value`` changes: each row's change against the
base's same row and seed, and the change in the gap between two rows (a lever planned in epochs with the base
rows' steps is compared at equal steps). ``obow tables paired TABLE --against ROW`` (:func:`compare_rows`) puts
every row of one table against one of its rows, seed by seed, with the verdict rule the results use (ahead or
behind only when every seed agrees and the mean exceeds the spread) and whether the paper's ordering holds.

The package, in the order a table is made: :mod:`~obow.experiments.tables.catalog` (the tables as data),
:mod:`~obow.experiments.tables.plan` (``plan.json``, and the folders a plan or results come from),
:mod:`~obow.experiments.tables.run` (training and evaluating rows and seeds, in one process or several),
:mod:`~obow.experiments.tables.records` (``table.json`` and ``table.md``), :mod:`~obow.experiments.tables.status`
(``status`` and ``curves``) and :mod:`~obow.experiments.tables.compare` (``budgets``, ``levers`` and ``paired``).
"""

from obow.experiments.tables.catalog import (
    COLUMNS,
    TABLES,
    Row,
    Stage,
    Table,
    fill_placeholders,
    list_tables,
    placeholders,
    select_rows,
)
from obow.experiments.tables.compare import (
    compare_budgets,
    compare_levers,
    compare_rows,
    paired_verdict,
    paper_direction,
)
from obow.experiments.tables.plan import (
    budget_plan,
    import_results,
    share_rows,
    table_pipeline,
    table_precision,
)
from obow.experiments.tables.records import aggregate, machine_description, markdown, training_minutes
from obow.experiments.tables.run import Task, run_in_order, run_in_processes, run_table, table_tasks
from obow.experiments.tables.status import curves_text, monitor_curves, read_table_plan, table_status

__all__ = [
    "COLUMNS",
    "TABLES",
    "Row",
    "Stage",
    "Table",
    "Task",
    "aggregate",
    "budget_plan",
    "compare_budgets",
    "compare_levers",
    "compare_rows",
    "curves_text",
    "fill_placeholders",
    "import_results",
    "list_tables",
    "machine_description",
    "markdown",
    "monitor_curves",
    "paired_verdict",
    "paper_direction",
    "placeholders",
    "read_table_plan",
    "run_in_order",
    "run_in_processes",
    "run_table",
    "select_rows",
    "share_rows",
    "table_pipeline",
    "table_precision",
    "table_status",
    "table_tasks",
    "training_minutes",
]
