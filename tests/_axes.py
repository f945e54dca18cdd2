"""The axes every generated check draws (issue 56), in one place: each axis' values, and the rules
that join them to a check's layout. A new option is one entry in ``AXES``: every check draws it, and
a check it does not apply to says so in its report.

Checks: ``equivalence`` and ``equivalence_moe`` (trained against the single process), ``stages``
(measured == exact stage peaks and host bytes), ``plan_loop`` (plan == dry run == measured),
``resume`` (a checkpoint's parallel settings resumed at another layout,
``tests/test_resume_layout.py``: no ranks started), ``faults`` (a drawn fault in a
``seqpar train --nproc --max-restarts`` job, ``tests/test_fault_draws.py``) and ``resume_train``
(trained at one drawn layout, stopped, resumed at another, ``tests/test_resume_train_draws.py``).
The fixed cases of ``tests/test_reliability_*.py`` and ``tests/test_checkpoint_resume.py`` draw
nothing.

A check draws with ``draw(check, key)`` (each axis from its own stream seeded by ``"{axis} {key}"``,
so adding an axis moves no other axis' draws), then fits the draw to its layout with the rules below
(``fit_*``): a value that does not apply, or that the rules exclude, is replaced and the replacement
recorded in ``Draw.narrowed`` (``report`` puts it in the test report: a printed line under ``-rA``
and a ``narrowed`` property). ``compile`` is drawn only with ``SEQPAR_AXES_COMPILE=1`` (or when
``SEQPAR_EQUIV_ONLY`` names it): it is slow on CPU. An axis of ``ONLY`` is drawn for the checks it
names and left at its default, unrecorded, for the rest (a fault means nothing to a check that
injects none): ``fault`` (the fault check).

Switches (draw counts): ``SEQPAR_EQUIV_DRAWS`` (equivalence, default 10), ``SEQPAR_RESUME_DRAWS``
(resume, 300), ``SEQPAR_FAULT_DRAWS`` (faults, 1), ``SEQPAR_RESUME_TRAIN_DRAWS`` (resume_train, 1);
``SEQPAR_FAULT_WORLD`` and ``SEQPAR_RESUME_TRAIN_WORLD`` (the world sizes those two draw from,
default ``2``, e.g. ``2,4``).

Why here (``tests/``) and not ``seqpar/testing.py``: these are the test suite's sampling rules, read
with its environment switches; ``seqpar.testing`` holds the parity helpers a user's own check may
import."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from seqpar.analysis.formulas.zbv_order import v_split
from seqpar.config import OFFLOAD_INSIDE, ConfigError, ModelConfig, ParallelConfig, RecomputeConfig

AXES = {  # axis: the values a draw takes (the first is the default a narrowed draw falls back to)
    # at a fixed global batch (the dense reference runs 1, the MoE one the same)
    "micro_batch": (1, 2, 4),
    # raised to a multiple of micro-batch × dp (× pp interleaved) by fit_batch
    "global_batch": (4, 8, 12),
    "steps": (5, 8),
    "dtype": ("fp32", "bf16"),  # bf16: BF16_TOLERANCE
    "label_smoothing": (0.0, 0.1),
    # random ids, or a prepared folder of short documents with masks
    "data": ("windows", "documents"),
    "offload": ((), ("mlp",), ("norm", "core_attention"), ("activation", "layer_input")),
    "cp_comm_type": ("ring", "a2a", "a2a+ring"),  # a2a+ring: K 2 (needs cp 4)
    "fsdp": ("off", "fsdp", "hsdp"),  # hsdp: FSDP2 sharded over groups of 2 of the dp × cp ranks
    "reshard_after_forward": (True, False),  # under fsdp: ZeRO-3 or ZeRO-2
    "ep": (1, 2, 4),  # expert parallelism (MoE checks)
    # zb-h1: the linears' W deferred into the bubble (needs pp > 1, one chunk); zb-v: two chunks
    # per rank in a V (and its layer split, fit_pp_schedule)
    "pp_schedule": ("1f1b", "zb-h1", "zb-v"),
    # zb-v's layer split: 1F1B's layers per rank halved, or the V's own balance as the planner
    # weighs it (uneven.v_lighter_split: rank 0 a layer lighter, each chunk 1 the larger half)
    "v_split": ("halves", "balanced"),
    "compile": (False, True),  # SEQPAR_AXES_COMPILE=1 only
    # the distributed optimizer's weight all-gather under the next forward
    # (train.overlap_param_gather)
    "overlap_param_gather": (False, True),
    # SP's collectives in tp ring chunks pipelined with the GEMMs (seqpar/parallel/tp_overlap.py):
    # needs sp at tp > 1
    "tp_comm_overlap": (False, True),
    # the fault check: a rank raising or SIGKILLed before a drawn step, SIGKILLed while saving, the
    # latest checkpoint damaged on disk before a failure, SIGTERM reaching one rank (fit_fault:
    # where each applies)
    "fault": ("none", "raise", "kill", "kill_in_save", "damaged_latest", "sigterm"),
}
# axes drawn for these checks only (the rest keep the default, unrecorded)
ONLY = {"fault": ("faults",), "v_split": ("stages", "resume", "plan_loop")}
COMPILE_SWITCH = "SEQPAR_AXES_COMPILE"
TOLERANCE = 1e-5  # relative, fp32: every step's loss and grad norm, every final weight
# relative, bf16 (one bf16 ulp is 7.8e-3), measured over the bf16 draws of the CI samples and the
# SEQPAR_EQUIV_ONLY slices, 5 and 8 steps): worst loss 1.5e-4, grad_norm 6.8e-3, weights 3.8e-2 (a
# zero-initialised LayerNorm bias of an MoE draw after 8 Adam steps; dense 1.7e-2)
BF16_TOLERANCE = {"loss": 1e-2, "grad_norm": 3e-2, "weights": 1e-1}


@dataclass
class Draw:
    """One draw's axis values (after the check's rules) and what they narrowed."""
    check: str
    key: object
    values: dict
    narrowed: list[str] = field(default_factory=list)

    def __getitem__(self, axis: str):
        return self.values[axis]

    def narrow(self, axis: str, value, why: str) -> None:
        """Replace ``axis``'s value by ``value`` (recorded with ``why`` when it changes)."""
        if self.values[axis] != value:
            self.narrowed.append(f"{axis} {shown(self.values[axis])} -> {shown(value)}: {why}")
            self.values[axis] = value

    def fixed(self, reasons: dict[str, str]) -> Draw:
        """Axes this check does not draw, each back to its default with the reason
        (``{axis: why}``)."""
        for axis, why in reasons.items():
            self.narrow(axis, AXES[axis][0], why)
        return self


def shown(value) -> str:
    """A value as a report and ``SEQPAR_EQUIV_ONLY`` write it: a tuple's items joined by ``+``,
    ``()`` as none."""
    return "+".join(value) or "none" if isinstance(value, tuple) else str(value)


def compile_drawn(env=os.environ) -> bool:
    return env.get(COMPILE_SWITCH) == "1" or "compile=" in env.get("SEQPAR_EQUIV_ONLY", "")


def draw(check: str, key, env=os.environ) -> Draw:
    """Every axis' value for ``key`` of ``check`` (each from its own seeded stream)."""
    values = {
        axis: random.Random(f"{axis} {key}").choice(options)
        if check in ONLY.get(axis, (check,))
        else options[0]
        for axis, options in AXES.items()
    }
    if not compile_drawn(env):
        values["compile"] = False
    return Draw(check, key, values)


def tolerance(d: Draw, quantity: str) -> float:
    """The relative error ``quantity`` (loss, grad_norm, weights) may have against the single
    process."""
    return BF16_TOLERANCE[quantity] if d["dtype"] == "bf16" else TOLERANCE


def report(d: Draw, record_property=None) -> str:
    """The draw's narrowings as one line (printed, and a ``narrowed`` property of the test when
    given)."""
    line = f"narrowed ({d.check} {d.key}): " + ("; ".join(d.narrowed) or "nothing")
    if record_property is not None:
        record_property("narrowed", "; ".join(d.narrowed))
    print(f"\n{line}")
    return line


# The rules that join the axes to a layout: each narrows what the layout cannot take, saying why.

def fit_cp_comm(d: Draw, model: dict, tp: int, cp: int) -> dict:
    """The ``parallel`` keys of the drawn exchange: a2a needs cp > 1 and the heads split over tp × K
    (K 2 for a2a+ring, which needs cp 4); ``ParallelConfig.validate`` decides."""
    if cp < 2:
        d.narrow("cp_comm_type", "ring", "cp 1 has no exchange")
    elif d["cp_comm_type"] == "a2a+ring" and cp < 4:
        d.narrow("cp_comm_type", "a2a", f"a2a+ring (K 2) needs cp 4, got cp {cp}")
    kind = d["cp_comm_type"]
    if kind != "ring":
        keys = {"cp_comm_type": kind} | ({"cp_a2a_size": 2} if kind == "a2a+ring" else {})
        try:
            ParallelConfig(tp=tp, cp=cp, **keys).validate(ModelConfig(**model))
        except ConfigError as e:
            d.narrow("cp_comm_type", "ring", str(e))
    kind = d["cp_comm_type"]
    return (
        {}
        if kind == "ring"
        else {"cp_comm_type": kind} | ({"cp_a2a_size": 2} if kind == "a2a+ring" else {})
    )


def fit_offload(d: Draw, recompute: RecomputeConfig) -> tuple[str, ...]:
    """The drawn offload modules the recomputation does not rebuild (a module is kept, recomputed or
    offloaded: ``RecomputeConfig.validate``'s rule)."""
    rebuilt = set(recompute.recomputed_modules)
    kept = tuple(m for m in d["offload"] if not rebuilt & {m, *OFFLOAD_INSIDE.get(m, ())})
    d.narrow("offload", kept, f"recompute {recompute.label} rebuilds the rest")
    return kept


def fit_fsdp(d: Draw, dp: int, cp: int, experts: int = 0) -> dict:
    """The ``parallel`` keys of the drawn FSDP2 mode: it needs dp × cp > 1 and no experts; hsdp
    (groups of 2) needs dp × cp >= 4; reshard_after_forward means something under fsdp only."""
    mode, group = d["fsdp"], dp * cp
    if mode != "off" and experts:
        d.narrow("fsdp", "off", f"fsdp with {experts} experts is refused (ParallelConfig)")
    elif mode != "off" and group < 2:
        d.narrow("fsdp", "off", f"dp {dp} × cp {cp} = {group}: nothing to shard over")
    elif mode == "hsdp" and group < 4:
        d.narrow("fsdp", "fsdp", f"hsdp in groups of 2 needs dp × cp >= 4, got {group}")
    if d["fsdp"] == "off":
        d.narrow("reshard_after_forward", True, "fsdp is off")
        return {}
    return {"fsdp": True, "reshard_after_forward": d["reshard_after_forward"]} | \
        ({"fsdp_shard_size": 2} if d["fsdp"] == "hsdp" else {})


def fit_pp_schedule(
    d: Draw, pp: int, interleave: int, layers: int | None = None,
    split: tuple[int, ...] | list[int] = (), recompute_modules=(),
) -> dict:
    """The ``parallel`` keys of the drawn pipeline schedule: a zero-bubble one needs pp > 1 and one
    chunk per rank (``ParallelConfig`` refuses the rest; the TP ring defers its W as the plain
    linears do; FSDP reduce-scatters once every W has run);
    1f1b is the default, no key. zb-v cuts the check's ``layers`` (split ``split`` over pp under
    1F1B) into 2p chunks: its ``layer_split`` gives each rank 1F1B's layers (``zbv_order.v_split``),
    or, where that leaves a middle chunk empty, one layer to each middle chunk and the rest to the
    last (``v_layer_split``); a check that gives no ``layers`` (or too few) draws zb-h1 instead."""
    if d["pp_schedule"] != "1f1b":
        why = (
            "pp 1 has no pipeline schedule"
            if pp == 1
            else f"interleave {interleave} runs interleaved 1F1B"
            if interleave > 1
            else "zero bubble with the recompute module norm is refused (RunConfig: its released "
                 "output is a deferred W's input)"
            if "norm" in recompute_modules
            else ""
        )
        if why:
            d.narrow("pp_schedule", "1f1b", why)
    if d["pp_schedule"] != "zb-v":
        d.narrow("v_split", "halves", "only zb-v cuts its layers in a V")
    if d["pp_schedule"] == "zb-v":
        v = None if layers is None else v_layer_split(layers, pp, split, d["v_split"])
        if v is None:
            d.narrow("pp_schedule", "zb-h1", f"zb-v needs {2 * pp - 2} layers or more to cut into "
                     f"2 × pp {pp} chunks" if layers is not None else "the check gives no layers")
        else:
            return {"pp_schedule": "zb-v", "layer_split": tuple(v)}  # replaces 1F1B's split
    return {} if d["pp_schedule"] == "1f1b" else {"pp_schedule": d["pp_schedule"]}


def v_layer_split(layers: int, pp: int, split=(), kind: str = "halves") -> tuple[int, ...] | None:
    """zb-v's layer split (2p entries; () when even) for ``layers`` split ``split`` over pp ranks
    under 1F1B (fit_pp_schedule), each rank's layers halved (``kind`` balanced: a layer of rank 0's
    moved to the last rank, each rank's chunk 1 the larger half, as the planner's V balance cuts
    it); None when the layers are too few."""
    per_rank = list(split) or [layers // pp + (r < layers % pp) for r in range(pp)]
    if kind == "balanced" and per_rank[0] > 1:
        per_rank[0], per_rank[-1] = per_rank[0] - 1, per_rank[-1] + 1
    v = v_split(per_rank)
    if v is not None and kind == "balanced":  # chunk 1 (stage 2p - 1 - r) the larger half
        counts = list(v) or [layers // (2 * pp)] * (2 * pp)
        for r in range(pp):
            c = counts[r] + counts[2 * pp - 1 - r]
            counts[r], counts[2 * pp - 1 - r] = c // 2, c - c // 2
        return () if len(set(counts)) == 1 else tuple(counts)
    if v is not None:
        return v
    if layers < 2 * pp - 2:
        return None
    return (0, *([1] * (2 * pp - 2)), layers - (2 * pp - 2))


def fit_batch(d: Draw, dp: int, pp: int, interleave: int) -> int:
    """The drawn global batch, raised to a multiple of micro-batch × dp (× pp under interleaving:
    the schedule takes microbatches in groups of pp)."""
    unit = d["micro_batch"] * dp * (pp if interleave > 1 else 1)
    batch = -(-d["global_batch"] // unit) * unit
    d.narrow("global_batch", batch, f"a multiple of micro-batch {d['micro_batch']} × dp {dp}"
             + (f" × pp {pp} (interleaved)" if interleave > 1 else ""))
    return batch


def fit_ep(d: Draw, dp: int, cp: int) -> int:
    """The drawn expert parallelism, the largest value <= it that divides dp × cp."""
    ep = max(e for e in AXES["ep"] if e <= d["ep"] and (dp * cp) % e == 0)
    d.narrow("ep", ep, f"ep divides dp {dp} × cp {cp}")
    return ep


def fit_param_gather(d: Draw, distributed_optimizer: bool, dp: int, cp: int) -> bool:
    """The drawn weight gather under the forward: it needs the distributed optimizer
    (``JobConfig.validate`` refuses it otherwise) and dp × cp > 1 (nothing to gather)."""
    if not distributed_optimizer:
        d.narrow(
            "overlap_param_gather",
            False,
            "the replicated optimizer gathers nothing (needs the distributed one)",
        )
    elif dp * cp < 2:
        d.narrow("overlap_param_gather", False, f"dp {dp} × cp {cp} = {dp * cp}: nothing to gather")
    return d["overlap_param_gather"]


def fit_tp_comm_overlap(d: Draw, tp: int, sp: bool) -> dict:
    """The ``parallel`` key of the drawn TP-communication overlap: it pipelines sequence
    parallelism's collectives, so it needs sp at tp > 1 (``ParallelConfig.validate``'s rule)."""
    if d["tp_comm_overlap"] and not (sp and tp > 1):
        d.narrow("tp_comm_overlap", False, f"needs sequence parallelism at tp > 1, got tp {tp}, "
                 f"sp {'on' if sp else 'off'}")
    return {"tp_comm_overlap": True} if d["tp_comm_overlap"] else {}


def fit_compile(d: Draw, offload: tuple[str, ...]) -> bool:
    if d["compile"] and offload:
        d.narrow(
            "compile",
            False,
            "offloading runs eager (TrainJob refuses compile with offload modules)",
        )
    return d["compile"]


@dataclass(frozen=True)
class Fault:
    """A drawn fault fitted to a run: what ``SEQPAR_FAULT`` says
    (``seqpar/train/reliability/fault.py``), the rank and step it hits, and the checkpoint step a
    restart must resume (0: none)."""
    kind: str
    rank: int
    step: int
    spec: str
    resumes: int


def fit_fault(d: Draw, world: int, steps: int, save_every: int) -> Fault:
    """The drawn fault at a rank and step drawn from its own streams: a failure before step K >
    save_every (a checkpoint kept), a kill in the save of step K (a save step after the first: one
    kept before it), a damaged latest checkpoint (two saved before K: the restart passes over the
    newer), SIGTERM (any step; the job saves and exits 130, the test resumes it). A drawn ``none``
    is narrowed to ``raise`` (the check injects one)."""
    if d["fault"] == "none":
        d.narrow("fault", "raise", "the fault check injects a fault")
    kind = d["fault"]
    if kind == "damaged_latest" and steps <= 2 * save_every:
        d.narrow(
            "fault",
            "raise",
            f"two checkpoints before the fault need steps > {2 * save_every}, got {steps}",
        )
        kind = d["fault"]
    rank = random.Random(f"fault rank {d.key}").randrange(world)
    pick = random.Random(f"fault step {d.key}")
    if kind == "kill_in_save":
        step = pick.choice([s for s in range(2 * save_every, steps, save_every)])
        return Fault(
            kind,
            rank,
            step,
            f"rank={rank},step={step},at=save,do=kill,attempt=0",
            step - save_every,
        )
    low = 2 * save_every + 1 if kind == "damaged_latest" else save_every + 1
    step = pick.randint(low, steps)
    kept = (step - 1) // save_every * save_every
    do = {"raise": "raise", "kill": "kill", "damaged_latest": "damage", "sigterm": "term"}[kind]
    return Fault(kind, rank, step, f"rank={rank},step={step},do={do},attempt=0",
                 kept - save_every if kind == "damaged_latest" else kept)
