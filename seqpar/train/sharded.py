"""This rank's shards of full tensors, described to ``torch.distributed.checkpoint`` by their offsets.

A ``ShardedView`` wraps a local tensor (a parameter's fp32 master, an Adam moment) and its
``ParamLayout``. DCP sees the *full* (single-process) tensor, of which this rank holds the chunks
``layout.blocks`` names: the rank's pieces cut at the layout-independent block grid. Chunks that
several ranks hold (replicated parameters, the k/v rows shared under grouped QKV, dp replicas, a
tied embedding's two copies) have the same offsets on each, and DCP's planner writes each once.
Loading reads the stored chunks overlapping this rank's into the local tensor in place, so no rank
ever allocates a full tensor of a split parameter, and a read is never larger than one stored chunk.

DCP resolves a chunk of a tensor subclass through ``__get_tensor_shard__``; a ``ShardedView`` is not a
tensor, so the two planners below resolve its chunks instead (``lookup_object``/``lookup_tensor``, the
extension points DCP's default planners name).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from seqpar.parallel.layout import REPLICATED, ParamLayout, Piece


class ShardedView:
    """``local`` (this rank's shard, local shape) as chunks of the full tensor ``layout`` describes."""

    def __init__(self, local: torch.Tensor, layout: ParamLayout = REPLICATED, tp_rank: int = 0, tp: int = 1):
        self.local, self.layout = local.detach(), layout
        shape = tuple(local.shape)
        self.full = torch.Size(layout.full_shape(shape, tp))
        self.chunks: list[Piece] = [piece for _, piece in layout.blocks(shape, tp_rank, tp) if piece.length]
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

    # DCP's _Checkpointable protocol (what DTensor implements): the chunks this rank writes and reads
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, self._offsets(p)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(self._offsets(p), self._sizes(p)),
                                                      properties=properties, size=self.full))
                for p in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(self._offsets(p), self._sizes(p)) for p in self.chunks]


class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.chunk(index.offset) if isinstance(obj, ShardedView) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner on a flat state dict of ``ShardedView``s and tensors (its set-up would
    replace objects it does not know by None, while materialising meta tensors, which we have none of)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.chunk(index.offset) if isinstance(obj, ShardedView) else super().lookup_tensor(index)
