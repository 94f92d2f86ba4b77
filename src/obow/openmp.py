"""How obow's OpenMP threads wait for work: briefly, so that a run beside other work does not collapse.

PyTorch's CPU kernels run on an OpenMP thread pool (GNU libgomp in the Linux wheels). Between two parallel
regions libgomp's idle threads spin by default (``GOMP_SPINCOUNT`` 300,000 rounds, about a millisecond) before
they sleep. On a quiet machine that saves a wake-up per region; on a machine where another process holds one
of the cores it is ruinous: each region waits for the thread that shares its core, and that thread's turn is
spent by the neighbour and by its own spinning sibling. The demo's 2-thread steps took 4.4-4.7 s beside one
busy process against 0.56 s with ``OMP_WAIT_POLICY=PASSIVE`` (issue 65). The runtime reads these variables once,
when PyTorch loads it, so they are set before ``import torch``: by the ``obow`` command first thing, and by
``import obow`` when PyTorch is not imported yet. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins.

What is set, :data:`WAIT_SETTINGS`, was chosen by ``benchmarks/busy_machine.py`` (quiet and busy, alternating):
docs/results/busy_machine.md.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["WAIT_SETTINGS", "wait_briefly"]

#: The environment obow gives its OpenMP runtime when the user has set neither variable.
WAIT_SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE"}
#: Variables by which a user says how OpenMP threads wait; any of them set leaves the choice to the user.
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def wait_briefly(environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None) -> dict[str, str]:
    """Set :data:`WAIT_SETTINGS` in ``environ`` (the process's environment) unless the user set how OpenMP
    threads wait, or PyTorch is already imported (its runtime has read the environment: too late to matter, so
    nothing is changed). Returns what was set (empty: nothing)."""
    environ = os.environ if environ is None else environ
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    if torch_loaded or any(name in environ for name in USER_VARIABLES):
        return {}
    environ.update(WAIT_SETTINGS)
    return dict(WAIT_SETTINGS)
