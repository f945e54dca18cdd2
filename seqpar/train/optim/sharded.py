"""This rank's shards of full tensors, described to ``torch.distributed.checkpoint`` by their
offsets.

A ``ShardedView`` wraps a local tensor (a parameter's fp32 master, an Adam moment) and its
``ParamLayout``. DCP sees the *full* (single-process) tensor, of which this rank holds the chunks
``layout.blocks`` names: the rank's pieces cut at the layout-independent block grid. Chunks that
several ranks hold (replicated parameters, the k/v rows shared under grouped QKV, dp replicas, a
tied embedding's two copies) have the same offsets on each, and DCP's planner writes each once.
Loading reads the stored chunks overlapping this rank's into the local tensor in place, so no rank
ever allocates a full tensor of a split parameter, and a read is never larger than one stored chunk.

A ``FragmentView`` does the same for a distributed optimizer's fragment: a range of a parameter's
flattened shard held in its own 1-D tensor. The range is cut into boxes (at most 2·ndim − 1) and the
boxes at the block grid, so a rank writes and reads its fragments where they lie in the full tensor,
and never gathers a whole parameter's master or moments.

DCP resolves a chunk of a tensor subclass through ``__get_tensor_shard__``; the views are not
tensors, so the two planners below resolve their chunks instead
(``lookup_object``/``lookup_tensor``, the extension points DCP's default planners name).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.layout import REPLICATED, ParamLayout, Piece, layout_of

KINDS = ("weight", "exp_avg", "exp_avg_sq")


def state_key(name: str, kind: str) -> str:
    """The DCP key of a parameter's fp32 weight or Adam moment (``kind`` in ``KINDS``)."""
    return f"model.{name}" if kind == "weight" else f"optim.{name}.{kind}"


def sharded_state(
    states, dims: ParallelDims, with_optimizer: bool = True
) -> dict[str, ShardedView]:
    """``states``: [(name, param, {"weight", "exp_avg", "exp_avg_sq"})] (fp32, local shapes) → this
    rank's shards by DCP key, placed in the full tensors by each parameter's layout. No
    communication."""
    kinds = KINDS if with_optimizer else KINDS[:1]
    return {
        state_key(name, kind): ShardedView(tensors[kind], layout_of(param), dims.tp_rank, dims.tp)
        for name, param, tensors in states
        for kind in kinds
    }


def flat_boxes(
    start: int, stop: int, shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of boxes that cover the row-major flat range [start, stop) of a tensor of
    ``shape`` exactly, without overlap: a partial leading row, whole rows, a partial trailing row,
    each partial row cut the same way one dimension down."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = 1
    for n in shape[1:]:
        inner *= n
    (first, head), (last, tail) = divmod(start, inner), divmod(stop, inner)

    def row(index: int, lo: int, hi: int):
        return [((index, *o), (1, *z)) for o, z in flat_boxes(lo, hi, shape[1:])]

    if first == last:
        return row(first, head, tail)
    out = row(first, head, inner) if head else []
    whole = first + (1 if head else 0)
    if whole < last:
        out.append(((whole, *[0] * (len(shape) - 1)), (last - whole, *shape[1:])))
    return out + (row(last, 0, tail) if tail else [])


class ShardedView:
    """``local`` (this rank's shard, local shape) as chunks of the full tensor ``layout``
    describes."""

    def __init__(
        self, local: torch.Tensor, layout: ParamLayout = REPLICATED, tp_rank: int = 0, tp: int = 1
    ):
        self.local, self.layout = local.detach(), layout
        shape = tuple(local.shape)
        self.full = torch.Size(layout.full_shape(shape, tp))
        self.chunks: list[Piece] = [
            piece for _, piece in layout.blocks(shape, tp_rank, tp) if piece.length
        ]
        self._by_offset = {self._offsets(p): p for p in self.chunks}

    def size(self) -> torch.Size:
        return self.full

    def _offsets(self, piece: Piece) -> torch.Size:
        offsets = [0] * len(self.full)
        offsets[self.layout.dim] = piece.full
        return torch.Size(offsets)

    def _sizes(self, piece: Piece) -> torch.Size:
        sizes = list(self.full)
        sizes[self.layout.dim] = piece.length
        return torch.Size(sizes)

    def chunk(self, offsets) -> torch.Tensor:
        """The local view of the chunk at ``offsets`` in the full tensor."""
        piece = self._by_offset[torch.Size(offsets)]
        return self.local.narrow(self.layout.dim, piece.local, piece.length)

    # DCP's _Checkpointable protocol (what DTensor implements): the chunks this rank writes and
    # reads
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, self._offsets(p)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(self._offsets(p), self._sizes(p)),
                    properties=properties,
                    size=self.full,
                ),
            )
            for p in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(self._offsets(p), self._sizes(p)) for p in self.chunks]


class FragmentView(ShardedView):
    """Elements [start, stop) of the row-major flattening of a parameter's tp-local shard (shape
    ``local_shape``), held in ``flat`` (``flat[i]`` is element ``start + i``, as a distributed
    optimizer's fragment master or moment), as chunks of the full tensor ``layout`` describes."""

    def __init__(self, flat: torch.Tensor, local_shape: tuple[int, ...], start: int, stop: int,
                 layout: ParamLayout, tp_rank: int, tp: int):
        self.local, self.layout, self.start = flat.detach(), layout, start
        self.full = torch.Size(layout.full_shape(local_shape, tp))
        self.strides = torch.empty(local_shape, device="meta").stride()
        # full offsets → local box
        self._boxes: dict[torch.Size, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        d = layout.dim
        for _, piece in layout.blocks(local_shape, tp_rank, tp):
            for offsets, sizes in flat_boxes(start, stop, local_shape):
                lo, hi = (
                    max(offsets[d], piece.local),
                    min(offsets[d] + sizes[d], piece.local + piece.length),
                )
                if lo < hi:
                    at, size = list(offsets), list(sizes)
                    at[d], size[d] = lo, hi - lo
                    full = list(at)
                    full[d] = lo - piece.local + piece.full
                    self._boxes[torch.Size(full)] = (tuple(at), tuple(size))

    @property
    def empty(self) -> bool:
        return not self._boxes

    def chunk(self, offsets) -> torch.Tensor:
        """The view of ``flat`` that is the chunk at ``offsets`` in the full tensor."""
        at, size = self._boxes[torch.Size(offsets)]
        first = sum(i * s for i, s in zip(at, self.strides, strict=True)) - self.start
        return self.local.as_strided(size, self.strides, self.local.storage_offset() + first)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets, torch.Size(size))
            for offsets, (_, size) in self._boxes.items()
        ]

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, c.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=c, properties=properties, size=self.full),
            )
            for c in self.__create_chunk_list__()
        ]



def master_views(
    name: str,
    master: torch.Tensor,
    opt_state,
    param: torch.Tensor,
    local_shape: tuple[int, ...],
    start: int,
    stop: int,
    dims: ParallelDims,
    kinds: tuple[str, ...] = KINDS,
) -> dict[str, FragmentView]:
    """The checkpoint views of one flat fp32 master (elements [start, stop) of ``param``'s tp-local
    shard of shape ``local_shape``) and of its Adam moments in ``opt_state`` (read for the moment
    kinds only), by DCP key; empty views left out. The distributed and FSDP optimizers' fragments
    both come through here."""
    out = {}
    for kind in kinds:
        flat = master.detach() if kind == "weight" else opt_state[master][kind]
        view = FragmentView(
            flat.reshape(-1), local_shape, start, stop, layout_of(param), dims.tp_rank, dims.tp
        )
        if not view.empty:
            out[state_key(name, kind)] = view
    return out

class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return (
            obj.chunk(index.offset)
            if isinstance(obj, ShardedView)
            else super().lookup_object(index)
        )


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner on a flat state dict of ``ShardedView``s and tensors (its set-up
    would replace objects it does not know by None, while materialising meta tensors, which we have
    none of)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return (
            obj.chunk(index.offset)
            if isinstance(obj, ShardedView)
            else super().lookup_tensor(index)
        )
