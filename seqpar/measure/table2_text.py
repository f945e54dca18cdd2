"""Table 2 as text: each row's measured, exact and formula bytes of one layer on one rank, and the
notes that say which terms this architecture keeps (``seqpar memory``; the rows come from
``seqpar.measure.table2``)."""

from __future__ import annotations

from seqpar.analysis.formulas.memory import sdpa_output_is_out_proj_input
from seqpar.analysis.formulas.shapes import device_kernels
from seqpar.analysis.text import human_bytes
from seqpar.config import ModelConfig


def bytes_or_dash(n: float | None) -> str:
    """``1.5 MiB``, or ``-`` for a value not measured."""
    return "-" if n is None else human_bytes(n)


_human = bytes_or_dash


def dropouts(cfg: ModelConfig) -> str:
    """``dropout p``, and the attention dropout where it differs (sdpa takes 0)."""
    same = cfg.attn_dropout == cfg.hidden_dropout
    return f"dropout {cfg.hidden_dropout}" + (
        "" if same else f" (attention dropout {cfg.attn_dropout})"
    )


def render_rows(
    cfg: ModelConfig,
    rows: list,
    micro_batch: int,
    *,
    cp: int = 1,
    cp_comm_type: str = "ring",
    cp_a2a_size: int = 0,
    ep: int = 1,
    offload: tuple[str, ...] = (),
    tensors: bool = False,
    loss=None,
) -> str:
    """The rows of ``seqpar.measure.table2.plan_rows`` (measured or not) and the loss head's bytes
    as the lines ``seqpar memory`` prints."""
    lines: list[str] = []
    out = lines.append
    s, b, h, a = cfg.seq_len, micro_batch, cfg.hidden_size, cfg.num_heads
    core = cfg.attention_core + (" (auto)" if cfg.attention == "auto" else "")
    arch = f"{cfg.arch}: {cfg.norm}, {cfg.activation}, {cfg.position}, kv heads {cfg.num_kv_heads}, {core}"
    exchange = {"ring": "ring attention", "a2a": "all-to-all (Ulysses)",
                "a2a+ring": f"all-to-all over {cp_a2a_size}, ring across"}[cp_comm_type]
    cp_text = f", cp={cp}: s/cp={s // cp} tokens per rank, {exchange}" if cp > 1 else ""
    out(
        f"one layer, one rank: s={s} b={b} h={h} a={a} f={cfg.ffn} {cfg.dtype}, {dropouts(cfg)} "
        f"({arch}){cp_text}"
    )
    # columns
    w, wr = max(16, *(len(r.row) + 2 for r in rows)), max(10, *(len(r.recompute) + 1 for r in rows))
    head = f"{'row':<{w}}{'t':>3} {'sp':<4}{'recompute':<{wr}}{'measured':>14}{'exact':>14}{'formula':>14}"
    out(head + f"{'meas-exact':>12}{'meas/form':>10}")
    for r in rows:
        diff = "-" if r.measured_bytes is None else f"{r.measured_bytes - r.exact_bytes:,.0f}"
        ratio = "-" if r.measured_bytes is None else f"{r.measured_bytes / r.formula_bytes:.4f}"
        out(f"{r.row:<{w}}{r.tp:>3} {'on' if r.sp else 'off':<4}{r.recompute:<{wr}}{_human(r.measured_bytes):>14}"
            f"{_human(r.exact_bytes):>14}{_human(r.formula_bytes):>14}{diff:>12}{ratio:>10}")
        if tensors:
            for t in r.tensors:
                out(f"    {t['name']:<28}{t['dtype']:<10}{str(list(t['shape'])):<22}{t['bytes']:>12,}")
        if r.offload:
            diff = (
                "-"
                if r.host_measured_bytes is None
                else f"{r.host_measured_bytes - r.host_exact_bytes:,.0f}"
            )
            out(f"{'  host':<33}{_human(r.host_measured_bytes):>14}{_human(r.host_exact_bytes):>14}{'':>14}"
                f"{diff:>12}   offloaded: {','.join(r.offload)}")
            for t in r.host_tensors if tensors else ():
                out(f"    host {t['name']:<23}{t['dtype']:<10}{str(list(t['shape'])):<22}{t['bytes']:>12,}")
        if r.recomputed_not_offloaded:
            names, them = (
                r.recomputed_not_offloaded,
                "it" if len(r.recomputed_not_offloaded) == 1 else "them",
            )
            out(
                f"  not offloaded in this row: {','.join(names)} (recompute {r.recompute} rebuilds "
                f"{them} on the "
                "device)"
            )
    if offload:
        out(
            "offloaded (seqpar.recompute.offload): the rows' bytes are the device's; 'host' is "
            "what went to host memory after the forward (a row's recomputation keeps what it "
            "rebuilds off the host)."
        )
    out(
        "exact = formula + the norm statistics (LayerNorm mean/rstd, RMSNorm rstd), which the "
        "paper drops."
    )
    if any(r.tp_comm_overlap for r in rows):
        out(
            "tp comm overlap (rows with SP): the collectives ran in ring chunks beside the GEMMs; "
            "the chunks are transient, so what the layer keeps is the same as without."
        )
    if cfg.experts:
        out(
            f"MoE (E={cfg.experts}, K={cfg.top_k}, ep={ep}): formula = balanced routing; exact = "
            f"the routing "
            "rank 0 saw (T tokens routed, N assignments kept, R rows its experts ran):"
        )
        for r in rows:
            seen = r.routing.get("measured")
            out(
                f"  {r.row}: balanced T, N, R = {r.routing['balanced']}"
                + (
                    f"; measured {seen}, rows per local expert {r.routing['per_expert']}"
                    if seen
                    else ""
                )
            )
    if rows[0].vanished or rows[0].added:
        out(
            "formula = the per-tensor derivation for this architecture (Table 2 assumes the "
            "paper's GPT)."
        )
    for r in rows:
        if r.vanished or r.added:
            out(f"{r.row}: vanished vs the paper's GPT: {', '.join(r.vanished) or '-'}; "
                f"added: {', '.join(r.added) or '-'}")
    if cfg.hidden_dropout == 0:
        out(
            "dropout 0: no masks"
            + (
                "."
                if cfg.fused_attention
                else ", and attention·V keeps the softmax output itself (2as²b/t, not 5as²b/t)."
            )
        )
    if cfg.fused_attention:
        out(fused_core_note(micro_batch))
    if loss is not None:
        out(
            f"cross entropy (bounded, one rank's [{loss.tokens}, {loss.columns}] logits): kept "
            f"{_human(loss.kept_measured)} measured, {_human(loss.kept_term)} exact; transient "
            f"beyond the logits and their gradient {_human(loss.transient_measured)} measured, at "
            f"most {_human(loss.working_term)} by its term (one fp32 chunk "
            f"{_human(loss.chunk_bytes)} + per-token vectors); an fp32 copy of the logits would be "
            f"{_human(loss.unbounded_copy)}."
        )
    return "\n".join(lines)


def fused_core_note(micro_batch: int, device: str = "cpu") -> str:
    """What a fused core keeps, and that selective recompute leaves it alone
    (``analysis.formulas.memory.rebuilt``)."""
    shared = sdpa_output_is_out_proj_input(micro_batch, device_kernels(device, 2)[0])
    out = "its output is the out-proj input's storage" if shared else "its output (2sbh/t)"
    return (
        f"fused attention (sdpa): no s² terms; it keeps Q, K, V, an fp32 log-sum-exp per row and "
        f"head, {out}"
        " (and 16 B of RNG state on CUDA). selective recompute checkpoints nothing in a fused "
        "core: its kernel recomputes its tiles in its own backward, so a checkpoint would free "
        "only the log-sum-exp."
    )


