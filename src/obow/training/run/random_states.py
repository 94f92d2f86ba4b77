"""Every random generator a run draws from (Python's, NumPy's global one, torch's and CUDA's): seeded once for a new
run (:func:`seed_run`), kept in each checkpoint per process (:func:`get_rng_state`) and restored on resumption
(:func:`set_rng_state`), so that a resumed run continues the streams an uninterrupted one would have."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def seed_run(seed: int) -> None:
    """Seed every generator a run may draw from (Python's, NumPy's global one, torch's): the checkpoint keeps
    all of them, so that a resumed run continues the streams an uninterrupted one would have."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    """This process's random states as tensors and plain values (a weights-only load reads them back)."""
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())  # legacy=True: the tuple
    name, key, pos, has_gauss, cached_gaussian = legacy
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": name,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`get_rng_state`'s states (or a version-1 checkpoint's, whose NumPy state is a tuple)."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["bit_generator"],
            numpy_state["key"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
