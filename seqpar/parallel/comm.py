"""The paper's conjugate communication operators (Sec. 4.2, Fig. 4 and Fig. 5).

Tensor parallelism (Megatron):
  f     -- forward: identity;                        backward: all-reduce
  f_bar -- forward: all-reduce;                      backward: identity
Sequence parallelism (activations sequence-first ``[s, b, h]``, split along dim 0):
  g     -- forward: all-gather along s;              backward: reduce-scatter along s
  g_bar -- forward: reduce-scatter along s;          backward: all-gather along s

Every operator takes the tensor-parallel group explicitly; a ``None`` group (size 1) makes
it the identity. The raw collectives below are the only calls into ``torch.distributed`` for
these operators, so tests can observe their order.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from seqpar.parallel.dims import group_size

# ------------------------------------------------------------- raw collectives (device from tensor)
# Every collective seqpar runs goes through this section (point-to-point transfers, which are not
# collectives, stay with their schedules: pipeline/p2p.py, parallel/ring_attention.py,
# parallel/tp_overlap.py).
SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN

# The one torch-version rule of the package: torch 2.13 names the single-tensor collectives
# all_gather_single / reduce_scatter_single; the releases before it call the same collectives, with
# the same arguments, all_gather_into_tensor / reduce_scatter_tensor. Looked up per call and by
# name, not by version: a build that has either works, and a test can hide the new names. A torch
# without the new names also traces collectives its own way: torch 2.11's dynamo rewrites them into
# functional collectives, and a compiled tp 2 layer's gradients came out wrong through them (with SP
# and without: the layers' weight gradients zero, tests/test_compile.py), while 2.13's rewrite is
# exact. So there every collective below runs outside compiled graphs (a graph break around each).
_NAMES = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
          "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}


def collective(kind: str):
    """This torch's single-tensor ``kind`` collective ("all_gather" or "reduce_scatter"): the 2.13
    name where it exists, else the older one, kept out of compiled graphs."""
    new, old = _NAMES[kind]
    fn = getattr(dist, new, None)
    return fn if fn is not None else _eager(getattr(dist, old))


def _traced(fn):
    """``fn`` (a ``torch.distributed`` collective) as compiled graphs may hold it: itself where this
    torch has the 2.13 names, else kept out of them (the rule above)."""
    return fn if getattr(dist, _NAMES["all_gather"][0], None) is not None else _eager(fn)


@functools.cache
def _eager(fn):
    """``fn`` run as Python, never traced by torch.compile (one wrapper per function)."""
    return torch.compiler.disable(fn)


def all_reduce(x: torch.Tensor, group=None, async_op: bool = False, op=SUM):
    """Reduce ``x`` in place over ``group`` (None: every rank) with ``op``; the work handle when
    ``async_op``."""
    return _traced(dist.all_reduce)(x, op=op, group=group, async_op=async_op)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (N times ``x``'s size) = every rank's ``x`` concatenated along dim 0, in rank
    order."""
    return collective("all_gather")(out, x, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (1/N of ``x``) = the sum over ranks of this rank's slice of ``x`` along dim 0."""
    return collective("reduce_scatter")(out, x, group=group, async_op=async_op)


def all_to_all(out: torch.Tensor, x: torch.Tensor, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None, group=None) -> None:
    """Rank r's ``out`` = the dim-0 slices every rank's ``x`` addressed to r, in rank order: ``x``
    is cut into ``in_splits`` rows (one slice per rank), ``out`` receives ``out_splits`` rows from
    each rank (None: equal slices). Expert parallelism's dispatch and combine
    (``seqpar.parallel.expert``)."""
    _traced(dist.all_to_all_single)(
        out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )


def all_gather_list(shards: list[torch.Tensor], x: torch.Tensor, group=None) -> None:
    """``shards[r]`` = rank r's ``x`` (shapes may differ between calls, not between ranks)."""
    _traced(dist.all_gather)(shards, x, group=group)


def all_gather_object(out: list, obj, group=None) -> None:
    """``out[r]`` = rank r's picklable ``obj``."""
    dist.all_gather_object(out, obj, group=group)


def broadcast(x: torch.Tensor, src: int, group=None) -> None:
    """``x`` on every rank of ``group`` = ``x`` of global rank ``src``."""
    _traced(dist.broadcast)(x, src=src, group=group)


def side_group():
    """A new gloo group over every rank, for collectives a background thread runs beside the step's
    on connections of their own (a background checkpoint write); every rank calls this at the same
    point. None for a process alone."""
    return (
        dist.new_group(backend="gloo")
        if dist.is_initialized() and dist.get_world_size() > 1
        else None
    )


def barrier(group=None) -> None:
    """Wait until every rank of ``group`` (None: every rank) has arrived."""
    dist.barrier(group=group)


def all_gather_seq(x: torch.Tensor, group, async_op: bool = False):
    """``[s/t, ...]`` -> ``[s, ...]``: concatenate the shards of all ranks along dim 0."""
    t = group_size(group)
    out = torch.empty((x.shape[0] * t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = all_gather_into(out, x.contiguous(), group, async_op)
    return (out, work) if async_op else out


def reduce_scatter_seq(x: torch.Tensor, group, async_op: bool = False):
    """``[s, ...]`` -> ``[s/t, ...]``: sum over ranks, each keeps its slice of dim 0."""
    t = group_size(group)
    if x.shape[0] % t:
        raise ValueError(f"sequence {x.shape[0]} is not divisible by tp {t}")
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = reduce_scatter_into(out, x.contiguous(), group, async_op)
    return (out, work) if async_op else out


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of dim 0 (no communication)."""
    t = group_size(group)
    if t == 1:
        return x
    rank = dist.get_rank(group)
    return x.chunk(t, dim=0)[rank].contiguous()


# ---------------------------------------------------------------- the four operators
class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # autograd may share `grad` with other nodes
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, ctx.group)
        return grad, None


class _FBar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None


class _GBar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


def f(x: torch.Tensor, group) -> torch.Tensor:
    """TP entry: identity forward, all-reduce backward."""
    return x if group_size(group) == 1 else _F.apply(x, group)


def f_bar(x: torch.Tensor, group) -> torch.Tensor:
    """TP exit: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _FBar.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """SP -> TP transition: all-gather along s forward, reduce-scatter backward."""
    return x if group_size(group) == 1 else _G.apply(x, group)


def g_bar(x: torch.Tensor, group) -> torch.Tensor:
    """TP -> SP transition: reduce-scatter along s forward, all-gather backward."""
    return x if group_size(group) == 1 else _GBar.apply(x, group)
