"""`seqpar plan`: enumerate layouts, keep those whose most loaded rank fits, rank by predicted time.

Dimensions: tp (<= GPUs per node, dividing heads and FFN width), ep (an MoE model's experts split
over ep of the dp × cp ranks: every divisor that divides the experts), cp (context parallelism over
the sequence: 2 cp dividing s, searched with pp = 1, up to ``Request.max_cp``; its exchange
``cp_comm_type`` ring, a2a, or a2a+ring for each K dividing cp, where the heads split over tp × K),
pp (up to L: even when it divides L, and with the lighter-ends split of ``uneven.py``), dp (the
rest, dividing the global batch), interleave m (m > 1 needs pp > 1 and the microbatch count
divisible by pp, as Megatron requires; L divisible by pp m, or where pp does not divide L an uneven
split over the pp m virtual stages, the model's ends lighter), SP on/off (tp > 1), microbatch,
recompute: none, selective (not with fused attention), full-uniform-1, full-block-N (the smallest N
that fits), and App. C (selective or full with the most kept chunk-microbatches that fit; not with
an uneven interleaved split). Memory: ``stage.stage_memory`` on ``stage.examined_ranks`` (rank 0,
the last, the first of each set of chunk sizes: the in-flight count falls with the rank, so they
bound the rest). Time: ``costmodel.iteration_time``. Usable memory = GPU memory x (1 - reserve). The
rules named above are the config's (``ParallelConfig.validate``, ``validate_microbatches``): the
planner asks them of each candidate and counts the refusals; its own are tp within a node, dp
dividing the global batch and the search limits. It drops plans dominated at their layout
(``undominated``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache

from seqpar.analysis.formulas.shapes import (
    ActivationOptions,
    AnalysisError,
    OptimizerOptions,
    validate_layout,
)
from seqpar.analysis.formulas.stage import (
    StageMemory,
    all_stages,
    examined_ranks,
    most_loaded,
    offloaded_bytes,
    stage_memory,
    uneven_chunks,
)
from seqpar.analysis.formulas.states import bytes_per_parameter
from seqpar.analysis.formulas.zbv_order import v_split
from seqpar.analysis.planning.costmodel import (
    Hardware,
    IterationTime,
    iteration_time,
    predicted_mfu,
)
from seqpar.analysis.planning.uneven import lighter_ends_split, v_lighter_split
from seqpar.analysis.text import human_bytes
from seqpar.config import (
    PP_SCHEDULES,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    validate_microbatches,
)
from seqpar.settings import label_keys, label_of

TIE_FRACTION = 0.01  # predicted times closer than 1% count as equal; less memory wins
# --offload: the module sets each recompute option may also offload (``seqpar.recompute.offload``),
# lightest first; a set the option recomputes part of is skipped (a module is kept, recomputed or
# offloaded)
OFFLOAD_CHOICES = (("mlp",), ("mlp", "norm"), ("core_attention", "mlp", "norm"), ("layer_input",),
                   ("core_attention", "mlp", "norm", "layer_input"))


@dataclass(frozen=True)
class Plan:
    """One point of the search space."""

    par: ParallelConfig
    rc: RecomputeConfig
    micro_batch: int
    distributed_optimizer: bool = False
    # the distributed optimizer's weight gather under the next forward
    overlap_param_gather: bool = False

    @property
    def label(self) -> str:
        """``tp=8,pp=4,dp=2,m=1,sp=on,recompute=selective,mb=1``: each key the table of settings'
        plan label (``seqpar.settings``), read back by ``parse_plan``."""
        p, k = self.par, label_of
        cp = (
            f"{k('parallel.cp')}={p.cp},{k('parallel.cp_comm_type')}={p.cp_comm_type},"
            if p.cp > 1
            else ""
        )
        cp += f"{k('parallel.cp_a2a_size')}={p.cp_a2a_size}," if p.cp_a2a_size else ""
        split = f"{k('parallel.layer_split')}={split_text(p.layer_split)}," if p.layer_split else ""
        ep = f"{k('parallel.ep')}={p.ep}," if p.ep > 1 else ""
        offload = f",{k('recompute.offload_modules')}={'/'.join(self.rc.offload_modules)}" \
            if self.rc.offload_modules else ""
        text = (
            f"{k('parallel.tp')}={p.tp},{cp}{k('parallel.pp')}={p.pp},{split}{k('parallel.dp')}={p.dp},{ep}"
            f"{k('parallel.interleave')}={p.interleave},{k('parallel.sp')}={'on' if p.sp else 'off'},"
            f"{k('recompute.granularity')}={replace(self.rc, offload_modules=()).label}{offload},"
            f"{k('train.micro_batch')}={self.micro_batch}"
        )
        return (
            text
            + (f",{k('train.distributed_optimizer')}=on" if self.distributed_optimizer else "")
            + (f",{k('train.overlap_param_gather')}=on" if self.overlap_param_gather else "")
            + (f",{k('parallel.fsdp')}=on" if p.fsdp else "")
            + (f",{k('parallel.pp_schedule')}={p.pp_schedule}" if p.pp_schedule != "1f1b" else "")
        )


# -------------------------------------------------------- a plan as text: ``Plan.label`` writes it,
# ``parse_plan`` reads it back (``--explain``), with the keys' long names as aliases: both from the
# table of settings (``seqpar.settings``, each setting's ``labels``)
_KEYS = label_keys()


def _flag(text: str) -> bool:
    low = text.lower()
    if low in ("1", "on", "true", "yes"):
        return True
    if low in ("0", "off", "false", "no"):
        return False
    raise AnalysisError(f"expected on/off, got {text!r}")


def parse_recompute(text: str, keep: int = 0) -> RecomputeConfig:
    """'none' | 'selective' | 'full' | 'full-uniform-N' | 'full-block-N', optional '+keepK' (App.
    C)."""
    body, _, suffix = text.partition("+keep")
    parts = body.split("-")
    try:
        if suffix:
            if not suffix.isdigit():
                raise AnalysisError(f"keep {suffix!r} is not an integer >= 0")
            keep = int(suffix)
        if parts[0] == "full" and len(parts) == 3:
            return RecomputeConfig(
                "full", parts[1], int(parts[2]), keep_microbatches=keep
            ).validate()
        if len(parts) == 1:
            return RecomputeConfig(parts[0], keep_microbatches=keep).validate()
    except ValueError as err:
        raise AnalysisError(f"recompute {text!r}: {err}") from err
    raise AnalysisError(
        f"recompute {text!r} is not none, selective, full, full-uniform-N or full-block-N"
    )


def _count(values: dict[str, tuple[str, str]], key: str, default: int, least: int = 1) -> int:
    """The integer given for ``key`` (``default`` when absent), at least ``least``."""
    name, text = values.get(key, (key, str(default)))
    try:
        number = int(text)
    except ValueError:
        number = None
    if number is None or number < least:
        rule = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise AnalysisError(f"{name} must be {rule}, got {text!r}")
    return number


def split_text(counts: tuple[int, ...]) -> str:
    """Layers per stage joined by '/', a run of three or more as COUNTxRUN: (7, 8, 8, 8, 7) ->
    '7/8x3/7'."""
    parts: list[list[int]] = []
    for c in counts:
        if parts and parts[-1][0] == c:
            parts[-1][1] += 1
        else:
            parts.append([c, 1])
    return "/".join(f"{c}x{k}" if k > 2 else "/".join([str(c)] * k) for c, k in parts)


def _split(values: dict[str, tuple[str, str]]) -> tuple[int, ...]:
    """``split=7/8x14/7`` (``split_text``): layers per pipeline stage
    (``ParallelConfig.layer_split``); () when absent."""
    if "split" not in values:
        return ()
    name, text = values["split"]
    counts: list[int] = []
    for part in text.split("/"):
        count, times, run = part.strip().partition("x")
        run = run if times else "1"
        if not count.isdigit() or not run.isdigit() or int(run) < 1:
            raise AnalysisError(
                f"{name} must be layer counts joined by '/' (a run as COUNTxRUN), e.g. 7/8x14/7, "
                f"got {text!r}"
            )
        counts += [int(count)] * int(run)
    return tuple(counts)


def parse_plan(text: str, gpus: int) -> Plan:
    """'tp=8,pp=35,m=3,sp=on,recompute=selective,mb=1' -> Plan (``split=7/8/8/7``: an uneven layer
    split); dp defaults to gpus / (tp pp cp).

    Every count must be a positive integer (keep >= 0): the error names the key and the value."""
    values: dict[str, tuple[str, str]] = {}  # canonical key -> (the key as written, value)
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in _KEYS:
            raise AnalysisError(
                f"plan item {item!r}: expected KEY=VALUE with KEY in {sorted(_KEYS)}"
            )
        values[_KEYS[key.strip()]] = (key.strip(), value.strip())
    try:
        tp, pp, cp = _count(values, "tp", 1), _count(values, "pp", 1), _count(values, "cp", 1)
        dp = _count(values, "dp", max(1, gpus // (tp * pp * cp)))
        par = ParallelConfig(
            tp=tp,
            pp=pp,
            dp=dp,
            cp=cp,
            sp=_flag(values.get("sp", ("", "off"))[1]),
            interleave=_count(values, "m", 1),
            layer_split=_split(values),
            ep=_count(values, "ep", 1),
            fsdp=_flag(values.get("fsdp", ("", "off"))[1]),
            cp_comm_type=values.get("cp_comm_type", ("", "ring"))[1],
            cp_a2a_size=_count(values, "cp_a2a_size", 0, least=0),
            pp_schedule=values.get("sched", ("", "1f1b"))[1],
        )
        rc = parse_recompute(
            values.get("recompute", ("", "none"))[1], _count(values, "keep", 0, least=0)
        )
        if "offload" in values:  # offload=mlp/norm
            rc = replace(
                rc, offload_modules=tuple(m for m in values["offload"][1].split("/") if m)
            ).validate()
        dist, gather = (_flag(values.get(key, ("", "off"))[1]) for key in ("distopt", "pgather"))
        if gather and not dist:
            raise AnalysisError(
                f"{values['pgather'][0]}=on gathers the distributed optimizer's weights: it needs "
                "distopt=on"
            )
        return Plan(par, rc, _count(values, "mb", 1), dist, gather)
    except ValueError as err:  # AnalysisError is one
        raise AnalysisError(f"plan {text!r}: {err}") from err


@dataclass(frozen=True)
class Request:
    """What the user asks: model, GPUs, batch, machine, byte widths."""

    shape: ModelConfig
    gpus: int
    global_batch: int
    hw: Hardware = field(default_factory=Hardware)
    opts: ActivationOptions = field(default_factory=ActivationOptions)
    opt: OptimizerOptions = field(default_factory=OptimizerOptions)
    try_distributed_optimizer: bool = False
    # also the distributed optimizer's plans with the weight gather under the forward
    # (train.overlap_param_gather)
    try_overlap_param_gather: bool = False
    # also plans with FSDP over dp × cp (parameters, gradients, optimizer sharded)
    try_fsdp: bool = False
    # also plans that offload modules' activations to host memory (OFFLOAD_CHOICES)
    try_offload: bool = False
    max_micro_batch: int = 16
    max_interleave: int = 8
    max_cp: int = 16
    # the pipeline schedules searched (where pp > 1, one chunk per rank)
    schedules: tuple[str, ...] = PP_SCHEDULES
    # what ``opt`` and ``opts.act_bytes`` stand for (reported, not re-derived)
    precision: str = "bf16"
    dropout: float = 0.1  # the probability behind ``opts.dropout`` (reported)
    name: str = "custom"  # the model preset's name, as the reports print it


def settings(req: Request) -> dict:
    """The assumptions every plan of ``req`` shares, as the reports print them."""
    return {"precision": req.precision, "bytes_per_parameter": bytes_per_parameter(req.opt),
            "activation_bytes": req.opts.act_bytes, "dropout": req.dropout,
            "fused_attention": req.opts.fused_attention, "sdpa_kernel": req.opts.sdpa_kernel}


@dataclass
class Evaluation:
    """A plan with its memory per (examined) rank, fit, predicted time and MFU, or why it is
    invalid."""

    plan: Plan
    stages: list[StageMemory] = field(default_factory=list)
    time: IterationTime | None = None
    mfu: float = 0.0
    fits: bool = False
    error: str | None = None
    usable_bytes: float = 0.0
    host_usable_bytes: float = 0.0  # a node's host memory for offloaded activations, per GPU
    # over the host link, both directions, the rank that moves the most
    offload_bytes_per_step: float = 0.0

    @property
    def peak(self) -> StageMemory | None:
        return most_loaded(self.stages) if self.stages else None

    @property
    def memory_bytes(self) -> float:
        return self.peak.total if self.stages else 0.0

    @property
    def host_bytes(self) -> float:
        """Offloaded activations in host memory on the examined rank that holds the most."""
        return max((s.host_total for s in self.stages), default=0.0)

    def to_json(self) -> dict:
        p = self.plan.par
        out = {
            "tp": p.tp,
            "cp": p.cp,
            "cp_comm_type": p.cp_comm_type,
            "cp_a2a_size": p.a2a_size,
            "pp": p.pp,
            "dp": p.dp,
            "ep": p.ep,
            "interleave": p.interleave,
            "sp": p.sp,
            "recompute": self.plan.rc.label,
            "micro_batch": self.plan.micro_batch,
            "distributed_optimizer": self.plan.distributed_optimizer,
            "overlap_param_gather": self.plan.overlap_param_gather,
            "fsdp": p.fsdp,
            "memory_bytes": self.memory_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "predicted_iteration_s": self.time.total if self.time else None,
            "predicted_mfu": self.mfu if self.time else None,
        }
        if self.peak is not None:
            out["most_loaded_rank"] = self.peak.rank
            out["memory_terms"] = dict(self.peak.terms)
        if self.time is not None:
            out["time_terms"] = dict(self.time.terms)
            # run under compute, not in the iteration time
            out["hidden_time_terms"] = dict(self.time.hidden)
        if self.plan.rc.offload_modules:
            out |= {
                "offload_modules": list(self.plan.rc.offload_modules),
                "host_bytes": self.host_bytes,
                "offload_bytes_per_step": self.offload_bytes_per_step,
            }
        if self.error:
            out["error"] = self.error
        return out


def stages_json(stages: list[StageMemory]) -> list[dict]:
    """Each examined pipeline rank's bytes (one tp rank of it; every dp rank alike), term by
    term."""
    return [
        {"rank": s.rank, "in_flight": s.in_flight, "terms": dict(s.terms), "total": s.total}
        for s in stages
    ]


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in sqrt(n) steps (``--gpus 2147483647`` answers at
    once)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _opt(req: Request, plan: Plan) -> OptimizerOptions:
    """The plan's optimizer options: ``req.opt`` (what a published run used, or the plan command's
    flags) with the plan's distributed optimizer and weight gather under the forward."""
    return replace(req.opt, distributed=plan.distributed_optimizer,
                   overlap_param_gather=req.opt.overlap_param_gather or plan.overlap_param_gather)


def num_microbatches(req: Request, plan: Plan) -> int:
    return req.global_batch // (plan.par.dp * plan.micro_batch)


def check_plan(req: Request, plan: Plan) -> None:
    """Raise AnalysisError naming the numbers when ``plan`` cannot run ``req``."""
    p = plan.par
    if (
        not isinstance(plan.micro_batch, int)
        or isinstance(plan.micro_batch, bool)
        or plan.micro_batch < 1
    ):
        raise AnalysisError(f"micro batch must be a positive integer, got {plan.micro_batch!r}")
    plan.rc.validate(validate_layout(req.shape, p))
    if p.world_size != req.gpus:
        raise AnalysisError(
            f"{p.describe_world()} = {p.world_size} != gpus {req.gpus}".replace("×", "x")
        )
    if p.tp > req.hw.gpus_per_node:
        raise AnalysisError(f"tp {p.tp} exceeds the {req.hw.gpus_per_node} GPUs of a node")
    if req.global_batch % (p.dp * plan.micro_batch):
        raise AnalysisError(f"global batch {req.global_batch} is not divisible by dp {p.dp} x "
                            f"micro batch {plan.micro_batch}")
    validate_microbatches(num_microbatches(req, plan), p.pp, p.interleave)


def stages_of(req: Request, plan: Plan, every_rank: bool = False) -> list[StageMemory]:
    """Memory of rank 0 and the last rank (or of every rank)."""
    n = num_microbatches(req, plan)
    args = (req.shape, plan.par, plan.rc, plan.micro_batch, n, req.opts, _opt(req, plan))
    if every_rank:
        return all_stages(*args)
    return list(_examined_stages(*args))


# the search asks it of a plan for its fit (recompute_options), then for its evaluation
@lru_cache(maxsize=4096)
def _examined_stages(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int, n: int,
                     opts: ActivationOptions, opt: OptimizerOptions) -> tuple[StageMemory, ...]:
    return tuple(
        stage_memory(shape, par, rc, b, n, opts, opt, rank=r) for r in examined_ranks(shape, par)
    )


def fits(req: Request, plan: Plan) -> bool:
    stages = stages_of(req, plan)
    return (most_loaded(stages).total <= req.hw.usable_bytes
            and max(s.host_total for s in stages) <= req.hw.host_usable_bytes)


def offload_bytes_per_step(req: Request, plan: Plan) -> float:
    """Bytes one GPU moves over its host link per iteration: every microbatch's offloaded
    activations out during its forward and back during its backward (the examined rank that moves
    the most)."""
    n, p = num_microbatches(req, plan), plan.par
    return max(2 * n * offloaded_bytes(req.shape, p, plan.rc, plan.micro_batch, req.opts, r)
               for r in examined_ranks(req.shape, p))


def offload_options(req: Request, options: list[RecomputeConfig]) -> list[RecomputeConfig]:
    """``options`` each with every ``OFFLOAD_CHOICES`` set it allows (``--offload``)."""
    out = []
    for rc in options:
        for modules in OFFLOAD_CHOICES:
            if (
                "core_attention" in modules
                and not req.opts.fused_attention
                and rc.granularity == "none"
            ):
                continue  # the s² terms over the host link: selective recomputation's job
            try:
                out.append(replace(rc, offload_modules=modules).validate())
            except ConfigError:
                continue
    return out


def evaluate(req: Request, plan: Plan, every_rank: bool = False, timed: bool = True) -> Evaluation:
    """Memory, fit, predicted time and MFU of one plan (``error`` set when it cannot run; without
    ``timed`` the time only where it fits: the search ranks nothing else)."""
    ev = Evaluation(
        plan=plan, usable_bytes=req.hw.usable_bytes, host_usable_bytes=req.hw.host_usable_bytes
    )
    try:
        check_plan(req, plan)
        ev.stages = stages_of(req, plan, every_rank)  # refuses chunks that differ in MoE layers
    except AnalysisError as err:
        ev.error = str(err)
        return ev
    ev.fits = ev.memory_bytes <= req.hw.usable_bytes and ev.host_bytes <= req.hw.host_usable_bytes
    if not timed and not ev.fits:
        return ev
    if plan.rc.offload_modules:
        ev.offload_bytes_per_step = offload_bytes_per_step(req, plan)
    ev.time = iteration_time(
        req.shape,
        plan.par,
        plan.rc,
        plan.micro_batch,
        req.global_batch,
        req.hw,
        _opt(req, plan),
        req.opts,
    )
    ev.mfu = predicted_mfu(req.shape, plan.par, req.global_batch, ev.time.total, req.hw)
    return ev


def _largest_fitting(lo: int, hi: int, ok) -> int | None:
    """Largest x in [lo, hi] with ok(x), ok monotone non-increasing in x; None if none."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def recompute_options(req: Request, base: Plan) -> list[RecomputeConfig]:
    """none, selective(dropout_mask) (with dropout, materialized core), selective, full-uniform-1,
    the cheapest fitting full-block-N and App. C variants."""
    # layers of a chunk (of the lightest non-empty stage if uneven)
    chunk = validate_layout(req.shape, base.par)
    # with fused attention the attention core keeps no s² tensors: selective recompute saves nothing
    # (``train`` warns it does nothing), so it is not a choice
    granularities = ("full",) if req.opts.fused_attention else ("selective", "full")
    options = [RecomputeConfig("none")] + [RecomputeConfig(g) for g in granularities]
    # beyond the paper: the mask regenerated, not kept
    if req.opts.dropout and not req.opts.fused_attention:
        options.insert(1, RecomputeConfig("selective", modules=("dropout_mask",)))

    def fits_with(rc: RecomputeConfig) -> bool:
        return fits(req, replace(base, rc=rc))

    if chunk > 1:  # fewest checkpointed layers that fit = least recompute
        smallest = _largest_fitting(
            -(chunk - 1), -1, lambda neg: fits_with(RecomputeConfig("full", "block", -neg))
        )
        if smallest is not None:
            options.append(RecomputeConfig("full", "block", -smallest))
    n = num_microbatches(req, base)
    in_flight = stage_memory(req.shape, base.par, RecomputeConfig(), base.micro_batch, n, req.opts,
                             _opt(req, base)).in_flight
    # App. C is not modelled over chunks
    if uneven_chunks(base.par, req.shape) or base.par.pp_schedule != "1f1b":
        return options  # of different sizes, nor beside deferred weight gradients
    for granularity in granularities:
        if fits_with(RecomputeConfig(granularity, keep_microbatches=in_flight)):
            continue  # keeping everything fits: plain "none" covers it
        k = _largest_fitting(
            1,
            in_flight - 1,
            lambda k, g=granularity: fits_with(RecomputeConfig(g, keep_microbatches=k)),
        )
        if k:
            options.append(RecomputeConfig(granularity, keep_microbatches=k))
    return options + (offload_options(req, options) if req.try_offload else [])


def _refused(
    req: Request, par: ParallelConfig, rejected: Counter | None = None, rule: str = ""
) -> bool:
    """Whether ``ParallelConfig.validate`` (the model's and the world's rules, each in its one home)
    refuses ``par`` on ``req``'s GPUs; a refusal is counted under ``rule`` when given."""
    try:
        par.validate(req.shape, req.gpus)
    except ConfigError:
        if rule:
            rejected[rule] += 1
        return True
    return False


def layouts(req: Request, rejected: Counter | None = None) -> Iterator[Plan]:
    """Every (tp, cp, pp with its layer split, dp, microbatch, m, sp, ep, optimizer) the rules
    allow, with recompute none (filled in later); ``rejected`` counts the layouts each rule ruled
    out (``rejection_lines`` words them). The rules are ``ParallelConfig.validate``'s and
    ``validate_microbatches``'; the planner's own are a node's GPUs for tp, the global batch for dp,
    and its search limits."""
    rejected = Counter() if rejected is None else rejected
    for tp in _divisors(min(req.hw.gpus_per_node, req.gpus)):
        # heads, FFN, kv, GPUs
        if _refused(req, ParallelConfig(tp=tp, dp=req.gpus // tp), rejected, "tp_split"):
            continue
        for base in _context_and_pipeline(req, tp, rejected):
            if req.global_batch % base.dp:
                rejected["batch_dp"] += 1
                continue
            for mb in _divisors(req.global_batch // base.dp):
                if mb > req.max_micro_batch:
                    break
                yield from _variants(req, base, mb, rejected)


def _variants(req: Request, base: ParallelConfig, mb: int, rejected: Counter) -> Iterator[Plan]:
    """At one (tp, cp, pp, split, dp) and microbatch: each interleave m (with its layer split), SP,
    ep and optimizer the rules allow (``rejected`` counts the ep values the experts do not
    divide)."""
    n = req.global_batch // (base.dp * mb)
    for m, split in _interleavings(req, base.pp, base.tp, base.layer_split):
        staged = replace(base, interleave=m, layer_split=split)
        if m > req.max_interleave or not _microbatches_ok(n, base.pp, m) or _refused(req, staged):
            continue
        for sp in (False, True) if base.tp > 1 else (False,):
            par = replace(staged, sp=sp)
            if _refused(req, par):
                continue
            group = par.dp * par.cp
            eps = [ep for ep in _divisors(group) if not _refused(req, replace(par, ep=ep))]
            if req.shape.experts:  # ep values the experts do not divide (the refusal names them)
                rejected["ep_experts"] += sum(
                    1 for ep in _divisors(group) if req.shape.experts % ep
                )
            for dist in (False, True) if req.try_distributed_optimizer and group > 1 else (False,):
                for gather in (False, True) if dist and req.try_overlap_param_gather else (False,):
                    for ep in eps:
                        for scheduled in _schedules(req, replace(par, ep=ep), mb):
                            yield with_tp_ring(
                                req,
                                Plan(
                                    scheduled,
                                    RecomputeConfig(),
                                    mb,
                                    dist,
                                    gather,
                                ),
                            )
            if req.try_fsdp and not _refused(req, replace(par, fsdp=True)):
                for scheduled in _schedules(req, replace(par, fsdp=True), mb):
                    yield with_tp_ring(req, Plan(scheduled, RecomputeConfig(), mb))


def with_tp_ring(req: Request, plan: Plan) -> Plan:
    """``plan`` with the TP ring on (``parallel.tp_comm_overlap``) where ``req`` searches it and the
    plan can run it: SP at tp > 1 (under a zero-bubble schedule the ring's B alone, its W deferred
    as the plain linears'). Its buffers then count in the plan's memory."""
    p = plan.par
    ring = req.opts.tp_comm_overlap and p.sp and p.tp > 1
    return (
        replace(plan, par=replace(p, tp_comm_overlap=True))
        if ring and not p.tp_comm_overlap
        else plan
    )


def _schedules(req: Request, par: ParallelConfig, mb: int) -> list[ParallelConfig]:
    """``par`` under each pipeline schedule ``req`` searches that it can run: 1f1b always (there is
    no other without a pipeline, or interleaved), a zero-bubble one where
    ``ParallelConfig.validate`` allows it (zb-v with each of its V splits, ``v_splits``)."""
    out = [par] if "1f1b" in req.schedules else []
    for s in req.schedules:
        if s == "zb-v":
            out += v_splits(req, par, mb)
            continue
        other = None if s == "1f1b" else scheduled(par, s, req.shape.num_layers)
        if other is not None and not _refused(req, other):
            out.append(other)
    return out


V_SPREADS = (0, 2)  # the V-balanced splits' cuts: chunk sizes at most this many layers apart


def v_splits(req: Request, par: ParallelConfig, mb: int) -> list[ParallelConfig]:
    """``par`` under zb-v with each V split the planner weighs: 1F1B's layers per rank, halved
    (``scheduled``), and the V's own balance (``uneven.v_lighter_split``: rank 0, holding both ends
    of the model, lighter; each rank's two chunks cut where its peak is least, at most each of
    ``V_SPREADS`` layers apart), those the config allows, each once. The search prices every one
    (a plan's label names its split)."""
    plain = scheduled(par, "zb-v", req.shape.num_layers)
    if plain is None or _refused(req, plain):
        return []
    out = [plain]
    n = req.global_batch // (par.dp * mb)
    for spread in V_SPREADS:
        split = v_lighter_split(req.shape, plain, RecomputeConfig(), mb, n, req.opts, spread)
        other = None if split is None else replace(plain, layer_split=split)
        if other is not None and other not in out and not _refused(req, other):
            out.append(other)
    return out


def scheduled(par: ParallelConfig, schedule: str, num_layers: int) -> ParallelConfig | None:
    """``par`` under pipeline schedule ``schedule`` at the same layers per rank: zb-v cuts each
    rank's layers into its two chunks of the V (``zbv_order.v_split``; None where a middle chunk
    would be empty), and back from zb-v each rank's two chunks make its stage."""
    if schedule == par.pp_schedule:
        return par
    per_rank = par.layers_per_rank(num_layers) if par.layer_split else []
    if schedule == "zb-v":
        split = v_split(per_rank or [num_layers // par.pp] * par.pp)
        return None if split is None else replace(par, pp_schedule="zb-v", layer_split=split)
    even = len(set(per_rank)) <= 1
    return replace(par, pp_schedule=schedule, layer_split=() if even else tuple(per_rank))


def _interleavings(
    req: Request, pp: int, tp: int, split: tuple[int, ...]
) -> list[tuple[int, tuple[int, ...]]]:
    """(m, layer split) for a pipeline of pp: every m dividing L/pp with the even split; an uneven
    split with m = 1, and where pp does not divide L, interleaved too: m = 2 .. max_interleave over
    pp·m virtual stages with the model's ends lighter (``uneven.lighter_ends_split``), as Megatron
    interleaves 126 layers on 16."""
    n_layers = req.shape.num_layers
    if not split:
        return [(m, ()) for m in _divisors(n_layers // pp)]
    out = [(1, split)]
    if n_layers % pp:
        for m in range(2, req.max_interleave + 1):
            virtual = lighter_ends_split(req.shape, pp * m, tp)
            if virtual is not None and len(set(virtual)) > 1:
                out.append((m, virtual))
    return out


def _microbatches_ok(n: int, pp: int, interleave: int) -> bool:
    """Whether the schedule runs ``n`` microbatches at ``pp`` and ``interleave``
    (``validate_microbatches``)."""
    try:
        validate_microbatches(n, pp, interleave)
    except ConfigError:
        return False
    return True


def _context_and_pipeline(req: Request, tp: int, rejected: Counter) -> Iterator[ParallelConfig]:
    """(tp, cp, pp, layer split, dp) for ``tp``: cp = 1 with each pp, split evenly and with the ends
    lighter (``uneven.lighter_ends_split``) when that differs and the config allows each, and where
    zb-v is searched and dp leaves a pipeline fewer microbatches than the V fills, also with the
    cp that fills it (``_filling_cp``); or cp > 1 (up to ``max_cp``) with pp = 1 (keeps the search
    small; ``--explain`` evaluates cp with pp)."""
    rest = req.gpus // tp
    for pp in _divisors(rest):
        split = lighter_ends_split(req.shape, pp, tp)
        splits = [(), split] if split and len(set(split)) > 1 else [()]
        cps = [1] + [cp for cp in [_filling_cp(req, tp, pp, rest)] if cp > 1]
        allowed = [
            par
            for s in splits
            for cp in cps
            if not _refused(
                req, par := ParallelConfig(tp=tp, cp=cp, pp=pp, dp=rest // (pp * cp), layer_split=s)
            )
        ]
        if not any(par.cp == 1 for par in allowed):  # no split of the layers over pp stages
            rejected["pp_layers"] += 1
        yield from allowed
    for cp in _divisors(rest)[1:]:
        par = ParallelConfig(tp=tp, cp=cp, dp=rest // cp)
        # 2 cp dividing the sequence
        if cp <= req.max_cp and not _refused(req, par, rejected, "cp_seq"):
            yield par
            yield from (
                replace(par, **comm)
                for comm in _a2a_kinds(cp)
                if not _refused(req, replace(par, **comm))
            )


def _filling_cp(req: Request, tp: int, pp: int, rest: int) -> int:
    """The least cp (up to ``max_cp``, dividing dp, one ``ParallelConfig.validate`` allows at
    ``tp``) that gives a zb-v pipeline of ``pp`` ranks the 2p - 1 microbatches of one sample its V
    fills, where dp alone (``rest`` / pp GPUs) leaves it fewer (cp takes its GPUs from dp: each
    pipeline then holds more of the global batch); 1 where dp leaves enough, zb-v is not searched
    or no cp fills it."""
    dp = rest // pp
    if pp == 1 or "zb-v" not in req.schedules or req.global_batch // dp >= 2 * pp - 1:
        return 1
    for cp in _divisors(dp)[1:]:
        if cp > req.max_cp:
            break
        fills = req.global_batch // (dp // cp) >= 2 * pp - 1
        if fills and not _refused(req, ParallelConfig(tp=tp, cp=cp, dp=rest // cp)):
            return cp
    return 1


def _a2a_kinds(cp: int) -> list[dict]:
    """The all-to-all exchanges context parallelism may use besides the ring: a2a over every cp
    rank, and a2a+ring for each K dividing cp (1 < K < cp); ``ParallelConfig.validate`` refuses
    those whose heads do not split over tp × K."""
    return [{"cp_comm_type": "a2a"}] + [
        {"cp_comm_type": "a2a+ring", "cp_a2a_size": k} for k in _divisors(cp)[1:-1]
    ]


def rejection_lines(req: Request, stats: dict) -> list[str]:
    """What each rule ruled out, one line each (the rules that ruled out nothing are left out)."""
    sh, usable = req.shape, human_bytes(req.hw.usable_bytes)
    words = {
        "tp_split": f"tp values (up to a node's {req.hw.gpus_per_node} GPUs) that do not split "
        f"heads {sh.num_heads}, kv heads {sh.num_kv_heads}, FFN width {sh.ffn} or the {req.gpus} "
        f"GPUs",
        "pp_layers": f"pp values above the {sh.num_layers} layers",
        "cp_seq": f"cp values with 2 cp not dividing the sequence {sh.seq_len}",
        "batch_dp": f"layouts whose dp does not divide the global batch {req.global_batch}",
        "ep_experts": f"ep values (dividing the dp x cp ranks) that do not divide the {sh.experts} "
                      f"experts",
        "states_too_big": f"layouts whose model states alone (weights, gradients, optimizer) "
                          f"exceed {usable} "
        "usable",
        "activations": f"layouts that exceed {usable} usable with every recompute option tried",
        "dominated": "plans dropped as dominated: another at the same layout needs less memory and "
                     "less time",
    }
    counts = stats.get("rejected", {}) | {
        k: stats.get(k, 0) for k in ("states_too_big", "activations", "dominated")
    }
    return [f"{counts[k]} {text}" for k, text in words.items() if counts.get(k)]


def refusal(req: Request, stats: dict) -> str:
    """Why no plan fits ``req``, in one line naming the binding constraint and its numbers: no
    layout the rules allow (each rule's count), the model states alone over the usable memory (the
    least any layout needs; the experts that do not divide over ep), or every recompute option over
    it (the least any plan needs)."""
    usable = human_bytes(req.hw.usable_bytes)
    where = f"no plan fits {req.name} on {req.gpus} GPUs"
    experts = stats.get("rejected", {}).get("ep_experts", 0)
    shards = [d for d in _divisors(req.gpus)[1:] if req.shape.experts % d == 0]
    ep_note = (
        f"; ep would shard the experts, but it must divide the {req.shape.experts} experts and no "
        f"GPU count that divides {req.gpus} (> 1) does"
        if experts and not shards
        else ""
    )
    if stats.get("examined", 0):
        least, label = stats.get("least_memory", (float("nan"), "-"))
        return (
            f"{where}: every one of its {stats['examined']} plans exceeds {usable} usable with "
            f"every recompute option tried (the least, {label}, needs {human_bytes(least)})"
        )
    if stats.get("states_too_big", 0):
        return (
            f"{where}: the model states alone (weights, gradients, optimizer) exceed {usable} "
            f"usable in all {stats['states_too_big']} layouts the rules allow (the least needs "
            f"{human_bytes(stats['least_states'])} per GPU){ep_note}"
        )
    lines = rejection_lines(req, stats)
    return f"{where}: no layout passes the rules: " + (
        "; ".join(lines) if lines else "none examined"
    )


def undominated(found: list[Evaluation]) -> list[Evaluation]:
    """``found`` without the plans another plan of the same layout beats on memory and on time (no
    worse on both, better on one) without moving more bytes over the host link."""
    by_layout: dict[ParallelConfig, list[tuple[float, float, float]]] = {}
    # each summed once
    costs = [(ev.memory_bytes, ev.time.total, ev.offload_bytes_per_step) for ev in found]
    for ev, cost in zip(found, costs, strict=True):
        by_layout.setdefault(ev.plan.par, []).append(cost)

    def beaten(par: ParallelConfig, memory: float, time: float, offload: float) -> bool:
        return any(m <= memory and t <= time and o <= offload  # host traffic is a cost too
                   and (m < memory or t < time) for m, t, o in by_layout[par])

    return [ev for ev, cost in zip(found, costs, strict=True) if not beaten(ev.plan.par, *cost)]


def rank_plans(found: list[Evaluation], tie: float = TIE_FRACTION) -> list[Evaluation]:
    """Fastest first; plans within ``tie`` (relative) of the fastest of their group are a tie, those
    that offload nothing first, then by memory (the cost model is not that precise, and headroom is
    worth something)."""
    by_time = sorted(found, key=lambda e: (e.time.total, e.memory_bytes))
    ranked: list[Evaluation] = []
    while by_time:
        limit = by_time[0].time.total * (1 + tie)
        group = [e for e in by_time if e.time.total <= limit]
        by_time = by_time[len(group):]
        # offloading only where it buys time: the model does not see its PCIe share with the NICs
        ranked += sorted(
            group, key=lambda e: (e.offload_bytes_per_step > 0, e.memory_bytes, e.time.total)
        )
    return ranked


def search(req: Request, stats: dict | None = None) -> list[Evaluation]:
    """All fitting plans, fastest first (``rank_plans``); ``stats`` gets the counts examined."""
    req.shape.validate()
    stats = {} if stats is None else stats
    rejected: Counter = Counter()
    stats.update(examined=0, states_too_big=0, activations=0, rejected=rejected)
    found: list[Evaluation] = []
    for base in layouts(req, rejected):
        states = max(s.states for s in stages_of(req, replace(base, rc=RecomputeConfig("full"))))
        stats["least_states"] = min(stats.get("least_states", states), states)
        if states > req.hw.usable_bytes:
            stats["states_too_big"] += 1  # parameters + optimizer alone do not fit
            continue
        fitting = 0
        for rc in recompute_options(req, base):
            stats["examined"] += 1
            ev = evaluate(req, replace(base, rc=rc), timed=False)
            if ev.fits:
                found.append(ev)
                fitting += 1
            elif (
                ev.error is None
                and ev.memory_bytes < stats.get("least_memory", (float("inf"), ""))[0]
            ):
                stats["least_memory"] = (ev.memory_bytes, ev.plan.label)
        stats["activations"] += not fitting
    kept = undominated(found)
    stats["dominated"] = len(found) - len(kept)
    return rank_plans(kept)


def rank_of(ev: Evaluation, ranked: list[Evaluation]) -> int | None:
    """1-based position ``ev`` takes among the fitting ``ranked`` plans (None if it does not
    fit)."""
    if not ev.fits or ev.time is None:
        return None
    for i, other in enumerate(ranked):
        if other.plan == ev.plan:
            return i + 1
    others = [e for e in ranked if e.plan != ev.plan]
    return rank_plans(others + [ev]).index(ev) + 1


def _ringed(req: Request, plan: Plan) -> Plan:
    """A variant of a plan with the TP ring as the search would give it (``with_tp_ring``): off
    where the variant has no SP, on where it can run it."""
    return with_tp_ring(req, replace(plan, par=replace(plan.par, tp_comm_overlap=False)))


def schedule_bubbles(req: Request, plan: Plan) -> dict[str, Evaluation]:
    """``plan``'s layout (tp, pp, dp, micro batch, recompute) under each pipeline schedule, one
    chunk per rank: 1F1B (interleaving off), ZB-H1 and ZB-V (``scheduled``), each with the TP ring
    where it may run it (``with_tp_ring``); empty without a pipeline. Their bubble terms and memory
    side by side: what ``--explain`` weighs."""
    p = plan.par
    if p.pp == 1:
        return {}
    one = replace(p, interleave=1, tp_comm_overlap=False)
    if one.layer_split and p.interleave > 1:  # an interleaved split: its stages' layers per rank
        per_rank = p.layers_per_rank(req.shape.num_layers)
        one = replace(one, layer_split=() if len(set(per_rank)) == 1 else tuple(per_rank))
    out = {}
    for schedule in PP_SCHEDULES:
        par = scheduled(one, schedule, req.shape.num_layers)
        if par is not None and not _refused(req, par):
            out[schedule] = evaluate(req, with_tp_ring(req, replace(plan, par=par)))
    for par in v_splits(req, one, plan.micro_batch)[1:]:  # the V's own balance
        out[f"zb-v split={split_text(par.layer_split)}"] = evaluate(
            req, with_tp_ring(req, replace(plan, par=par)))
    return out


def alternatives(req: Request, plan: Plan) -> dict[str, Evaluation]:
    """The paper's techniques at ``plan``'s layout: why TP alone (or no recompute) is not chosen."""
    variants = {
        "TP only, no recompute": (False, RecomputeConfig("none")),
        "TP + SP, no recompute": (True, RecomputeConfig("none")),
        "TP + selective": (False, RecomputeConfig("selective")),
        "TP + SP + selective": (True, RecomputeConfig("selective")),
        "TP + SP + full recompute": (True, RecomputeConfig("full")),
    }
    out = {}
    for name, (sp, rc) in variants.items():
        if sp and plan.par.tp == 1:
            continue
        out[name] = evaluate(req, _ringed(req, replace(plan, par=replace(plan.par, sp=sp), rc=rc)))
    p = plan.par
    if p.cp > 1:  # the same GPUs without context parallelism: cp folded into dp
        flat = replace(p, cp=1, dp=p.dp * p.cp)
        for rc in (plan.rc, RecomputeConfig("full")):
            out[f"no cp (dp {flat.dp}), {rc.label}"] = evaluate(req, replace(plan, par=flat, rc=rc))
    elif p.pp == 1 and p.dp % 2 == 0 and req.shape.seq_len % 4 == 0:  # why not context parallelism
        deeper = replace(p, cp=2, dp=p.dp // 2)
        out[f"cp 2 (dp {deeper.dp}), {plan.rc.label}"] = evaluate(req, replace(plan, par=deeper))
    # the other pipeline schedules: their bubble and their memory
    if p.pp > 1 and p.interleave == 1:
        for other in PP_SCHEDULES:
            par = scheduled(p, other, req.shape.num_layers)
            if other != p.pp_schedule and par is not None and not _refused(req, par):
                out[f"pp_schedule {other}, {plan.rc.label}"] = evaluate(
                    req, _ringed(req, replace(plan, par=par)))
    # why shard everything: the same plan with the states replicated, or only the optimizer's
    # sharded
    if p.fsdp:
        plain = replace(p, fsdp=False, fsdp_shard_size=0)
        out[f"no fsdp, {plan.rc.label}"] = evaluate(req, replace(plan, par=plain))
        out[f"distributed optimizer, {plan.rc.label}"] = evaluate(
            req, replace(plan, par=plain, distributed_optimizer=True)
        )
    return out
