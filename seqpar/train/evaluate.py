"""Forward-only evaluation through the pipeline, and the losses every rank agrees on.

Virtual stage ``v`` (chunk ``v // pp`` of pipeline rank ``v % pp``) runs after ``v - 1`` and sends its
hidden state ``[s(/t), b, h]`` on; the last virtual stage computes the loss. No schedule is needed:
evaluation keeps nothing for backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.dtypes import torch_dtype
from seqpar.parallel.comm import MAX, all_reduce, broadcast
from seqpar.parallel.dims import ParallelDims
from seqpar.pipeline.objective import counted as counted_tokens
from seqpar.train.data import validation_windows


def broadcast_from_last_stage(value: float | torch.Tensor | None, dims: ParallelDims, device) -> torch.Tensor:
    """The last pipeline stage's ``value`` on every rank of the pipeline, averaged over dp: 0-dim float64 on
    ``device``, not read on the host (a Python value is filled in, not copied)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(1).to(device=device, dtype=torch.float64, copy=True)  # [1]
    else:
        t = torch.full((1,), float("nan") if value is None else float(value), dtype=torch.float64, device=device)
    if dims.pp_group is not None:
        broadcast(t, src=dims.pp_ranks[-1], group=dims.pp_group)
    if dims.dp_group is not None:
        all_reduce(t, group=dims.dp_group)
        t /= dims.dp
    return t[0]


def hidden_shape(chunk, micro_batch: int) -> tuple[int, int, int]:
    cfg = chunk.cfg
    s = cfg.seq_len // chunk.cp.size  # the rank's tokens under context parallelism
    s = s // dims_tp(chunk) if chunk.sp else s
    return (s, micro_batch, cfg.hidden_size)


def dims_tp(chunk) -> int:
    return 1 if chunk.group is None else dist.get_world_size(chunk.group)


def mean_per_token(totals: torch.Tensor | None, count: int, dims: ParallelDims, device) -> tuple[float, float]:
    """The last pipeline stage's loss sums ``totals`` ``[2]`` (cross entropy, objective) over its ``count`` counted
    tokens, all summed over the dp ranks: the means per counted token of one fixed window set, however it was
    shared out (``pipeline.objective``'s definition)."""
    t = torch.full((3,), float("nan"), dtype=torch.float64, device=device)  # [cross entropy, objective, count]
    if totals is not None:
        t[:2], t[2] = totals.to(torch.float64), count
    if dims.pp_group is not None:
        broadcast(t, src=dims.pp_ranks[-1], group=dims.pp_group)
    if dims.dp_group is not None:
        all_reduce(t, group=dims.dp_group)
    cross_entropy, objective = (t[:2] / t[2].clamp(min=1)).tolist()
    return cross_entropy, objective


def lockstep_padding(chunks: list, n: int, dims: ParallelDims, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Under FSDP every forward gathers each unit's weights over the dp × cp ranks, and under expert
    parallelism every MoE forward exchanges tokens over the ep ranks (inside dp × cp): so every dp rank
    runs as many forwards as the one with the most batches: the extra ones, on a dummy window, not counted
    (nothing without either; a collective over dp with them)."""
    if dims.dp_group is None or not (dims.fsdp or dims.ep > 1):
        return []
    most = torch.tensor([n], dtype=torch.int64, device=device)
    all_reduce(most, group=dims.dp_group, op=MAX)
    window = torch.zeros((1, chunks[0].cfg.seq_len), dtype=torch.long)  # [b, s]
    return [(window, window)] * (int(most) - n)


@torch.no_grad()
def evaluate(chunks: list, batches: list[tuple[torch.Tensor, torch.Tensor]], dims: ParallelDims,
             done=None) -> tuple[float, float]:
    """(cross entropy, objective): mean losses per counted token over every dp rank's ``batches`` (each its
    share of one window set; shares may differ by a window, or be empty); the same values on every rank, at
    every layout and micro-batch size (``pipeline.objective``). The cross entropy is plain (what validation
    loss, perplexity and bits per byte report); the objective is what training minimises (label smoothing
    included; equal to the cross entropy without it). ``done(windows)``: called after each batch."""
    device = next(chunks[0].parameters()).device
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    total, count, last = torch.zeros(2, dtype=torch.float64, device=device), 0, False  # [cross entropy, objective]
    counted = len(batches)
    batches = list(batches) + lockstep_padding(chunks, len(batches), dims, device)
    try:
        virtual = len(chunks) * dims.pp
        for i, (tokens, labels, *docs) in enumerate(batches):  # docs: packed documents, if any
            docs = docs[0] if docs else None
            x = None
            for v in range(virtual):
                owner, chunk_id = v % dims.pp, v // dims.pp
                if dims.pp_rank == owner:
                    chunk = chunks[chunk_id]
                    if v > 0 and owner != (v - 1) % dims.pp:
                        x = torch.empty(hidden_shape(chunk, tokens.shape[0]), dtype=torch_dtype(chunk.cfg.dtype),
                                        device=device)
                        dist.recv(x, src=dims.pp_ranks[(v - 1) % dims.pp], group=dims.pp_group)
                    inp = tokens.to(device) if chunk.first else x
                    if chunk.last:
                        loss = chunk(inp, labels.to(device), docs=docs, reduction="scores").double()  # [2]
                        if i < counted:  # not a lockstep padding forward
                            total += loss
                            count += counted_tokens(labels)
                    else:
                        x = chunk(inp, docs=docs)
                        nxt = (v + 1) % dims.pp
                        if nxt != owner:
                            dist.send(x.contiguous(), dst=dims.pp_ranks[nxt], group=dims.pp_group)
            if done is not None and i < counted:
                done(tokens.shape[0])
        last = any(c.last for c in chunks)
    finally:
        for c, mode in zip(chunks, modes, strict=True):
            c.train(mode)
    return mean_per_token(total if last else None, count, dims, device)


@torch.no_grad()
def evaluate_checkpoint(path, data: str | None = None, tokenizer: str | None = None, split: str = "val",
                        micro_batch: int = 8, batches: int = 0, full: bool = False,
                        progress: bool = False) -> dict:
    """``seqpar eval``: a checkpoint's mean loss per token, in one process on this rank's device.

    ``data``/``tokenizer`` default to the run's own (its tokenizer copy); ``split`` ``val`` is the
    held-out data training validated on, ``all`` every token. By default the trainer's own fixed
    validation windows (``eval_batches × global_batch`` of the run: its logged validation loss);
    ``batches`` > 0: that many forwards of ``micro_batch`` windows; ``full``: windows of ``seq_len``
    covering the split once. ``progress``: a line on stderr (windows, tokens/s, ETA)."""
    import math

    from seqpar.parallel.launch import default_device
    from seqpar.train.config import build_job
    from seqpar.train.data import TokenData
    from seqpar.train.sample import load_model, model_tokenizer

    model, meta = load_model(path, device=default_device())
    cfg, train = model.cfg, meta["config"]["train"]
    data = data if data is not None else train.get("data", "")
    tokenizer = model_tokenizer(path, meta, tokenizer)
    if tokenizer and data.endswith(".bin"):
        tokenizer = ""  # token ids already
    tokens = TokenData.build(cfg.seq_len, cfg.vocab_size, data, tokenizer, train.get("token_dtype", "uint16"),
                             train.get("val_fraction", 0.05),
                             document_mask=_document_mask(meta, data))
    _same_tokenizer(tokens, tokenizer)
    if split == "all":
        tokens = _whole(tokens)
    spans = tokens.val_spans()
    if full:
        windows = max(spans.tokens // cfg.seq_len, 1)
    elif batches:
        windows = batches * micro_batch
    else:
        windows = validation_windows(build_job(meta["config"]).train)
    windows = tokens.validation_count(windows)  # the validation set's own (each window once)
    tokens.check_validation(windows)  # a set that counts no token: refused, not scored as loss 0
    batches = tokens.validation_batches(windows, micro_batch)
    meter = _Meter(windows, cfg.seq_len, progress)
    loss, objective = evaluate([model], batches, ParallelDims.single(), done=meter.add)  # the trainer's, one rank
    meter.close()
    result = {"checkpoint": str(path), "step": meta.get("step", 0), "data": tokens.source, "split": split,
              "tokens": sum(counted_tokens(b[1]) for b in batches), "windows": windows, "seq_len": cfg.seq_len,
              "loss": loss,
              "perplexity": math.exp(min(loss, 700.0))}
    if cfg.vocab_size == 256 and not tokenizer:
        result["bits_per_byte"] = loss / math.log(2)
    if cfg.label_smoothing > 0:  # what training minimised, apart: loss, perplexity and bits are the plain ones
        result["objective"] = objective
    return result


def _same_tokenizer(data, tokenizer: str) -> None:
    """A prepared folder's ids were made by the model's tokenizer (or both are bytes), or one line."""
    from seqpar.data.errors import DataError
    from seqpar.fileio import sha256_file

    prepared = getattr(data, "prepared", None)
    if prepared is None:
        return
    record = prepared.manifest["tokenizer"]
    theirs, mine = (record["sha256"] if record else None), (sha256_file(tokenizer) if tokenizer else None)
    if theirs != mine:
        what = lambda digest: f"tokenizer sha256 {digest[:12]}..." if digest else "bytes"  # noqa: E731
        raise DataError(f"{prepared.path} was prepared with {what(theirs)}, the model reads {what(mine)}")


def _whole(data):
    """``data`` with every token as its validation split (``--split all``)."""
    from seqpar.data.windows import Spans
    from seqpar.train.data import TokenData

    if isinstance(data, TokenData):
        return TokenData(data.train, torch.cat([data.train, data.val]), data.seq_len, data.source)
    return data.with_validation(Spans([(0, len(data.prepared))], data.seq_len))


class _Meter:
    """``seqpar eval``'s progress on stderr: in place on a terminal, else a line every 5 seconds."""

    def __init__(self, windows: int, seq_len: int, enabled: bool):
        import sys
        import time

        self.windows, self.seq_len, self.done = windows, seq_len, 0
        self.enabled, self.tty = enabled, enabled and sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()

    def line(self) -> str:
        import time

        dt = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.windows - self.done) / rate if rate else float("inf")
        return (f"eval: {self.done:,}/{self.windows:,} windows, {rate * self.seq_len:,.0f} tokens/s, "
                f"ETA {eta:.0f} s")

    def add(self, n: int) -> None:
        import sys
        import time

        self.done += n
        if self.tty:
            print("\r" + self.line(), end="", file=sys.stderr, flush=True)
        elif self.enabled and time.perf_counter() - self.last >= 5:
            self.last = time.perf_counter()
            print(self.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        import sys

        if self.enabled:  # the last state, whole (on a terminal: over the running line)
            print(("\r" if self.tty else "") + self.line(), file=sys.stderr, flush=True)


def _document_mask(meta: dict, data: str) -> bool:
    """The run's document masks where the data holds documents (a prepared folder); other data -- a held-out
    text file -- is scored as one stream without them, which a line on stderr says."""
    import sys

    from seqpar.data.prepared import is_prepared

    masked = bool(meta["config"].get("data", {}).get("document_mask", False))
    if masked and not is_prepared(data):
        print(f"seqpar eval: {data} is not a prepared folder: scored as one stream, without the run's document "
              "masks (prepare it for them)", file=sys.stderr)
        return False
    return masked
