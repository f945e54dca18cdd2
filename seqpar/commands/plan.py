"""`seqpar plan`: which tp / pp / dp / interleave / SP / recompute / microbatch fits and runs
fastest (analytic memory and cost model, seqpar.analysis; no torch needed)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from seqpar.analysis.formulas.presets import (
    TABLE3,
    preset_name,
    preset_names,
    preset_setup,
    preset_shape,
    published_lr,
)
from seqpar.analysis.formulas.shapes import (
    ActivationOptions,
    AnalysisError,
    OptimizerOptions,
    default_dropout,
    device_kernels,
    model_config,
)
from seqpar.analysis.planning import planner
from seqpar.analysis.planning.costmodel import ties_with_best
from seqpar.analysis.planning.planner import Request
from seqpar.analysis.planning.profiles import hardware_for, profile_to_json
from seqpar.analysis.reports import plan_report
from seqpar.analysis.reports.emit import (
    HEADER,
    SCHEDULE_KEYS,
    cadence,
    launch_command,
    nodes_of,
    plan_toml,
    slurm_script,
)
from seqpar.analysis.reports.job_time import DEFAULT_WRITE_GBPS, parse_time
from seqpar.analysis.reports.plots import plan_memory, stages_memory
from seqpar.config import PP_SCHEDULES
from seqpar.optional import require
from seqpar.out_path import check_out_file, check_plot_folder, text_starting
from seqpar.settings import add
from seqpar.train.config import TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model: a preset, or dimensions (which also override a preset's)")

    paper = [k.lower() for k in TABLE3]
    add(g, "--model", metavar=None, help=f"preset: {', '.join(paper)} (Table 3), "
        f"{', '.join(n for n in preset_names() if n not in paper)} (default: none; "
        "then give --layers --hidden --heads --seq --vocab)")
    add(g, "--layers", help="L (default: the preset's)")
    add(g, "--hidden", help="h (default: the preset's)")
    add(g, "--heads", help="a (default: the preset's)")
    add(g, "--seq", help="s (default: the preset's)")
    add(g, "--vocab", help="v (default: the preset's)")
    add(g, "--ffn", help="FFN width f (default 4h)")
    add(g, "--kv-heads", help="grouped-query attention: kv heads (default = heads)")
    add(g, "--experts", help="routed experts in place of every MLP (mixture of experts; the "
        "planner then searches ep); default: the preset's, else 0")
    add(g, "--top-k", help="experts per token (default: the preset's, else 2)")
    add(g, "--moe-ffn", help="each expert's width (default: --ffn)")
    add(g, "--moe-every", help="every k-th layer is MoE, the others dense (Qwen-MoE's "
        "decoder_sparse_step; default: the preset's, else 1)")
    g.add_argument(
        "--shared-expert-ffn",
        type=int,
        help="width of an always-on shared expert beside the routed "
        "ones (Qwen2-MoE; default: the preset's, else 0: none)",
    )
    g.add_argument(
        "--shared-expert-gate",
        action="store_true",
        default=None,
        help="the shared expert's output times sigmoid(x · w_g), as Qwen2-MoE (default: the "
        "preset's, else off)",
    )
    add(
        g,
        "--arch",
        help="gpt (the paper's, default) or llama: RMSNorm, SwiGLU, RoPE, no biases, untied output",
    )
    g = p.add_argument_group("machine")
    g.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    g.add_argument(
        "--hardware",
        metavar="PROFILE",
        help="cost-model profile: a100-80gb (fitted to the paper's measured times), h100-80gb, "
        "h200-141gb, or a JSON file from `seqpar calibrate` (default: the --gpu's); the flags "
        "below override its values",
    )
    g.add_argument(
        "--gpu",
        default="a100",
        help="accelerator without --hardware: a100, h100 or h200, its data sheet "
        "(peak, memory, links) x the A100 fit's achieved fractions; another "
        "is refused: give --hardware FILE (default %(default)s)",
    )
    g.add_argument(
        "--gpus-per-node",
        type=int,
        help="(default: the profile's, 8 for GPUs); tp stays within a node",
    )
    add(
        g,
        "--gpu-memory",
        metavar=None,
        help="GB per GPU (default: the profile's / the data sheet's)",
    )
    add(g, "--peak-tflops",
        help="peak dense 16-bit TFLOP/s per GPU (overrides the profile; default: the profile's)")
    g.add_argument(
        "--gemm-efficiency",
        type=float,
        help="fraction of peak the GEMMs reach (default: the profile's)",
    )
    g.add_argument(
        "--intra-node-gbps", type=float, help="bus GB/s per GPU in a node (default: the profile's)"
    )
    g.add_argument(
        "--inter-node-gbps", type=float, help="GB/s per GPU across nodes (default: the profile's)"
    )
    g.add_argument(
        "--reserve",
        type=float,
        help="fraction of memory kept free for fragmentation and workspaces (default: the "
        "profile's, 0.10)",
    )
    g = p.add_argument_group("training")
    add(g, "--global-batch", help="samples per iteration (default: the preset's Table 3 batch)")
    g.add_argument("--max-micro-batch", type=int, default=16, help="(default %(default)s)")
    add(
        g,
        "--distributed-optimizer",
        help="search sharding the optimizer state over dp × cp (default: on; "
        "--no-distributed-optimizer leaves it out)",
    )
    add(
        g,
        "--overlap-grad-reduce",
        action="store_true",
        help="reduce gradient buckets during the last microbatch's backward "
        "(train.overlap_grad_reduce): the cost model charges only what that backward does not "
        "cover, plus the last bucket",
    )
    g.add_argument(
        "--grad-bucket-mb",
        type=float,
        default=None,
        help="MiB of fp32 gradients per bucket (train.grad_bucket_mb; default: the trainer's)",
    )
    add(
        g,
        "--overlap-param-gather",
        help="with the distributed optimizer, its weight all-gather under the first microbatch's "
        "forward, each bucket waited for at its first use (train.overlap_param_gather): the cost "
        "model charges what that forward does not cover, plus the last bucket, one call per bucket "
        "(default: on, each plan with the distributed optimizer searched with and without it, "
        "pgather=on in its label; --no-overlap-param-gather leaves it out)",
    )
    add(
        g,
        "--tp-comm-overlap",
        help="under SP, each tensor-parallel all-gather and reduce-scatter a ring of tp chunks "
        "pipelined with its GEMM, forward and backward (parallel.tp_comm_overlap) (default: on for "
        "every plan with SP; --no-tp-comm-overlap leaves it out)",
    )
    add(
        g,
        "--fsdp",
        help="search FSDP over dp × cp: parameters, gradients and optimizer state sharded (16/N "
        "B/param) (default: on; --no-fsdp leaves it out)",
    )
    add(
        g,
        "--pp-schedule",
        default=None,
        help="search only this pipeline schedule: 1f1b (interleaved with m > 1), zb-h1, the "
        "linears' weight gradients deferred into the bubble, or zb-v, two chunks per rank in a V "
        "(default: all three, the zero-bubble ones where pp > 1 with one chunk per rank and no "
        "fsdp)",
    )
    add(
        g,
        "--offload",
        help="search offloading modules' activations to host memory (keep / recompute / offload "
        "per module: mlp, norm, core_attention, the layer input), charged the host-link time the "
        "compute does not hide and limited by the node's host memory (default: on, off with "
        "--device cpu, whose memory is the host's; --no-offload leaves it out)",
    )
    add(g, "--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
        help="training precision: bf16/fp16 mixed precision (18 B/param model states, default) or "
        "fp32 throughout (16 B/param, 4-byte activations)")
    g.add_argument("--activation-bytes", type=int, choices=(2, 4), default=None,
                   help="bytes per activation element (default: 2 for bf16/fp16, 4 for fp32)")
    add(g, "--dropout", default=None,
        help="dropout probability; 0 removes the masks (default 0.1 for gpt, 0 for llama, "
        "as in `seqpar memory` and `seqpar paper`)")
    g.add_argument("--no-dropout", action="store_true", help="same as --dropout 0")
    add(
        g,
        "--attention",
        default="auto",
        help="attention core: auto = fused (sdpa: no s² tensors kept, never checkpointed) where "
        "the dropout is 0, else the paper's materialized core; sdpa has no attention dropout "
        "(--dropout stays at the embedding and hidden sites) (default %(default)s)",
    )
    g.add_argument("--fused-attention", action="store_true", help="same as --attention sdpa")
    g.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="the device kind the ranks run on: which fused attention kernel and norm-statistic "
        "width the memory counts (seqpar.analysis.formulas.shapes.device_kernels; `train "
        "--dry-run` prints both) (default %(default)s)",
    )
    g.add_argument("--keep-pipeline-outputs", action="store_true",
                   help="do not free sent stage outputs (App. B off)")
    g = p.add_argument_group("output")
    g.add_argument("--top", type=int, default=8, help="plans listed (default %(default)s)")
    add(g, "--json", help='print {"best": PLAN, "plans": [PLAN, ...]}')
    g.add_argument(
        "--emit-config",
        type=Path,
        metavar="FILE",
        help="write the best plan (or --explain's) as a TOML file `seqpar train --config FILE` "
        "runs (default: none)",
    )
    g.add_argument(
        "--emit-slurm",
        type=Path,
        metavar="FILE",
        help="with --emit-config: write a Slurm batch script that trains it on the plan's nodes "
        "(srun torchrun, one task per node, rendezvous at the first node, runs/<config name> as "
        "the output folder, --resume from it when requeued) (default: none)",
    )
    add(
        g,
        "--plot",
        metavar="DIR",
        help="write plan_memory.png (the best plans' memory) into DIR, or with --explain "
        "plan_stages.png (every pipeline rank of that plan); as paper --plot (default: none)",
    )
    g.add_argument(
        "--explain",
        metavar="PLAN",
        help='e.g. "tp=8,pp=35,m=3,sp=on,recompute=selective,mb=1": memory per stage, time, rank '
        "(default: none, search)",
    )
    g = p.add_argument_group("cluster job (--emit-config, --emit-slurm)")
    g.add_argument(
        "--time",
        metavar="LIMIT",
        help="the job's Slurm time limit (M, H:M:S, D-H:M:S): #SBATCH --time; the script saves and "
        "requeues before it (default: none, the partition's)",
    )
    g.add_argument(
        "--checkpoint-gbps",
        type=float,
        default=None,
        help="GB/s one node writes checkpoints at: the predicted write, hence save_every and "
        "--signal's lead (default: 2, a conservative shared file system)",
    )


def _shape(args):
    """The model of ``--model`` and the dimension flags, and its name for the reports."""
    dims = {
        k: getattr(args, k)
        for k in ("layers", "hidden", "heads", "seq", "vocab", "ffn", "kv_heads", "arch")
    }
    if args.model:
        base = preset_shape(args.model)
        given = {k: v for k, v in dims.items() if v is not None}
        fields = {"layers": base.num_layers, "hidden": base.hidden_size, "heads": base.num_heads,
                  "seq": base.seq_len, "vocab": base.vocab_size, "ffn": base.ffn_hidden_size,
                  "kv_heads": base.kv_heads, "arch": base.arch} | given
        moe = {k: getattr(base, k) for k in MOE_FIELDS + ROPE_FIELDS} | _moe_flags(args)
        name = preset_name(args.model) + ("*" if given or _moe_flags(args) else "")
        return dataclasses.replace(model_config(**fields), **moe).validate(), name
    dims["arch"] = dims["arch"] or "gpt"
    missing = [k for k in ("layers", "hidden", "heads", "seq", "vocab") if dims[k] is None]
    if missing:
        raise AnalysisError(
            f"give --model or all of --layers --hidden --heads --seq --vocab (missing: "
            f"{', '.join('--' + m for m in missing)})"
        )
    return dataclasses.replace(model_config(**dims), **_moe_flags(args)).validate(), "custom"


MOE_FIELDS = (
    "experts",
    "top_k",
    "moe_every",
    "moe_ffn_hidden_size",
    "moe_norm_topk",
    "shared_expert_ffn",
    "shared_expert_gate",
)
# what a preset names beyond its dimensions and the planner keeps for --emit-config (Llama 3's theta
# 500000)
ROPE_FIELDS = (
    "rope_theta",
    "rope_scaling",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
)


def _moe_flags(args) -> dict:
    """The mixture-of-experts fields the flags give (``--experts``, ``--top-k``, ``--moe-ffn``,
    ``--moe-every``, ``--shared-expert-ffn``, ``--shared-expert-gate``)."""
    given = {
        "experts": getattr(args, "experts", None),
        "top_k": getattr(args, "top_k", None),
        "moe_ffn_hidden_size": getattr(args, "moe_ffn", None),
        "moe_every": getattr(args, "moe_every", None),
        "shared_expert_ffn": getattr(args, "shared_expert_ffn", None),
        "shared_expert_gate": getattr(args, "shared_expert_gate", None),
    }
    return {k: v for k, v in given.items() if v is not None}


def request_from_args(args):
    shape, model_name = _shape(args)
    batch = args.global_batch
    if batch is None:
        setup = preset_setup(args.model) if args.model else None
        if setup is None:
            raise AnalysisError("give --global-batch (only the Table 3 presets have a default)")
        batch = setup.global_batch
    for name, value in (("gpus", args.gpus), ("global-batch", batch), ("top", args.top),
                        ("max-micro-batch", args.max_micro_batch)):
        if value < 1:
            raise AnalysisError(f"--{name} must be positive, got {value}")
    hw = hardware_for(
        args.hardware,
        args.gpu,
        gpus_per_node=args.gpus_per_node,
        memory_gb=args.gpu_memory,
        peak_tflops=args.peak_tflops,
        gemm_efficiency=args.gemm_efficiency,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
        reserve=args.reserve,
    )  # checks the machine flags too: finite, in range
    dropout = (
        0.0
        if args.no_dropout
        else args.dropout
        if args.dropout is not None
        else default_dropout(shape.arch)
    )
    if not 0 <= dropout < 1:
        raise AnalysisError(f"--dropout must be in [0, 1), got {dropout}")
    act_bytes = args.activation_bytes or (4 if args.dtype == "fp32" else 2)
    attention = "sdpa" if args.fused_attention else args.attention
    # a fused core has no attention dropout: the plan (and its emitted config) keeps --dropout at
    # the embedding and hidden sites only
    fused = attention == "sdpa" or (attention == "auto" and dropout == 0)
    # seqpar's bounded cross entropy keeps the logits in their dtype and an fp32 lse
    # (docs/analysis.md)
    kernel, stats = device_kernels(args.device, act_bytes)
    opts = ActivationOptions(
        act_bytes=act_bytes,
        logits_bytes=act_bytes,
        bounded_loss=True,
        dropout=dropout > 0,
        fused_attention=fused,
        sdpa_kernel=kernel,
        ln_stats_bytes=stats,
        free_pipeline_outputs=not args.keep_pipeline_outputs,
    )
    opts = dataclasses.replace(opts, tp_comm_overlap=tp_comm_overlap_searched(args))
    return Request(
        shape=shape,
        gpus=args.gpus,
        global_batch=batch,
        hw=hw,
        opts=opts,
        opt=_overlap(args, OptimizerOptions.for_precision(args.dtype)),
        precision=args.dtype,
        dropout=dropout,
        # the whole search by default
        try_distributed_optimizer=args.distributed_optimizer is not False,
        try_overlap_param_gather=args.overlap_param_gather is not False,
        try_fsdp=args.fsdp is not False,
        try_offload=offload_searched(args),
        max_micro_batch=args.max_micro_batch,
        name=model_name,
        schedules=(args.pp_schedule,) if args.pp_schedule else PP_SCHEDULES,
    )


def offload_searched(args) -> bool:
    """Whether the search offloads activations: as ``--offload`` / ``--no-offload`` say, else where
    the host is not the device (``--device cpu`` offloads to the memory it runs in: nothing
    freed)."""
    return args.offload if args.offload is not None else args.device != "cpu"


def tp_comm_overlap_searched(args) -> bool:
    """Whether the plans pipeline the SP collectives with their GEMMs: as ``--tp-comm-overlap`` /
    ``--no-tp-comm-overlap`` say, else on (``parallel.tp_comm_overlap``, every plan with SP)."""
    return True if args.tp_comm_overlap is None else args.tp_comm_overlap


def _overlap(args, opt):
    """``opt`` with the dp overlap the flags ask for, its buckets the trainer's
    (``train.grad_bucket_mb``)."""
    mb = TrainConfig.grad_bucket_mb if args.grad_bucket_mb is None else args.grad_bucket_mb
    if not 0 < mb < float("inf"):
        raise AnalysisError(f"--grad-bucket-mb must be a positive number, got {mb}")
    return dataclasses.replace(opt, overlap_grad_reduce=args.overlap_grad_reduce,
                               bucket_bytes=mb * 2**20)


def _emit(args, req, plan) -> None:
    """``--emit-config``: ``plan`` as the train job's TOML, ``--emit-slurm`` the batch script that
    runs it (``seqpar.analysis.reports.emit``)."""
    if args.emit_config is None:
        return
    defaults = {k: getattr(TrainConfig, k) for k in SCHEDULE_KEYS}
    gbps = DEFAULT_WRITE_GBPS if args.checkpoint_gbps is None else args.checkpoint_gbps
    saves = cadence(req, plan, gbps)
    script = None if args.emit_slurm is None else \
        slurm_script(req, plan, str(args.emit_config), f"runs/{args.emit_config.stem}", saves,
                     None if args.time is None else parse_time(args.time), str(args.emit_slurm))

    args.emit_config.write_text(
        plan_toml(
            req, plan, defaults, published_lr(args.model) if args.model else None, saves, gbps
        )
    )
    where = "" if nodes_of(req.gpus, req.hw.gpus_per_node) == 1 else \
        " on every node (HOST: the first node's address)"
    command = launch_command(req.gpus, req.hw.gpus_per_node, str(args.emit_config))
    print(
        f"wrote {args.emit_config} ({plan.label}); run it with `{command}`{where}", file=sys.stderr
    )
    if script is not None:
        args.emit_slurm.write_text(script)
        print(
            f"wrote {args.emit_slurm}; submit it with `sbatch {args.emit_slurm}` (arguments after "
            f"it reach "
            "seqpar train)",
            file=sys.stderr,
        )


def _slurm_script(path) -> bool:
    """A file ``--emit-slurm`` may replace: a batch script whose second line (after the shebang) is
    an emitted plan's header."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return len(lines) > 1 and lines[1].startswith(HEADER)


def _check_outputs(args) -> None:
    """--emit-config and --plot: where the results go, checked before the search."""
    if args.emit_slurm is not None and args.emit_config is None:
        raise AnalysisError("--emit-slurm needs --emit-config FILE: the script trains that file")
    if args.time is not None:
        if args.emit_slurm is None:
            raise AnalysisError(
                "--time is the batch script's limit: give it with --emit-slurm FILE"
            )
        parse_time(args.time)  # refused before the search
    if args.emit_config is not None:
        check_out_file(
            args.emit_config, "--emit-config", text_starting(HEADER), "a config seqpar plan wrote"
        )
    if args.emit_slurm is not None:  # its second line, after the shebang, is the plan's header
        check_out_file(
            args.emit_slurm, "--emit-slurm", _slurm_script, "a batch script seqpar plan wrote"
        )
    if args.plot is not None:
        check_plot_folder(
            args.plot,
            ["plan_stages.png" if args.explain is not None else "plan_memory.png"],
            "--plot",
        )

        require("matplotlib", "--plot", AnalysisError)  # refused before the search, not after


def run(args) -> int:
    try:
        _check_outputs(args)
        req = request_from_args(args)
        explain = planner.parse_plan(args.explain, args.gpus) if args.explain is not None else None
        explain = explain and planner.with_tp_ring(req, explain)
        # a layout that cannot run this model is bad input: one line, exit 2
        if explain is not None:
            try:
                planner.check_plan(req, explain)
            except AnalysisError as err:
                raise AnalysisError(f"--explain {args.explain!r}: {err}") from None
        stats: dict = {}
        ranked = planner.search(req, stats)
        # bad input for this machine: one line naming the binding rule, exit 2
        if not ranked and explain is None:
            raise AnalysisError(planner.refusal(req, stats))
        if explain is not None:
            ev = planner.evaluate(req, explain, every_rank=True)
            if ev.error and args.emit_config:  # nothing to emit: the model refuses the plan
                raise AnalysisError(f"--explain {args.explain!r}: {ev.error}")
            _emit(args, req, ev.plan)
            if args.json:
                print(json.dumps({"plan": ev.to_json(), "rank": planner.rank_of(ev, ranked),
                                  "settings": planner.settings(req),
                                  "stages": planner.stages_json(ev.stages)}))
            else:
                print(plan_report.render_explain(req, ev, ranked))
            if args.plot and ev.stages:
                args.plot.mkdir(parents=True, exist_ok=True)
                path = stages_memory(args.plot / "plan_stages.png", ev.stages, req.hw.usable_bytes,
                                     req.hw.memory_bytes,
                                     f"{req.name}: {ev.plan.label}")
                print(f"wrote {path}", file=sys.stderr)
            return 0
        if ranked:
            _emit(args, req, ranked[0].plan)
        if args.json:
            ties = ties_with_best([ev.time.total for ev in ranked], req.hw.error_band)
            plans = [
                ev.to_json() | {"tie_with_best": tie} for ev, tie in zip(ranked, ties, strict=True)
            ]
            if plans:  # the chosen plan's every pipeline rank, as --explain gives them
                plans[0]["stages"] = planner.stages_json(
                    planner.evaluate(req, ranked[0].plan, every_rank=True).stages
                )
            print(
                json.dumps(
                    {
                        "best": plans[0] if plans else None,
                        "plans": plans,
                        "settings": planner.settings(req),
                        "hardware": profile_to_json(req.hw),
                        "searched": {
                            "fsdp": req.try_fsdp,
                            "distributed_optimizer": req.try_distributed_optimizer,
                            "offload": req.try_offload,
                            "overlap_param_gather": req.try_overlap_param_gather,
                            "tp_comm_overlap": req.opts.tp_comm_overlap,
                        },
                        "ruled_out": planner.rejection_lines(req, stats),
                    }
                )
            )
        else:
            print(plan_report.render_plan(req, ranked, stats, args.top))
        if args.plot and ranked:
            args.plot.mkdir(parents=True, exist_ok=True)
            path = plan_memory(
                args.plot / "plan_memory.png",
                ranked[: args.top],
                req.hw.usable_bytes,
                req.hw.memory_bytes,
            )
            print(f"wrote {path}", file=sys.stderr)
        return 0
    except AnalysisError:
        raise  # seqpar.cli turns it into a usage error (exit 2)
