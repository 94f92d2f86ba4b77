"""What the logs of finished runs say, side by side: why one run learned more than another.

For each run folder (its ``log.jsonl``), over the last epoch's step records: the pretext loss, and for OBoW
runs the loss a student would score by predicting the batch's average BoW (``kl_to_mean_bow``, summed over
the levels like the loss), the teacher's BoW perplexities (per image and per batch), the share of the
vocabulary in use and the student's effective rank; then the kNN monitor's curve (epoch: top-1).

    python benchmarks/run_diagnostics.py runs/tables-cifar10/mocov2/*/seed0
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarise(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "type" not in r and "loss" in r]
    epochs = [r for r in records if r.get("type") == "epoch"]
    last_epoch = max((r["epoch"] for r in steps), default=0)
    last = [r for r in steps if r["epoch"] == last_epoch]
    levels = sorted({key.split("/")[0] for r in last for key in r if key.endswith("/kl_to_mean_bow")})

    def mean(key: str) -> float | None:
        values = [r[key] for r in last if key in r]
        return statistics.fmean(values) if values else None

    per_group = [statistics.fmean(v for k, v in r.items() if k.startswith("loss/group")) for r in last]
    kl = [mean(f"{level}/kl_to_mean_bow") for level in levels]
    return {
        "run": str(run),
        "epochs": last_epoch,
        "steps": max((r["iteration"] for r in steps), default=0),
        # the logged loss of each view group and level (``loss/group<g>/<level>``) compares with the KL
        "loss_per_group_level": statistics.fmean(per_group) if per_group else mean("loss"),
        "mean_bow_loss": statistics.fmean(kl) if kl and None not in kl else None,
        "perplexity_image": [mean(f"{level}/perplexity_image") for level in levels],
        "perplexity_batch": [mean(f"{level}/perplexity_batch") for level in levels],
        "words_used": [mean(f"{level}/words_used") for level in levels],
        "effective_rank": mean("student/effective_rank"),
        "knn_curve": [(r["epoch"], r["knn_top1"]) for r in epochs if "knn_top1" in r],
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(_fmt(v) for v in value) or "-"
    return f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each with a log.jsonl)")
    args = parser.parse_args()
    print(
        "| run | epochs | steps | loss / group / level (last epoch) | predicting the mean BoW | perplexity "
        "image / batch | words used | eff. rank | kNN curve |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        s = summarise(run)
        curve = ", ".join(f"{e}: {k:.1f}" for e, k in s["knn_curve"]) or "-"
        print(
            f"| {s['run']} | {s['epochs']} | {s['steps']} | {_fmt(s['loss_per_group_level'])} | "
            f"{_fmt(s['mean_bow_loss'])} | {_fmt(s['perplexity_image'])} / {_fmt(s['perplexity_batch'])} | "
            f"{_fmt(s['words_used'])} | {_fmt(s['effective_rank'])} | {curve} |"
        )


if __name__ == "__main__":
    main()
