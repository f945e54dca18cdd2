"""The end-of-run summary rank 0 prints (and a sample from the saved checkpoint)."""

from __future__ import annotations

import math
from pathlib import Path

from seqpar.analysis.text import human_bytes
from seqpar.config import ConfigError
from seqpar.train.config import JobConfig


def print_summary(job: JobConfig, summary: dict, seconds: float) -> None:
    m, p, r, t = job.model, job.parallel, job.recompute, job.train
    print("=" * 72)
    moe = f", {m.experts} experts top-{m.top_k} in {m.moe_layers} layers" if m.experts else ""
    print(
        f"seqpar train: {m.num_layers} layers, h {m.hidden_size}, heads {m.num_heads}, s "
        f"{m.seq_len}, vocab {m.vocab_size}, {m.dtype}{moe}"
    )
    named = p.describe_extras()  # the banner's layout line says the same
    extras = f" ({', '.join(named)})" if named else ""
    print(
        f"  layout {p.describe_world()}{extras}, sequence parallel "
        f"{'on' if p.sp and p.tp > 1 else 'off'}, recompute {r.granularity}"
    )
    done = summary.get("step", t.steps)
    of = (
        f" of {t.steps} (stopped at --stop-at {done}; resume continues the schedule)"
        if done < t.steps
        else ""
    )
    print(f"  steps {done}{of}, global batch {t.global_batch} × {m.seq_len} tokens")
    loss, val = summary.get("loss", math.nan), summary.get("val_loss", math.nan)
    n = summary.get("loss_steps", t.log_every)
    print(
        f"  final train loss {loss:.4f} (mean of the last {n} step{'s' if n != 1 else ''})  "
        f"validation loss {val:.4f} nats/token"
        + (
            f" ({val / math.log(2):.3f} bits/byte)"
            if m.vocab_size == 256 and not t.tokenizer
            else ""
        )
        + (
            f"; label-smoothed: validation {summary['val_objective']:.4f}, as the train loss"
            if "val_objective" in summary
            else ""
        )
    )
    if "tokens_per_s" in summary:
        print(
            f"  throughput {summary['tokens_per_s']:,.0f} tokens/s, step "
            f"{summary['step_time'] * 1e3:.0f} ms, MFU {summary['mfu']:.1%}, HFU "
            f"{summary['hfu']:.1%} (of the last log window, saves excluded)"
        )
    line = activation_line(summary.get("activations") or {}, p.sp and p.tp > 1, r.granularity)
    if line:
        print(line)
    if summary.get("skipped"):
        print(
            f"  {summary['skipped']} steps skipped (non-finite values, or a global batch counting "
            f"no token)"
        )
    print(f"  wall time {seconds:.1f} s")
    print(f"  checkpoint {summary.get('checkpoint')}")
    if summary.get("plot"):
        print(f"  loss curve {summary['plot']}")
    print(f"  metrics {t.out_dir}/metrics.jsonl")
    board = Path(t.out_dir) / "tensorboard"
    print(f"  tensorboard {board}" if board.is_dir() else
          "  tensorboard: not written (pip install tensorboard, or `make demo`, which installs it)")
    if t.sample_tokens and summary.get("checkpoint"):
        print_sample(summary["checkpoint"], t.sample_prompt, t.sample_tokens, t.tokenizer, t.seed)


def activation_line(act: dict, sp: bool, granularity: str) -> str | None:
    """What the layers keep for one microbatch on this rank, measured at the start, beside what the
    same model keeps without sequence parallelism and without recompute (the exact per-tensor
    formula the measurement was checked against;
    ``seqpar.measure.activations.without_paper_bytes``)."""
    kept = act.get("act_bytes_measured", act.get("act_bytes_predicted"))
    if kept is None:
        return None
    source = "measured" if "act_bytes_measured" in act else "formula"
    this = (
        " + ".join(["SP"] * sp + [f"{granularity} recompute"] * (granularity != "none"))
        or "this layout"
    )
    names = {
        "without_sp": "without SP",
        "without_recompute": "without recompute",
        "without_both": "without either",
    }
    # full recompute on one layer keeps 0
    ratio = (lambda b: f" ({b / kept:.1f}x)") if kept else (lambda b: "")
    others = [f"{human_bytes(act[f'act_bytes_{k}'])} {label}{ratio(act[f'act_bytes_{k}'])}"
              for k, label in names.items() if act.get(f"act_bytes_{k}")]
    host = act.get("act_host_bytes_measured")
    return (
        f"  activations per rank, one microbatch: {human_bytes(kept)} {source} with {this}"
        + (
            f" (on the device; {human_bytes(host)} offloaded to the host, formula "
            f"{human_bytes(act.get('act_host_bytes_predicted') or 0)}, host RAM held for it "
            f"{human_bytes(act.get('act_host_reserved_bytes') or 0)})"
            if host is not None
            else ""
        )
        + (
            f"; the same model keeps {', '.join(others)} (exact per-tensor formula)"
            if others
            else ""
        )
    )


def print_sample(checkpoint: str, prompt: str, tokens: int, tokenizer: str, seed: int) -> None:
    """A sample from the saved checkpoint (temperature 0.8, top-k ``TOP_K``): bytes, or the run's
    tokenizer."""
    # torch and the model: this module stays torch-free
    from seqpar.train.sample import TOP_K, sample_text

    try:
        text = sample_text(
            checkpoint, prompt, tokens, temperature=0.8, top_k=TOP_K, seed=seed, tokenizer=tokenizer
        )
    except ConfigError as err:
        print(f"  (no sample: {err})")
        return
    print(f"--- sample (temperature 0.8, top-k {TOP_K}, prompt {prompt!r}) ---")
    print(text)
    print("---")
