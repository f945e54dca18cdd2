"""The data path's share of a training step: one step's batches read from a prepared folder (memory
map, documents masked or not) against the step's time with them, in one process.

    python benchmarks/data_path_cost.py PREPARED_DIR [--steps 6] [seqpar train flags ...]

Each step's batches are built (``train_batch``) and timed apart from the step that uses them
(``Trainer.train_step`` with the batch rule wrapped so it returns the prepared batches). Issue 36's
target: < 1% of the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> None:
    from seqpar.commands.train import add_arguments, job_from_args
    from seqpar.train.loop import Trainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prepared")
    p.add_argument("--steps", dest="bench_steps", type=int, default=6)
    ours, rest = p.parse_known_args()
    tp = argparse.ArgumentParser()
    add_arguments(tp)
    args = tp.parse_args([*rest, "--data", ours.prepared, "--no-progress"])
    job = job_from_args(args, 1)
    trainer = Trainer(job, quiet=True)
    t = job.train
    data_s, step_s = [], []
    real = trainer.data.train_batch
    for step in range(ours.bench_steps + 1):
        t0 = time.perf_counter()
        batches = real(t.seed, step, t.global_batch, t.micro_batch, 0, 1)
        t1 = time.perf_counter()
        trainer.data.train_batch = lambda *a, b=batches: b
        trainer.train_step(step)
        t2 = time.perf_counter()
        if step:  # the first step warms up
            data_s.append(t1 - t0)
            step_s.append(t2 - t1)
    d, s = statistics.median(data_s), statistics.median(step_s)
    print(
        f"data {d * 1e3:.2f} ms, step {s * 1e3:.1f} ms (medians of {ours.bench_steps}): data = "
        f"{100 * d / s:.2f}% of a step ({t.global_batch} x {job.model.seq_len} tokens, "
        f"document_mask {job.data.document_mask})"
    )


if __name__ == "__main__":
    sys.exit(main())
