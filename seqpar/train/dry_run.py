"""``seqpar train --dry-run``: the resolved configuration and the memory each rank is predicted to
need (the analysis package's model-state and activation terms), without starting anything."""

from __future__ import annotations

import os

import torch

from seqpar.analysis.formulas.shapes import OptimizerOptions, activation_options, device_kind
from seqpar.analysis.formulas.stage import all_stages
from seqpar.analysis.text import exact_bytes, human_bytes
from seqpar.config import ConfigError
from seqpar.config_toml import config_toml
from seqpar.dtypes import torch_dtype
from seqpar.measure.saved import layernorm_stat_bytes, sdpa_kernel_for
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import default_device
from seqpar.train.config import inert_settings
from seqpar.train.data import TokenData
from seqpar.train.perf import slow_dtype_note


def predicted_memory(job, device: torch.device | None = None) -> list:
    """``StageMemory`` of every pipeline rank (one tp rank's bytes; dp ranks repeat them) on
    ``device``'s kind."""
    m, p, r, t = job.model, job.parallel, job.recompute, job.train
    device = device or torch.device("cpu")
    opts = activation_options(
        m,
        layernorm_stat_bytes(device, torch_dtype(m.dtype)),
        sdpa_kernel=sdpa_kernel_for(device, torch_dtype(m.dtype), job.data.document_mask),
    )
    # the trainer's states: fp32 -- weight 4 + grad 4 + Adam 8; 16-bit -- weight 2 + fp32 grad 4 +
    # master 4 + Adam 8;
    # masters + Adam / dp
    opt = OptimizerOptions.for_precision(m.dtype, distributed=t.distributed_optimizer)
    return all_stages(m, p, r, t.micro_batch, t.microbatches(p.dp), opts, opt)


def prediction_devices() -> list[str]:
    """The device kinds the dry run predicts for: CUDA (what `seqpar plan` plans for), and this
    host's kind when it differs (a launch here runs the CPU kernels;
    ``seqpar.analysis.formulas.shapes.device_kernels``)."""
    here = device_kind(default_device().type)
    return ["cuda"] + ([here] if here != "cuda" else [])


def _stage_lines(job, stages: list) -> list[str]:
    p = job.parallel
    lines = []
    for st in stages:
        layout = ParallelDims(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
        ranks = [
            layout.rank_of(d, st.rank, c, k)
            for d in range(p.dp)
            for c in range(p.cp)
            for k in range(p.tp)
        ]
        shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
        terms = ", ".join(f"{k} {human_bytes(v)}" for k, v in st.terms.items() if v)
        lines.append(
            f"  pipeline rank {st.rank} (ranks {shown}): states {human_bytes(st.states)} + "
            f"activations {human_bytes(st.activations)} = {human_bytes(st.total)}  [{terms}]"
            + (
                f"; host {human_bytes(st.host_total)} offloaded "
                f"({', '.join(job.recompute.offload_modules)})"
                if st.host
                else ""
            )
        )
    return lines


def device_memory(kind: str, gpu_memory: float | None) -> tuple[float, str] | None:
    """(bytes, what they are) one rank of ``kind`` may use: ``--gpu-memory`` GB (GiB, as
    ``seqpar plan``'s), this machine's GPU, or for the CPU this host's memory (its ranks share it);
    None when nothing says."""
    if kind != "cpu":
        if gpu_memory is not None:
            if not gpu_memory > 0:
                raise ConfigError(f"--gpu-memory must be a positive number of GB, got {gpu_memory}")
            return gpu_memory * 2**30, f"--gpu-memory {gpu_memory:g}"
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return float(props.total_memory), f"this machine's {props.name}"
        return None
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this host's memory"
    except (ValueError, OSError, AttributeError):  # not a POSIX host
        return None


def fit_lines(job, kind: str, stages: list, gpu_memory: float | None) -> list[str]:
    """Whether the ranks fit ``kind``'s memory: a GPU each (the most loaded pipeline rank), or on
    the CPU the host that all the ranks share (their sum)."""
    capacity = device_memory(kind, gpu_memory)
    if capacity is None:
        return [f"fits on {kind}: not checked (no GPU here; give --gpu-memory GB)"]
    limit, what = capacity
    p = job.parallel
    if kind == "cpu":
        # every rank of every pipeline stage
        need = sum(st.total for st in stages) * p.tp * p.cp * p.dp
        ok = need <= limit
        return [
            f"fits on {kind}: {p.world_size} rank{'s' if p.world_size != 1 else ''} together need "
            f"{human_bytes(need)} of {what}, {human_bytes(limit)}: "
            + (
                "it fits"
                if ok
                else "it does NOT fit (fewer ranks here, a smaller model, recompute)"
            )
        ]
    peak = max(stages, key=lambda st: st.total)
    ok = peak.total <= limit
    return [
        f"fits on {kind}: the most loaded rank (pipeline rank {peak.rank}) needs "
        f"{human_bytes(peak.total)} of {what}, {human_bytes(limit)} per GPU: "
        + (
            "it fits"
            if ok
            else f"it does NOT fit ({peak.total / limit:.1f}x; more tp / pp, recompute, "
            "the distributed optimizer or FSDP)"
        )
    ]


def describe(job, world: int, gpu_memory: float | None = None) -> str:
    m, p, t = job.model, job.parallel, job.train
    lines = [
        f"# seqpar train --dry-run: {world} rank{'s' if world != 1 else ''} = "
        f"{p.describe_world()}; {t.microbatches(p.dp)} microbatch(es) of {t.micro_batch} per step; "
        f"nothing was started",
        config_toml(job.to_dict()),
        "",
    ]
    devices = prediction_devices()
    try:
        stages = {d: predicted_memory(job, torch.device(d)) for d in devices}
    except ConfigError as err:
        lines.append(f"predicted memory: not available ({err})")
        return "\n".join(lines)
    lines.append(
        f"predicted memory per rank on {devices[0]} (seqpar.analysis: states = weights + gradients "
        f"+ "
        "optimizer, activations at the pipeline peak):"
    )
    lines += _stage_lines(job, stages[devices[0]])
    for d in devices:
        peak = max(stages[d], key=lambda st: st.total)
        host = " (this host)" if d == devices[-1] and len(devices) > 1 else ""
        lines.append(
            f"most loaded on {d}{host}: pipeline rank {peak.rank}, {exact_bytes(peak.total)}; "
            f"{m.dtype}, {peak.in_flight} microbatch(es) in flight"
        )
    for d in devices:
        lines += fit_lines(job, d, stages[d], gpu_memory)
    return "\n".join(lines)


def print_dry_run(job, existing: str = "", gpu_memory: float | None = None) -> None:
    """``--dry-run``'s output: the configuration, each rank's predicted memory, the data, and what
    a real run would be told (``existing``: an earlier run in the output folder, see start.py)."""
    data = TokenData.for_job(job)
    print(describe(job, job.parallel.world_size, gpu_memory))
    print(
        f"data {data.source}: {data.train_tokens:,} train / {data.val_tokens:,} validation tokens"
    )
    if existing:
        print(
            f"note: {job.train.out_dir} already holds a run ({existing}): a real run needs "
            f"--resume or --overwrite"
        )
    for note in inert_settings(job) + slow_dtype_note(job, default_device()):
        print(f"warning: {note}")
