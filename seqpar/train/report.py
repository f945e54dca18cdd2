"""The end-of-run summary rank 0 prints (and a sample from the saved checkpoint)."""

from __future__ import annotations

import math

from seqpar.train.config import JobConfig


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def print_summary(job: JobConfig, summary: dict, seconds: float) -> None:
    m, p, r, t = job.model, job.parallel, job.recompute, job.train
    print("=" * 72)
    print(f"seqpar train: {m.num_layers} layers, h {m.hidden_size}, heads {m.num_heads}, s {m.seq_len}, "
          f"vocab {m.vocab_size}, {m.dtype}")
    print(f"  layout tp {p.tp} × pp {p.pp} × dp {p.dp}, sequence parallel {'on' if p.sp else 'off'}, "
          f"recompute {r.granularity}")
    print(f"  steps {summary.get('step', t.steps)}, global batch {t.global_batch} × {m.seq_len} tokens")
    loss, val = summary.get("loss", math.nan), summary.get("val_loss", math.nan)
    print(f"  final train loss {loss:.4f} (mean of the last {t.log_every} steps)  validation loss {val:.4f} nats/token"
          + (f" ({val / math.log(2):.3f} bits/byte)" if m.vocab_size == 256 else ""))
    if "tokens_per_s" in summary:
        print(f"  throughput {summary['tokens_per_s']:,.0f} tokens/s, step {summary['step_time'] * 1e3:.0f} ms, "
              f"MFU {summary['mfu'] * 100:.1f}%, HFU {summary['hfu'] * 100:.1f}%")
    if summary.get("skipped"):
        print(f"  {summary['skipped']} steps skipped for non-finite values")
    print(f"  wall time {seconds:.1f} s")
    print(f"  checkpoint {summary.get('checkpoint')}")
    if summary.get("plot"):
        print(f"  loss curve {summary['plot']}")
    print(f"  metrics {t.out_dir}/metrics.jsonl")
    if t.sample_tokens and summary.get("checkpoint"):
        from seqpar.train.sample import decode_bytes, encode_bytes, generate, load_model

        model, _ = load_model(summary["checkpoint"])
        if m.vocab_size == 256 and not t.tokenizer:
            ids = generate(model, encode_bytes(t.sample_prompt), t.sample_tokens, temperature=0.8, top_k=20,
                           seed=t.seed)
            print(f"--- sample (temperature 0.8, top-k 20, prompt {t.sample_prompt!r}) ---")
            print(decode_bytes(ids))
            print("---")
