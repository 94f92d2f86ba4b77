"""What splitting the weight generator across processes saves (``model.split_generator``).

The official code makes every process run the weight generator over all K words of every level: a fixed
cost per step that does not shrink as processes are added. With ``split_generator`` each of the ``world``
processes runs it over K / world words and the results are gathered (see ``obow.bow.predictor.WeightGenerator``).
This starts ``--world`` real processes on the CPU (gloo, ``--threads`` threads each) and times, per
process, the generator's forward+backward over every level's vocabulary, with and without the split, in one
run. Backward is driven by a fixed upstream gradient on the generated weights, as the loss would provide.

    python benchmarks/generator_split.py               # resnet50 levels: 1024-d and 2048-d words, K 8192
    python benchmarks/generator_split.py --word-dims 256 512 --feature-dim 512 --num-words 4096   # resnet18
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from obow.bow.predictor import DynamicBoWPredictor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, args: argparse.Namespace, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        g = torch.Generator().manual_seed(0)
        words = [torch.randn(args.num_words, c, generator=g) for c in args.word_dims]
        upstream = [torch.randn(args.num_words, args.feature_dim, generator=g) for _ in args.word_dims]
        for split in (False, True):
            torch.manual_seed(0)
            head = DynamicBoWPredictor(args.word_dims, args.feature_dim, split_generator=split).train()
            times = []
            for i in range(args.warmup + args.repeats):
                dist.barrier()
                start = time.perf_counter()
                weights = head.weights(words)
                sum((w * u).sum() for w, u in zip(weights, upstream, strict=True)).backward()
                dist.barrier()
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            if rank == 0:
                results["split" if split else "all words"] = statistics.median(times)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="processes")
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--num-words", type=int, default=8192)
    parser.add_argument("--word-dims", type=int, nargs="+", default=[1024, 2048], help="channels of each level")
    parser.add_argument("--feature-dim", type=int, default=2048, help="the student's pool5 size")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(args, free_port(), results), nprocs=args.world, start_method="spawn")
        results = dict(results)
    print(
        f"\nweight generator forward+backward, K={args.num_words}, word dims {args.word_dims}, "
        f"feature dim {args.feature_dim}; {args.world} CPU processes (gloo), {args.threads} thread(s) each"
    )
    print("| generator       | median s per process |")
    print("|-----------------|----------------------|")
    for name in ("all words", "split"):
        print(f"| {name:<15} | {results[name]:>20.4f} |")
    print(f"split / all words: {results['split'] / results['all words']:.2f}")


if __name__ == "__main__":
    main()
