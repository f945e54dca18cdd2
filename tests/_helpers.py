"""Helpers shared by several test files (importable as ``_helpers``: pytest puts tests/ on sys.path,
and spawned ranks inherit it)."""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Callable, Hashable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestAllocation(TorchDispatchMode):
    """The most elements of any tensor an op makes while active, and that op (views and in-place
    results excluded); ``counts(tensor)`` says which tensors count (default: every one)."""

    def __init__(self, counts: Callable[[torch.Tensor], bool] = lambda t: True):
        super().__init__()
        self.counts, self.largest, self.op = counts, 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        # a view, or an in-place op
        if func.is_view or (returns and returns[0].alias_info is not None):
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.counts(t) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), f"{func} {tuple(t.shape)}"
        return out


class Launches:
    """Training jobs on local ranks, ``size`` jobs of one world size per launch, each launch run the
    first time one of its jobs is asked for (``result``).

    A launch may take ``START_S + job_s × jobs × ⌈world / cores⌉`` seconds (ranks beyond the cores
    share them). A launch that fails -- an error, or that timeout -- is run again one job at a time,
    so each job reports its own outcome: a job that fails alone raises its own error; if every job
    of the launch passes alone, each raises the launch's error (they fail only together)."""

    START_S = 120.0  # process start, group set-up and the first step's warm-up, per launch

    def __init__(self, jobs: dict[Hashable, tuple[dict, int]], size: int, job_s: float):
        self.jobs, self.job_s = jobs, job_s  # key: (job sections, world size)
        by_world: dict[int, list[Hashable]] = {}
        for key, (_, world) in jobs.items():
            by_world.setdefault(world, []).append(key)
        self.launch_of = {key: keys[i:i + size] for keys in by_world.values()
                          for i in range(0, len(keys), size) for key in keys[i:i + size]}
        self.outcome: dict[Hashable, dict | BaseException] = {}

    def result(self, key: Hashable) -> dict:
        """Rank 0's summary of job ``key``, or the error that belongs to it."""
        if key not in self.outcome:
            self._run(self.launch_of[key])
        outcome = self.outcome[key]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def timeout(self, jobs: int, world: int) -> float:
        return self.START_S + self.job_s * jobs * math.ceil(world / (os.cpu_count() or 1))

    def _run(self, keys: list[Hashable]) -> None:
        try:
            self.outcome.update(zip(keys, self._launch(keys), strict=True))
        except Exception as exc:
            if len(keys) == 1:
                self.outcome[keys[0]] = exc
                return
            for key in keys:  # which of them fails: each alone
                self._run([key])
            if not any(isinstance(self.outcome[key], BaseException) for key in keys):
                together = RuntimeError(
                    f"jobs {keys} fail in one launch and pass one at a time: {exc!r}"
                )
                self.outcome.update((key, together) for key in keys)

    def _launch(self, keys: list[Hashable]) -> list[dict]:
        from seqpar.train.loop import train_local, train_local_many

        world = self.jobs[keys[0]][1]
        sections = [self.jobs[key][0] for key in keys]
        if world == 1:  # in this process
            return [train_local(s) for s in sections]
        return train_local_many(sections, world, timeout=self.timeout(len(keys), world))


@contextlib.contextmanager
def ctrl_c_at_unit(n: int):
    """Inside the block, ``seqpar prepare``'s n-th unit raises KeyboardInterrupt (a Ctrl-C
    mid-prepare, in the process: with ``workers=1`` the units are tokenized here)."""
    from seqpar.data import prepare as prep

    real, calls = prep.tokenize_unit, []

    def dies(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    prep.tokenize_unit = dies
    try:
        yield
    finally:
        prep.tokenize_unit = real


def run_cli(argv) -> tuple[int, str, str]:
    """``seqpar ARGV`` in this process: (exit code, stdout, stderr)."""
    from seqpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, out.getvalue(), err.getvalue()


def seqpar(capsys, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a verb run in this process, read through pytest's ``capsys``
    (what was printed before is dropped first)."""
    from seqpar.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def random_tokens(path, vocab: int, n: int = 20_000, seed: int = 0):
    """``path`` filled with ``n`` uniform token ids in [0, vocab) as uint16 (a small data file: the
    default data, the standard library's sources, takes seconds to read); returns ``path``."""
    torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(
        torch.uint16
    ).numpy().tofile(path)
    return path


def prepared_documents(folder, documents: int = 1500, seed: int = 0, longest: int = 24):
    """A prepared folder (``seqpar prepare``, byte-level, vocabulary 256, end-of-document id 0) of
    ``documents`` JSON Lines documents of 1 to ``longest`` random letters: short enough that every
    window of a small test model holds several document ends, so microbatches count different
    numbers of tokens. Made in this process; returns ``folder``."""
    import json
    import random
    from pathlib import Path

    rng = random.Random(seed)
    folder = Path(folder)
    source = folder.with_name(folder.name + "-source.jsonl")
    lines = ("".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, longest)))
             for _ in range(documents))
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    code, out, err = run_cli(
        ["prepare", source, "--out", folder, "--workers", "1", "--no-progress"]
    )
    assert code == 0, err
    return folder


def word_documents(folder, texts: list[str]):
    """A prepared folder of ``texts`` (one document each), tokenized by a word-level tokenizer of
    the words ``a`` to ``j`` (end-of-document ``<|endoftext|>`` id 0, vocabulary 12) that splits on
    whitespace: a text of spaces is a document of one token, its end, whose label is never counted
    under document masks. Needs the ``tokenizers`` package; returns ``(folder, tokenizer file)``."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    words = ["<|endoftext|>", "[UNK]", *"abcdefghij"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = folder.with_name(folder.name + "-tokenizer.json")
    tok.save(str(tokenizer))
    source = folder.with_name(folder.name + "-source.jsonl")
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    code, out, err = run_cli(
        [
            "prepare",
            source,
            "--out",
            folder,
            "--tokenizer",
            tokenizer,
            "--workers",
            "1",
            "--no-progress",
        ]
    )
    assert code == 0, err
    return folder, tokenizer


def validation_documents(documents: int, val_fraction: float = 0.05) -> set[int]:
    """Which of ``documents`` documents a prepared folder holds out for validation
    (``held_out``)."""
    import torch

    from seqpar.data.windows import held_out

    _, val = held_out(torch.arange(1, documents + 1), val_fraction)
    return {i for a, b in val for i in range(a, b)}


def plan_vs_measured(stages: dict[int, dict], job, ranks: list[dict]) -> list[str]:
    """Where the trained ranks (a ``start`` record's ``ranks``) differ from their pipeline ranks'
    planned terms (``stages``: pp rank -> `seqpar plan` terms for the device they ran on):
    parameters exactly; gradients exactly but 4 B per element of the fp32 buckets' padding;
    optimizer state exactly per rank, or with the distributed optimizer summed over the dp × cp
    ranks that shard it (the padding holds none); the activation peak equal to the planned
    activations less the transients (``stage.TRANSIENT_TERMS``) plus the implementation's small
    tensors (``seqpar.measure.stages.peak_implementation_terms``)."""
    from seqpar.analysis.formulas.stage import STATE_TERMS, TRANSIENT_TERMS
    from seqpar.measure.stages import peak_implementation_terms

    p, t, bad, held = job.parallel, job.train, [], {}
    for x in ranks:
        plan, who = stages[x["pp_rank"]], f"rank {x['rank']} (pp {x['pp_rank']})"
        acts = sum(v for k, v in plan.items() if k not in STATE_TERMS + TRANSIENT_TERMS)
        impl = sum(  # at the formula's peak (a zero-bubble one may be a B's end)
            peak_implementation_terms(
                job.model, p, job.recompute, t.micro_batch, t.microbatches(p.dp), x["pp_rank"]
            ).values()
        )
        for name, got, want in (
            ("parameters", x["params_bytes"], plan["parameters"]),
            ("gradients", x["grads_bytes"], plan["gradients"] + 4 * x["grad_padding"]),
            ("activations", x["act_peak_measured"], acts + impl),
        ):
            if got != want:
                bad.append(f"{who} {name}: measured {got:,} != planned {want:,.0f}")
        held.setdefault((x["pp_rank"], x["tp_rank"]), []).append(x["optimizer_bytes"])
    for (pp, tp), values in held.items():
        planned = stages[pp]["optimizer_states"]
        pairs = (
            [(sum(values), len(values) * planned)]
            if t.distributed_optimizer
            else [(v, planned) for v in values]
        )
        bad += [f"pp {pp} tp {tp} optimizer: measured {got:,} != planned {want:,.0f}"
                for got, want in pairs if abs(got - want) > 1e-3]
    return bad


def step_records(out) -> list[dict]:
    """The per-step records of a run's ``metrics.jsonl`` in ``out`` (no events), by step."""
    import json
    from pathlib import Path

    lines = Path(out, "metrics.jsonl").read_text().splitlines()
    return sorted(
        (r for r in map(json.loads, lines) if "event" not in r and "step" in r),
        key=lambda r: r["step"],
    )
