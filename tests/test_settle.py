"""settle -> build -> train: :func:`obow.training.run.settle.settle_run` resolves a run's ``auto`` settings and threads
once, a resumed run keeping what its ``config.yaml`` says it started with."""

import pytest
import torch
import yaml

from obow.config import load_config
from obow.training.run import precision as prec
from obow.training.run.settle import settle_run

CPU = torch.device("cpu")


@pytest.fixture
def asked(tiny_recipe):
    overrides = ["train.precision=auto", "data.pipeline=auto", "train.threads=3", "train.device=cpu"]
    return load_config(str(tiny_recipe), overrides)


def started(out, precision, pipeline):
    """A run folder as a run that started with ``precision`` and ``pipeline`` leaves it (its checkpoint is only
    looked for: the started configuration is read from config.yaml)."""
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"")
    (out / "config.yaml").write_text(
        yaml.safe_dump({"train": {"precision": precision}, "data": {"pipeline": pipeline}})
    )
    return out


@pytest.mark.parametrize("native", [True, False])
def test_a_new_run_takes_this_machine_s_choices(asked, tmp_path, monkeypatch, native):
    monkeypatch.setattr(prec, "native_bf16", lambda device: native)
    run = settle_run(asked, tmp_path / "new", CPU)
    assert run.cfg.train.precision == ("bf16" if native else "fp32")
    assert run.cfg.data.pipeline == run.pipeline == "workers"  # a CPU's default
    assert (run.threads, run.threads_why) == (3, "train.threads")
    assert not (tmp_path / "new").exists()  # settling writes nothing


def test_a_resumed_run_keeps_what_it_started_with(asked, tmp_path, monkeypatch):
    monkeypatch.setattr(prec, "native_bf16", lambda device: True)  # here auto would be bf16 ...
    run = settle_run(asked, started(tmp_path / "run", "fp32", "device"), CPU)
    assert run.cfg.train.precision == "fp32"  # ... but the run started in fp32
    assert run.cfg.data.pipeline == run.pipeline == "device"  # and made its views on the device


def test_a_run_started_before_the_pipeline_was_recorded_keeps_auto_and_its_rule(asked, tmp_path):
    run = settle_run(asked, started(tmp_path / "run", "fp32", "auto"), CPU)
    assert run.cfg.data.pipeline == "auto"  # as its config.yaml and checkpoint say: the same run
    assert run.pipeline == "workers"  # what auto makes on a CPU
