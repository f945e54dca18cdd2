"""Forward-only evaluation through the pipeline, and the losses every rank agrees on.

Virtual stage ``v`` (chunk ``v // pp`` of pipeline rank ``v % pp``) runs after ``v - 1`` and sends its
hidden state ``[s(/t), b, h]`` on; the last virtual stage computes the loss. No schedule is needed:
evaluation keeps nothing for backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.dtypes import torch_dtype
from seqpar.parallel.comm import all_reduce, broadcast
from seqpar.parallel.dims import ParallelDims


def broadcast_from_last_stage(value: float | None, dims: ParallelDims, device) -> float:
    """The last pipeline stage's ``value`` on every rank of the pipeline, averaged over dp."""
    t = torch.tensor([float("nan") if value is None else float(value)], dtype=torch.float64, device=device)
    if dims.pp_group is not None:
        broadcast(t, src=dims.pp_ranks[-1], group=dims.pp_group)
    if dims.dp_group is not None:
        all_reduce(t, group=dims.dp_group)
        t /= dims.dp
    return float(t)


def hidden_shape(chunk, micro_batch: int) -> tuple[int, int, int]:
    cfg = chunk.cfg
    s = cfg.seq_len // chunk.cp.size  # the rank's tokens under context parallelism
    s = s // dims_tp(chunk) if chunk.sp else s
    return (s, micro_batch, cfg.hidden_size)


def dims_tp(chunk) -> int:
    return 1 if chunk.group is None else dist.get_world_size(chunk.group)


@torch.no_grad()
def evaluate(chunks: list, batches: list[tuple[torch.Tensor, torch.Tensor]], dims: ParallelDims) -> float:
    """Mean loss over ``batches`` (this dp rank's), averaged over dp; the same value on every rank."""
    device = next(chunks[0].parameters()).device
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    losses = []
    try:
        virtual = len(chunks) * dims.pp
        for tokens, labels in batches:
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
                        losses.append(chunk(inp, labels.to(device)).float())
                    else:
                        x = chunk(inp)
                        nxt = (v + 1) % dims.pp
                        if nxt != owner:
                            dist.send(x.contiguous(), dst=dims.pp_ranks[nxt], group=dims.pp_group)
    finally:
        for c, mode in zip(chunks, modes, strict=True):
            c.train(mode)
    mean = float(torch.stack(losses).mean()) if losses else None
    return broadcast_from_last_stage(mean, dims, device)


@torch.no_grad()
def evaluate_checkpoint(path, data: str | None = None, tokenizer: str | None = None, split: str = "val",
                        micro_batch: int = 8, batches: int = 0) -> dict:
    """``seqpar eval``: a checkpoint's mean loss per token, in one process on this rank's device.

    ``data``/``tokenizer`` default to the run's own; ``split`` ``val`` is the held-out tail training
    validated on, ``all`` every token. Windows of ``seq_len`` tokens, evenly spaced over the split
    and covering it once (``batches`` > 0 caps the forwards)."""
    import math

    from seqpar.parallel.launch import default_device
    from seqpar.train.data import TokenData
    from seqpar.train.sample import load_model

    model, meta = load_model(path, device=default_device())
    cfg, train = model.cfg, meta["config"]["train"]
    data = data if data is not None else train.get("data", "")
    tokenizer = tokenizer if tokenizer is not None else train.get("tokenizer", "")
    if tokenizer and data.endswith(".bin"):
        tokenizer = ""  # token ids already
    tokens = TokenData.build(cfg.seq_len, cfg.vocab_size, data, tokenizer, train.get("token_dtype", "uint16"),
                             train.get("val_fraction", 0.05))
    stream = tokens.val if split == "val" else torch.cat([tokens.train, tokens.val])
    tokens.val = stream
    windows = max((len(stream) - 1) // cfg.seq_len, 1)
    n = math.ceil(windows / micro_batch)
    if batches:
        n = min(n, batches)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in tokens.val_batches(n, micro_batch, 0, 1):
        loss = model(x.to(device), y.to(device)).float()  # mean over the batch's tokens
        total += float(loss) * y.numel()
        count += y.numel()
    loss = total / count
    result = {"checkpoint": str(path), "step": meta.get("step", 0), "data": tokens.source, "split": split,
              "tokens": count, "windows": n * micro_batch, "seq_len": cfg.seq_len, "loss": loss,
              "perplexity": math.exp(min(loss, 700.0))}
    if cfg.vocab_size == 256 and not tokenizer:
        result["bits_per_byte"] = loss / math.log(2)
    return result
