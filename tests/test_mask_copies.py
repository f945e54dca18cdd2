"""Dropout masks repeat no row up to a permutation, and no two dropout sites share a key (issue
42.5).

A position-keyed hash that carries too few bits from one coordinate to the next repeats itself: with
32 bits folded in as ``mix32(h ^ c)``, two rows whose running hashes differ by an XOR ``d`` below
the row length are one mask permuted (``row2[j] == row1[j ^ d]``), and 32-bit site keys collide.
Independent Bernoulli bits do neither. Checked here, on the bits themselves:

* **Row copies** (CI size: an attention mask ``[b 2, heads 8, s 1024, 1024]``, 16,384 rows; the old
  hash gave 33 copies): a row's Walsh–Hadamard magnitudes ``|W(u)|`` do not change when its
  positions are XOR-permuted (``W`` only changes sign), so equal magnitude fingerprints find every
  candidate pair; each is confirmed by searching the ``d`` with ``row2[j] == row1[j ^ d]``. None is
  allowed.
* **Site keys** (CI size: 2¹⁸ keys of steps × layers × sites; the old 32-bit keys had 9 duplicates):
  all distinct.

``SEQPAR_MASK_STATS_FULL=1``: the production-size statistics (global batch 1024, sequence 4096,
hidden 4096, 32 heads; ``SEQPAR_MASK_STATS_STEPS`` steps, default 64,
``SEQPAR_MASK_STATS_ATTENTION_STEPS`` of them for the attention mask, default all): 2²¹ site keys;
per step, the hidden mask's (sample, position) rows over the channels and its samples over the
positions, and the attention mask's 134M (sample, head, query) rows. Candidate pairs are those whose
running hashes (``rng.prefix_bits``, the state before the last coordinate) agree on every bit above
the row length -- the relation the 32-bit hash turned into copies -- and each (the first 256 per
statistic and step) is confirmed or rejected on its bits (``row2[j] == row1[j ^ d]``, for samples on
8 positions). Prints one summary line per statistic; every confirmed copy fails. Last run
(2026-12-05, commit after 9b53be9, a loaded 2-core CPU, 25 min; attention for 8 of the 64 steps, ~3
min each there):
    site keys: 2097152 (steps 16384 × layers 32 × sites 4), 0 duplicates
    hidden masks [s 4096, b 1024, h 4096] × 64 steps: (sample, position) rows 4194304 per step, candidate
      pairs 0, confirmed copies 0; samples: candidate pairs 0, whole-sample position shuffles 0
    attention masks [b 1024, heads 32, s 4096, 4096] × 8 steps: rows 134217728 per step, candidate pairs 16,
      confirmed copies 0
(16 candidates: 64-bit running hashes equal above bit 12 by chance, ~2 expected per step; none
shares bits.)
"""

import math
import os

import pytest
import torch

from seqpar.parallel.dropout import AttentionMask
from seqpar.parallel.rng import SITES, coordinates, keep_mask, prefix_bits, site_key

P = 0.1
FULL = os.environ.get("SEQPAR_MASK_STATS_FULL") == "1"


@pytest.fixture(autouse=True)
def _eager_masks(monkeypatch):
    monkeypatch.setenv("SEQPAR_COMPILE_MASKS", "0")  # the same bits, no compile per shape


def walsh_hadamard(rows: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` (m a power of two) → the Walsh–Hadamard transform of each row (unnormalised)."""
    n, m = rows.shape
    h = 1
    while h < m:
        x = rows.view(n, m // (2 * h), 2, h)  # [n, blocks, pair, h]
        rows = torch.stack((x[:, :, 0] + x[:, :, 1], x[:, :, 0] - x[:, :, 1]), dim=2).view(n, m)
        h *= 2
    return rows


def xor_shift(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The ``d`` with ``b[j] == a[j ^ d]`` for every j (``[m]`` rows, m a power of two), or None."""
    m = a.numel()
    j = torch.arange(m)
    same = (a[j[None, :] ^ j[:, None]] == b[None, :]).all(dim=1)  # [d]
    hits = same.nonzero().flatten()
    return int(hits[0]) if hits.numel() else None


def equal_pairs(values: torch.Tensor) -> list[tuple[int, int]]:
    """Index pairs (i, j) of equal ``values`` ``[n]`` (consecutive members of each group of
    equals)."""
    order = torch.argsort(values)
    sorted_values = values[order]
    at = (sorted_values[1:] == sorted_values[:-1]).nonzero().flatten()
    return [(int(order[i]), int(order[i + 1])) for i in at]


def xor_copies(keep: torch.Tensor) -> list[tuple[int, int, int]]:
    """Rows of ``keep [..., m]`` that are XOR-permuted copies of another row: (row, row, d)
    triples."""
    rows = keep.reshape(-1, keep.shape[-1])  # [n, m]
    # [n, m], XOR-invariant
    spectrum = walsh_hadamard(rows.to(torch.int32) * 2 - 1).abs().to(torch.int64)
    weights = torch.randint(
        -(2**62), 2**62, (rows.shape[1],), generator=torch.Generator().manual_seed(0)
    )
    fingerprint = (spectrum * weights).sum(1)  # [n] (wrapping int64: a 64-bit fingerprint)
    found = []
    for i, j in equal_pairs(fingerprint):
        d = xor_shift(rows[i], rows[j])
        if d is not None:
            found.append((i, j, d))
    return found


def test_no_attention_row_is_a_permuted_copy_of_another():
    b, heads, s = 2, 8, 1024
    keep = AttentionMask(site_key(1234, 7, 3, "attention"), P, ((0, b),), ((0, heads),)).keep(
        ((0, s),), ((0, s),), "cpu")  # [b, heads, s, s]
    copies = xor_copies(keep)
    print(
        f"\nattention mask [{b}, {heads}, {s}, {s}]: {b * heads * s} rows, {len(copies)} "
        f"XOR-permuted copies (first: {copies[:3]})"
    )
    assert copies == []


def test_the_finder_finds_a_planted_copy():
    """The search above can fail: a row planted as an XOR-permuted copy of another is found."""
    # [rows, m] independent bits
    keep = torch.rand(256, 64, generator=torch.Generator().manual_seed(1)) >= P
    keep[200] = keep[17][torch.arange(64) ^ 45]  # row 200 := row 17 permuted by XOR 45
    assert [(min(i, j), max(i, j), d) for i, j, d in xor_copies(keep)] == [(17, 200, 45)]


def test_site_keys_are_distinct():
    steps, layers = 8192, 8  # 2**18 keys
    keys = torch.tensor(
        [
            site_key(1234, step, layer, site)
            for step in range(steps)
            for layer in range(-1, layers - 1)
            for site in SITES
        ]
    )
    duplicates = len(equal_pairs(keys))
    print(
        f"\n{keys.numel()} site keys (steps {steps} × layers {layers} × sites {len(SITES)}): "
        f"{duplicates} duplicates"
    )
    assert duplicates == 0


# ---- production-size statistics (SEQPAR_MASK_STATS_FULL=1) ----

BATCH, SEQ, HIDDEN, HEADS = 1024, 4096, 4096, 32


def near_pairs(prefixes: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """Index pairs of running hashes ``[n]`` equal on every bit above ``length`` (a power of
    two)."""
    return equal_pairs(prefixes >> int(math.log2(length)))


def _row(key: int, point: list[int], last: int) -> torch.Tensor:
    """The keep bits ``[last]`` of one row: coordinates ``point``, the last axis over [0, last)."""
    return keep_mask(key, P, [((c, c + 1),) for c in point] + [((0, last),)], "cpu").flatten()


# candidate pairs checked on their bits per statistic and step (a hash with copies has millions)
CONFIRM = 256


def confirmed(key: int, pairs, shape: tuple[int, ...], last: int) -> int:
    """How many of the first ``CONFIRM`` candidate row pairs (flat indices into ``shape``) are
    XOR-permuted copies, on their bits."""
    count = 0
    for i, j in pairs[:CONFIRM]:
        a, b = (_row(key, list(torch.unravel_index(torch.tensor(x), shape)), last) for x in (i, j))
        count += xor_shift(a, b) is not None
    return count


def _samples_confirmed(key: int, pairs) -> int:
    """Sample pairs whose whole hidden mask is the other's with its positions permuted (8 positions
    checked)."""
    count = 0
    for s1, s2 in pairs[:CONFIRM]:
        # [s, h]
        first = keep_mask(key, P, [((s1, s1 + 1),), ((0, SEQ),), ((0, HIDDEN),)], "cpu")[0]
        count += all(bool((first == _row(key, [s2, pos], HIDDEN)).all(1).any()) for pos in range(8))
    return count


def _hidden_stats(step: int) -> tuple[int, int, int, int]:
    key = site_key(1234, step, 0, "mlp_output")
    samples, positions = coordinates([((0, BATCH),), ((0, SEQ),)], "cpu")
    # [b·s]: (sample, position) rows over channels
    rows = prefix_bits(key, samples, positions).flatten()
    row_pairs = near_pairs(rows, HIDDEN)
    # samples over (position, channel)
    sample_pairs = near_pairs(prefix_bits(key, samples.flatten()), SEQ)
    return (len(row_pairs), confirmed(key, row_pairs, (BATCH, SEQ), HIDDEN), len(sample_pairs),
            _samples_confirmed(key, sample_pairs))


def _attention_stats(step: int) -> tuple[int, int]:
    key = site_key(1234, step, 0, "attention")
    shift = int(math.log2(SEQ))
    # [b, heads, s]: each row's hash above the row length
    high = torch.empty(BATCH, HEADS, SEQ, dtype=torch.int64)
    for start in range(0, BATCH, 64):
        coords = coordinates([((start, start + 64),), ((0, HEADS),), ((0, SEQ),)], "cpu")
        high[start:start + 64] = prefix_bits(key, *coords) >> shift
    pairs = equal_pairs(high.flatten())
    return len(pairs), confirmed(key, pairs, (BATCH, HEADS, SEQ), SEQ)


@pytest.mark.skipif(not FULL, reason="production-size statistics: SEQPAR_MASK_STATS_FULL=1")
def test_production_size_statistics():
    steps = int(os.environ.get("SEQPAR_MASK_STATS_STEPS", "64"))
    attention_steps = int(os.environ.get("SEQPAR_MASK_STATS_ATTENTION_STEPS", str(steps)))
    keys = torch.tensor(
        [
            site_key(1234, step, layer, site)
            for step in range(16384)
            for layer in range(32)
            for site in SITES
        ]
    )
    key_duplicates = len(equal_pairs(keys))
    print(
        f"\nsite keys: {keys.numel()} (steps 16384 × layers 32 × sites {len(SITES)}), "
        f"{key_duplicates} duplicates"
    )
    hidden = [sum(x) for x in zip(*(_hidden_stats(step) for step in range(steps)), strict=True)]
    print(
        f"hidden masks [s {SEQ}, b {BATCH}, h {HIDDEN}] × {steps} steps: (sample, position) rows "
        f"{BATCH * SEQ} per step, candidate pairs {hidden[0]}, confirmed copies {hidden[1]}; "
        f"samples: candidate pairs {hidden[2]}, whole-sample position shuffles {hidden[3]}"
    )
    attention = [
        sum(x)
        for x in zip(*(_attention_stats(step) for step in range(attention_steps)), strict=True)
    ]
    print(
        f"attention masks [b {BATCH}, heads {HEADS}, s {SEQ}, {SEQ}] × {attention_steps} steps: "
        f"rows {BATCH * HEADS * SEQ} per step, candidate pairs {attention[0]}, confirmed copies "
        f"{attention[1]}"
    )
    assert key_duplicates == 0 and hidden[1] == 0 and hidden[3] == 0 and attention[1] == 0
