"""`seqpar memory`: activation bytes of one transformer layer on one rank -- the paper's Table 2
formula, the exact per-tensor derivation, and (``--measure``) what autograd really keeps; with
``--states``, the model states per rank under plain DP, the distributed optimizer and FSDP /
HSDP."""

from __future__ import annotations

import argparse
import json

from seqpar.analysis.formulas.fsdp_states import compare_states
from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.formulas.shapes import default_dropout
from seqpar.config import (
    ACTIVATIONS,
    ARCH_FIELDS,
    NORMS,
    OFFLOAD_MODULES,
    POSITIONS,
    RECOMPUTE_MODULES,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    validate_microbatches,
)
from seqpar.measure.table2_text import bytes_or_dash as _human
from seqpar.measure.table2_text import dropouts, render_rows
from seqpar.settings import add

# the model without --model (a preset's shape replaces these, and any flag given overrides either)
SHAPE_DEFAULTS = {
    "hidden": 512,
    "heads": 8,
    "seq": 256,
    "vocab": 512,
    "ffn": None,
    "kv_heads": None,
    "arch": "gpt",
}


def add_model_arguments(p: argparse.ArgumentParser, **defaults) -> None:
    d = {"layers": 1, "micro_batch": 2, "dtype": "bf16"} | defaults
    g = p.add_argument_group("model (paper notation)")
    add(g, "--model", help="a `seqpar plan` preset's shape (22b, gpt3-6.7b, llama3-8b, ...); "
        "the flags below override it (default: none, the defaults below)")
    add(g, "--layers", default=d["layers"], help="L (default %(default)s)")
    for flag, name in (("hidden", "h"), ("heads", "a"), ("seq", "s"), ("vocab", "v")):
        add(g, f"--{flag}", help=f"{name} (default: the preset's, else {SHAPE_DEFAULTS[flag]})")
    add(g, "--micro-batch", default=d["micro_batch"], help="b (default %(default)s)")
    add(g, "--ffn", help="FFN width f (default: the preset's, else 4h)")
    add(
        g,
        "--dtype",
        choices=["fp32", "bf16"],
        default=d["dtype"],
        help="activations (default %(default)s)",
    )
    add(g, "--dropout", default=None,
        help="attention and hidden dropout; 0 removes the masks (default 0.1 for gpt, 0 for llama, "
        "as in `seqpar plan` and `seqpar paper`)")
    a = p.add_argument_group("architecture (default: the paper's GPT)")
    add(
        a,
        "--arch",
        help="llama = rmsnorm + swiglu + rope + no biases + untied output + dropout 0 (default: "
        "the preset's, else gpt)",
    )
    add(a, "--kv-heads", default=None,
        help="grouped-query attention (default: the preset's, else = heads)")
    add(
        a,
        "--attention",
        default="auto",
        help="materialized s² scores (the paper), fused scaled_dot_product_attention, or auto: "
        "sdpa where the dropout is 0, else materialized (default %(default)s)",
    )
    a.add_argument(
        "--norm",
        choices=NORMS,
        default=None,
        help="override the --arch's norm (default: the arch's)",
    )
    a.add_argument("--activation", choices=ACTIVATIONS, default=None,
                   help="override the --arch's MLP activation (default: the arch's)")
    a.add_argument("--position", choices=POSITIONS, default=None,
                   help="override the --arch's positions (default: the arch's)")
    m = p.add_argument_group("mixture of experts (default: a dense MLP)")
    add(
        m, "--experts", default=0, help="routed experts E in place of the MLP (default %(default)s)"
    )
    add(m, "--top-k", default=2, help="experts per token K (default %(default)s)")
    add(m, "--moe-ffn", default=None, help="each expert's width (default: --ffn)")
    m.add_argument(
        "--capacity",
        type=float,
        default=0.0,
        help="capacity factor c: each expert takes ceil(c·T·K/E) of a rank's T tokens (default 0: "
             "dropless)",
    )


# the Llama-style layer's fields but its dropout, which --dropout sets
LLAMA = {k: v for k, v in ARCH_FIELDS["llama"].items() if not k.endswith("dropout")}


def shape_from_args(args) -> dict:
    """hidden, heads, seq, vocab, ffn, kv_heads, arch: each flag given, else ``--model``'s, else
    ``SHAPE_DEFAULTS``."""
    base = dict(SHAPE_DEFAULTS)
    if getattr(args, "model", None):
        m = preset_shape(args.model)
        base = {
            "hidden": m.hidden_size,
            "heads": m.num_heads,
            "seq": m.seq_len,
            "vocab": m.vocab_size,
            "ffn": m.ffn_hidden_size,
            "kv_heads": m.kv_heads,
            "arch": m.arch,
        }
    return {
        k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in base.items()
    }


def model_from_args(args) -> ModelConfig:
    shape = shape_from_args(args)
    arch = LLAMA if shape["arch"] == "llama" else {}
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        raise ConfigError(f"--dropout must be in [0, 1), got {args.dropout}")
    # the default dropout gives way to sdpa's 0; a given one not
    if args.dropout and args.attention == "sdpa":
        raise ConfigError(
            f"--attention sdpa takes attention dropout 0, but --dropout {args.dropout} sets it: "
            f"give "
            "--dropout 0, or --attention materialized (or auto)"
        )
    dropout = args.dropout if args.dropout is not None else default_dropout(shape["arch"])
    chosen = {
        k: getattr(args, k)
        for k in ("norm", "activation", "position")
        if getattr(args, k) is not None
    }
    return ModelConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        num_heads=shape["heads"],
        num_layers=args.layers,
        seq_len=shape["seq"],
        ffn_hidden_size=shape["ffn"],
        dtype=args.dtype,
        embd_dropout=dropout,
        attn_dropout=0.0 if args.attention == "sdpa" else dropout,
        hidden_dropout=dropout,
        kv_heads=shape["kv_heads"],
        attention=args.attention,
        experts=getattr(args, "experts", 0),
        top_k=getattr(args, "top_k", 2),
        moe_ffn_hidden_size=getattr(args, "moe_ffn", None),
        moe_capacity=getattr(args, "capacity", 0.0),
        **(arch | chosen),
    ).validate()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--measure", action="store_true", help="run the layer on --tp local gloo ranks and measure"
    )
    add(p, "--tp", default=1, help="tensor-parallel size t (default %(default)s)")
    add(
        p,
        "--cp",
        default=1,
        help="context-parallel size: the layer holds s/cp tokens, ring attention (default "
             "%(default)s)",
    )
    add(
        p,
        "--cp-comm-type",
        default="ring",
        help="context parallelism's exchange: ring, a2a (all-to-all from sequence to heads) or "
        "a2a+ring (default %(default)s)",
    )
    add(p, "--cp-a2a-size", default=0, help="a2a+ring: the all-to-all group K (divides cp)")
    add(p, "--sp", action="store_true", help="sequence parallelism")
    add(
        p,
        "--tp-comm-overlap",
        action="store_true",
        help="with --sp at tp > 1: SP's collectives in ring chunks pipelined with the GEMMs (with "
        "--all: the SP rows); the chunks are transient, the bytes kept the same",
    )
    add(p, "--ep", default=1,
        help="expert-parallel size (MoE): the layer runs on ep × tp ranks (default %(default)s)")
    add(p, "--recompute", default="none",
        help="activation recomputation (default %(default)s)")
    p.add_argument("--recompute-modules", default="", metavar="M1,M2",
                   help=f"with --recompute selective: any of {','.join(RECOMPUTE_MODULES)} "
                        "(default core_attention, the paper's)")
    add(
        p,
        "--offload-modules",
        type=str,
        default="",
        metavar="M1,M2",
        help=f"activation offloading: any of {','.join(OFFLOAD_MODULES)}; the bytes are then the "
             f"device's, "
        "and the host's are reported beside them (default none)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="the six Table 2 rows for this t (with --recompute selective --recompute-modules "
        "dropout_mask: each row regenerating its attention dropout mask instead)",
    )
    p.add_argument(
        "--tensors", action="store_true", help="list every saved tensor (with --measure)"
    )
    add(p, "--json", help="print one JSON object")
    p.add_argument(
        "--loss-chunk-kib",
        type=int,
        default=None,
        help="with --measure: the cross entropy's chunk in KiB of fp32 rows (default: the "
        "runtime's, 32768)",
    )
    g = p.add_argument_group(
        "model states (--states: weights, gradients, optimizer per rank, formula)"
    )
    g.add_argument("--states", action="store_true",
                   help="model states of each pipeline rank under plain DP, the distributed "
                        "optimizer and FSDP")
    add(g, "--dp", default=1, help="data-parallel size (default %(default)s)")
    add(g, "--fsdp-shard-size", default=0,
        help="HSDP: shard inside groups of this many dp × cp ranks (default 0: all of them)")
    add_model_arguments(p)
    add_schedule_arguments(p)


def add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """Whole-schedule mode (Sec. 4.2.3, 4.3, App. B/C): peak activation bytes of every pipeline
    stage."""
    g = p.add_argument_group(
        "pipeline schedule (--pp or --microbatches: peak over one step, per stage)"
    )
    add(g, "--pp", default=1, help="pipeline-parallel size p (default %(default)s)")
    add(g, "--microbatches", default=None, help="microbatches per step (default: pp)")
    add(g, "--interleave", default=1, help="m, chunks per pipeline rank (default %(default)s)")
    add(
        g,
        "--pp-schedule",
        default="1f1b",
        help="1f1b (interleaved with --interleave > 1) or zb-h1: the linears' weight gradients "
        "deferred into the bubble, their inputs held until then (default %(default)s)",
    )
    g.add_argument("--keep-outputs", action="store_true",
                   help="do not free a stage's output once sent (App. B off)")
    g.add_argument(
        "--keep-microbatches",
        type=int,
        default=0,
        help="App. C: in-flight microbatches per rank that store everything (default %(default)s)",
    )
    # L defaults to 1 for one layer; a schedule needs p·m chunks, so it defaults to 2 layers per
    # chunk there.
    p.set_defaults(layers=None)
    for action in p._actions:
        if action.dest == "layers":
            action.help = (
                "L (default 1; with --pp/--microbatches 2 per pipeline chunk; with --states the "
                "preset's, else 1 per pipeline chunk)"
            )


def run(args) -> int:
    # torch: only --measure runs the model; the formula table stays torch-free
    from seqpar.measure.table2 import measure_rows, plan_rows

    for flag in ("pp", "interleave", "microbatches", "tp", "cp", "ep", "micro_batch", "dp"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if getattr(args, "fsdp_shard_size", 0) < 0:
        raise ConfigError(
            f"--fsdp-shard-size must be >= 0 (0: all dp × cp ranks), got {args.fsdp_shard_size}"
        )
    if getattr(args, "keep_microbatches", 0) < 0:
        raise ConfigError(f"--keep-microbatches must be >= 0, got {args.keep_microbatches}")
    if getattr(args, "states", False):
        return run_states(args)
    if getattr(args, "pp", 1) > 1 or getattr(args, "microbatches", None) is not None:
        return run_schedule(args)
    if args.layers is None:
        args.layers = 1
    cfg = model_from_args(args)
    # checked with or without --measure
    if args.loss_chunk_kib is not None and args.loss_chunk_kib < 1:
        raise ConfigError(f"--loss-chunk-kib must be a positive integer, got {args.loss_chunk_kib}")
    modules = tuple(m for m in args.recompute_modules.split(",") if m)
    offload = tuple(m for m in args.offload_modules.split(",") if m)
    rows = plan_rows(
        cfg,
        args.micro_batch,
        args.tp,
        args.sp,
        args.recompute,
        args.all,
        modules=modules,
        cp=args.cp,
        ep=args.ep,
        offload=offload,
        cp_comm_type=args.cp_comm_type,
        cp_a2a_size=args.cp_a2a_size,
        tp_comm_overlap=args.tp_comm_overlap,
    )
    loss = None
    if args.measure:
        # torch: only --measure runs the model; the formula table stays torch-free
        from seqpar.dtypes import torch_dtype
        from seqpar.measure.loss_head import measure_loss_head

        measure_rows(cfg, args.micro_batch, rows)
        # torch: only --measure runs the model
        from seqpar.parallel.cross_entropy import CHUNK_BYTES

        chunk = CHUNK_BYTES if args.loss_chunk_kib is None else 1024 * args.loss_chunk_kib
        loss = measure_loss_head(
            cfg.seq_len // args.cp,
            args.micro_batch,
            cfg.vocab_per_rank(args.tp),
            dtype=torch_dtype(cfg.dtype),
            chunk_bytes=chunk,
        )
    if args.json:
        print(
            json.dumps(
                {"rows": [r.as_json() for r in rows]}
                | ({"loss_head": loss.as_json()} if loss else {})
            )
        )
        return 0
    print(
        render_rows(
            cfg,
            rows,
            args.micro_batch,
            cp=args.cp,
            cp_comm_type=args.cp_comm_type,
            cp_a2a_size=args.cp_a2a_size,
            ep=args.ep,
            offload=offload,
            tensors=args.tensors,
            loss=loss,
        )
    )
    return 0


def run_schedule(args) -> int:
    """``--pp P --microbatches M [--interleave m]``: one training step of the pipeline schedule on
    P × T gloo ranks; per stage the measured peak next to the formula (Eq. 5/6, interleave factor,
    Sec. 4.3 terms; ``seqpar.measure.stages``)."""
    # torch: the stage table measures; the formula table stays torch-free
    from seqpar.measure.stages import (
        formula_stage_memory,
        implementation_terms_at,
        measure_schedules,
    )

    if args.cp > 1:
        raise ConfigError(
            f"--cp {args.cp}: the schedule mode (--pp/--microbatches) measures cp = 1 only; "
            "drop --pp/--microbatches to measure one layer under cp"
        )
    if args.layers is None:
        args.layers = 2 * args.pp * args.interleave
    if args.microbatches is None:
        raise ConfigError(f"the schedule mode needs --microbatches (pp {args.pp})")
    cfg = model_from_args(args)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, sp=args.sp, interleave=args.interleave,
                              pp_schedule=args.pp_schedule).validate(cfg)
    offload = tuple(m for m in args.offload_modules.split(",") if m)
    recompute = RecomputeConfig(args.recompute, offload_modules=offload).validate()
    free, keep = not args.keep_outputs, args.keep_microbatches
    run = (recompute, args.micro_batch, args.microbatches, free, keep)
    if args.measure:
        stages = measure_schedules(cfg, parallel, [run])[0]
    else:
        # torch: the stage table measures; the formula table stays torch-free
        from seqpar.measure.stages import StagePeak, formula_host_bytes

        validate_microbatches(args.microbatches, args.pp, args.interleave)
        stages = []
        for r in range(args.pp):
            memory = formula_stage_memory(
                cfg, parallel, recompute, args.micro_batch, args.microbatches, r, free, keep
            )
            terms = memory.held_terms
            formula = sum(terms.values())
            extra = implementation_terms_at(
                memory, cfg, parallel, args.micro_batch, args.microbatches, r, free
            )
            host = formula_host_bytes(
                cfg, parallel, recompute, args.micro_batch, args.microbatches, r, keep
            )
            stages.append(
                StagePeak(
                    r, None, formula, formula + sum(extra.values()), terms | extra, host_bytes=host
                )
            )
    if args.json:
        print(json.dumps({"stages": [st.as_json() for st in stages]}))
        return 0
    s, b, h, a = cfg.seq_len, args.micro_batch, cfg.hidden_size, cfg.num_heads
    print(
        f"one step, {args.pp_schedule}, p={args.pp} t={args.tp} sp={'on' if args.sp else 'off'} "
        + ("TP ring " if args.tp_comm_overlap else "")
        + f"m={args.interleave} n={args.microbatches} recompute={args.recompute} "
        f"App.B={'on' if free else 'off'} App.C K={keep}: L={cfg.num_layers} s={s} b={b} h={h} "
        f"a={a} v={cfg.vocab_size} {cfg.dtype}, {dropouts(cfg)}"
    )
    print(f"{'stage':>5}{'measured peak':>16}{'formula':>14}{'exact':>14}{'meas/formula':>14}{'meas-exact':>12}")
    for st in stages:
        m = st.measured_peak_bytes
        ratio = "-" if m is None else f"{m / st.formula_bytes:.4f}"
        diff = "-" if m is None else f"{m - st.exact_bytes:,.0f}"
        print(f"{st.stage:>5}{_human(m):>16}{_human(st.formula_bytes):>14}{_human(st.exact_bytes):>14}"
              f"{ratio:>14}{diff:>12}")
        if offload:
            print(f"{'host':>5}{_human(st.measured_host_bytes):>16}{_human(st.host_bytes):>14}{'':>40}"
                  f"   offloaded {','.join(offload)}: each in-flight microbatch's, on the host")
        if args.tensors:
            for name, value in st.terms.items():
                print(f"      {name:<28}{_human(value):>14}")
    print(
        "formula = Eq. 5/6 layers in flight (× (1 + (p-1)/(pm)) interleaved on rank 0) + Sec. 4.3 "
        "terms (logits of the padded vocabulary shard ⌈v/t⌉) + norm statistics (LayerNorm "
        "mean/rstd, RMSNorm fp32 rstd); exact adds the final norm's statistics, the output being "
        "sent (App. B) and index/int64 bookkeeping."
    )
    print("The recompute working set rebuilt during a backward is transient and left out of both.")
    if parallel.pp_schedule != "1f1b":
        print(
            f"{parallel.pp_schedule}: + deferred_w, the W units each rank holds at its peak (each "
            f"deferred linear's "
            "stored input and output gradient), at a forward's end or a backward's end, whichever "
            "holds more."
            + (" zb-v: each chunk's own microbatches in flight and units, along the rank's order "
               "(the V: rank 0 holds the head, rank p-1 the outputs it hands to its own chunk 1)."
               if parallel.pp_schedule == "zb-v" else "")
        )
    return 0


def preset_layers(args) -> int | None:
    """``--model``'s layer count (its model states are the whole model's), None without a preset."""
    if not getattr(args, "model", None):
        return None

    return preset_shape(args.model).num_layers


def run_states(args) -> int:
    """``--states``: each pipeline rank's model states (most loaded dp rank) under plain DP, the
    distributed optimizer and FSDP or HSDP over dp × cp
    (``seqpar.analysis.formulas.fsdp_states.compare_states``)."""
    if args.layers is None:  # a preset's whole model, else one layer per pipeline chunk
        args.layers = preset_layers(args) or args.pp * args.interleave
    cfg = model_from_args(args)
    par = ParallelConfig(
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        cp=args.cp,
        sp=args.sp,
        interleave=args.interleave,
        fsdp=args.dp * args.cp > 1,
        fsdp_shard_size=args.fsdp_shard_size,
    ).validate(cfg)
    rows = compare_states(cfg, par)
    if args.json:
        print(json.dumps({"states": rows}))
        return 0
    print(
        f"model states per rank ({cfg.dtype}): L={cfg.num_layers} h={cfg.hidden_size} "
        f"v={cfg.vocab_size}, {par.describe_world()}; most loaded dp rank of each pipeline rank"
    )
    print(f"{'pp rank':>7}  {'mode':<22}{'parameters':>14}{'gradients':>14}{'optimizer':>14}{'total':>14}"
          f"{'vs dp':>7}{'in flight':>14}")
    for r in rows:
        base = next(x for x in rows if x["rank"] == r["rank"] and x["mode"] == "dp")["total"]
        print(
            f"{r['rank']:>7}  {r['mode']:<22}{_human(r['parameters']):>14}{_human(r['gradients']):>14}"
            f"{_human(r['optimizer_states']):>14}{_human(r['total']):>14}{r['total'] / base:>7.3f}"
            f"{_human(r['in_flight']) if r['in_flight'] else '-':>14}"
        )
    print(
        "fsdp: fp32 shards (the masters) and fp32 gradient shards, padded to ceil(rows / N) rows, "
        "and Adam's moments of the rank's own rows; in flight (an estimate): the root unit and two "
        "layers gathered, one unit's fp32 reduce-scatter input."
    )
    return 0
