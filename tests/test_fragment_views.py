"""A distributed optimizer's fragment (a flat range of a parameter's tp-local shard) described to
DCP as boxes of the full tensor: the boxes cover the range exactly, each box is the right view of
the fragment's own tensor, and it lands where that element lies in the full tensor, for every layout
and block grid."""

import math
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.parallel import layout as layout_module
from seqpar.parallel.layout import GroupedQKVLayout, ParamLayout
from seqpar.train.optim.sharded import FragmentView, flat_boxes


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_boxes_cover_the_range_once(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    hits = torch.zeros(shape, dtype=torch.int64)
    boxes = flat_boxes(start, stop, tuple(shape))
    for offsets, sizes in boxes:
        hits[tuple(slice(o, o + z) for o, z in zip(offsets, sizes, strict=True))] += 1
    want = torch.zeros(n, dtype=torch.int64)
    want[start:stop] = 1
    assert torch.equal(hits.view(-1), want)
    assert len(boxes) <= 2 * len(shape) - 1


LAYOUTS = {  # name -> (layout, local shape at tp=2)
    "replicated": (ParamLayout(), (6, 5)),
    "rows": (ParamLayout(split_dim=0), (4, 6)),
    "columns": (ParamLayout(split_dim=1), (5, 3)),
    "padded vocabulary": (ParamLayout(split_dim=0, full_size=7), (4, 3)),
    "gate;up parts": (ParamLayout(split_dim=0, parts=2), (6, 4)),
    "grouped qkv": (
        ParamLayout(split_dim=0, grouped=GroupedQKVLayout(heads=4, kv=1, d=2, tp=2)),
        (8, 3),
    ),
    "vector": (ParamLayout(split_dim=0), (9,)),
}


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(LAYOUTS)), st.integers(0, 1), st.integers(1, 40), st.data())
def test_fragment_boxes_are_views_of_the_fragment_at_their_full_position(name, tp_rank, block, data):
    layout, local_shape = LAYOUTS[name]
    n = math.prod(local_shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    with mock.patch.object(layout_module, "BLOCK_ELEMENTS", block):  # small blocks: boxes cut at the grid
        full_shape = layout.full_shape(local_shape, 2)
        full = torch.arange(math.prod(full_shape), dtype=torch.float32).view(full_shape) + 1
        local = layout.shard(full, local_shape, tp_rank, 2)  # padding entries 0
        fragment = local.reshape(-1)[start:stop].clone()
        view = FragmentView(fragment, local_shape, start, stop, layout, tp_rank, 2)
        seen = torch.zeros(full_shape)
        for c in view.__create_chunk_list__():
            box = tuple(slice(o, o + z) for o, z in zip(c.offsets, c.sizes, strict=True))
            piece = view.chunk(c.offsets)
            assert piece.untyped_storage().data_ptr() == fragment.untyped_storage().data_ptr()  # a view, no copy
            assert torch.equal(piece, full[box])
            seen[box] += 1
    assert seen.max() <= 1
    # every element of the range that is not padding, and nothing else
    values = fragment[fragment > 0]
    assert torch.equal(torch.sort(full[seen > 0]).values, torch.sort(values).values)
