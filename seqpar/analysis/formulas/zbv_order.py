"""ZB-V's order (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 6): what each
pipeline rank runs, in which order. Torch-free: the schedule (``seqpar.pipeline.schedule_zbv``)
runs it, the memory formula (``deferred_w``) walks it.

The model is cut into 2p chunks in a V: rank r holds chunk 0 = virtual stage r and chunk 1 =
virtual stage 2p - 1 - r. A microbatch's forward goes down the ranks on chunk 0 and back up on chunk
1 (rank p - 1 hands its chunk 0's output to its own chunk 1), its backward the other way round; the
loss is on rank 0's chunk 1.

Per rank r of p, n microbatches (``rank_order``; the counts are those of n' = max(n, 2p - 1), then
every action of a microbatch >= n is dropped: with fewer microbatches the V is not full):
  * warm-up: 2(p - r) - 1 chunk-0 forwards; then r pairs (chunk-1 forward, chunk-0 forward);
    then p - r triples (chunk-1 forward, chunk-1 B, chunk-1 W);
  * steady, while forwards remain: (chunk-0 forward while any is left, chunk-0 B, chunk-0 W,
    chunk-1 forward, chunk-1 B, chunk-1 W);
  * cool-down: r pairs (chunk-0 B, chunk-1 B), then p - r pairs (chunk-0 B, a chunk-0 W), then the
    chunk-1 Ws left, then the chunk-0 Ws left, each chunk's in microbatch order.
The Ws of each chunk run in microbatch order, as the Bs do: every parameter accumulates its
microbatches' gradients in 1F1B's order.

Each action's unit-time slot (``_slots``) is the earliest its order and its inputs allow (F = B = W
= 1; a result crosses to a neighbour at the end of its slot): with F = B = W the V has (nearly) no
bubble at 1F1B's activation memory (each chunk is half a stage: a rank holds about 2p half-stage
microbatches, p stage ones). The schedule runs each rank's order as its inputs arrive; the slots
give the order in which both ends of a link post its messages (``link_order``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """One unit of a rank's work: ``kind`` F (forward), B (input gradient) or W (weight
    gradients) of ``chunk`` (0 or 1) on microbatch ``mb``."""

    kind: str
    chunk: int
    mb: int


def rank_order(rank: int, p: int, n: int) -> list[Action]:
    """Pipeline rank ``rank``'s actions in order (module doc)."""
    return list(_rank_order(rank, p, n))


@functools.cache  # the planner asks for the same few (rank, p, n) thousands of times
def _rank_order(rank: int, p: int, n: int) -> tuple[Action, ...]:
    total = max(n, 2 * p - 1)
    ops: list[Action] = []
    f, b, w = [0, 0], [0, 0], [0, 0]  # next forward / B / W per chunk

    def add(kind: str, chunk: int) -> None:
        count = {"F": f, "B": b, "W": w}[kind]
        ops.append(Action(kind, chunk, count[chunk]))
        count[chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    for _ in range(p - rank):
        add("F", 1)
        add("B", 1)
        add("W", 1)
    while f[1] < f[0] or f[0] < total:
        if f[0] < total:
            add("F", 0)
        add("B", 0)
        add("W", 0)
        add("F", 1)
        add("B", 1)
        add("W", 1)
    for _ in range(rank):
        add("B", 0)
        add("B", 1)
    for _ in range(p - rank):
        add("B", 0)
        add("W", 0)
    while w[1] < b[1]:
        add("W", 1)
    while w[0] < b[0]:
        add("W", 0)
    return tuple(a for a in ops if a.mb < n)


def source(action: Action, rank: int, p: int) -> tuple[int, str, int] | None:
    """The action whose result ``action`` waits for, as (rank, kind, chunk) on the same microbatch
    (None: it waits for nothing but its rank's order: a first-stage forward)."""
    kind, chunk = action.kind, action.chunk
    if kind == "W":
        return rank, "B", chunk
    if kind == "F":
        if chunk == 0:
            return None if rank == 0 else (rank - 1, "F", 0)
        return (rank, "F", 0) if rank == p - 1 else (rank + 1, "F", 1)
    if chunk == 1:  # B: the gradient comes back down the V
        return (rank, "F", 1) if rank == 0 else (rank - 1, "B", 1)
    return (rank, "B", 1) if rank == p - 1 else (rank + 1, "B", 0)


def message(action: Action, rank: int, p: int) -> str | None:
    """Where ``action``'s result goes when another rank needs it: "up" (to rank + 1), "down" (to
    rank - 1), or None (kept on this rank: the loss, the V's turn at rank p - 1, a first-stage dX,
    a W)."""
    if action.kind == "W":
        return None
    up = (action.kind == "F") == (action.chunk == 0)  # chunk 0's F and chunk 1's B go up the ranks
    if up:
        return "up" if rank < p - 1 else None
    return "down" if rank > 0 else None


def _as_early_as_possible(p: int, n: int, cost: dict[str, float],
                          scale: list[tuple[float, float]] | None = None) -> dict[tuple, float]:
    """(rank, kind, chunk, mb) -> the start of every action of the ranks' orders, each as early as
    its rank's order and its input allow when a chunk's F, B and W take ``cost`` seconds, times
    ``scale[rank][chunk]`` where given (chunks of different layers; a result sent to a neighbour is
    there when its action ends). Raises if the orders deadlock."""
    start: dict[tuple[int, str, int, int], float] = {}
    end: dict[tuple[int, str, int, int], float] = {}
    clock = [0.0] * p  # when the rank is free
    for r, me, dep in _visit_order(p, n):  # the order of _visit_order, which no cost changes
        start[me] = max(clock[r], end[dep] if dep is not None else 0.0)
        took = cost[me[1]] * (1.0 if scale is None else scale[r][me[2]])
        clock[r] = end[me] = start[me] + took
    return start


@functools.cache  # a pure function of (p, n), walked once per cost by the planner
def _visit_order(p: int, n: int) -> tuple[tuple[int, tuple, tuple | None], ...]:
    """Every action as (rank, (rank, kind, chunk, mb), the key of the action it waits for or None),
    in an order that places each after its input: sweeps over the ranks, each rank running its order
    until an input is missing. Which inputs exist depends on the order alone, never on the actions'
    times, so one walk serves every ``cost``. Raises if the orders deadlock."""
    orders = [_rank_order(r, p, n) for r in range(p)]
    done: set[tuple[int, str, int, int]] = set()
    out: list[tuple[int, tuple, tuple | None]] = []
    at = [0] * p  # next action per rank
    while any(at[r] < len(orders[r]) for r in range(p)):
        progress = False
        for r in range(p):
            while at[r] < len(orders[r]):
                a = orders[r][at[r]]
                dep = source(a, r, p)
                key = None if dep is None else (*dep, a.mb)
                if key is not None and key not in done:
                    break
                me = (r, a.kind, a.chunk, a.mb)
                out.append((r, me, key))
                done.add(me)
                at[r], progress = at[r] + 1, True
        if not progress:
            raise RuntimeError(f"ZB-V's order deadlocks at p {p}, n {n}")
    return tuple(out)


def link_order(lower: int, p: int, n: int) -> tuple[tuple[str, Action], ...]:
    """The messages between ranks ``lower`` and ``lower + 1``, both directions, in one order both
    sides derive: each as (its direction, the action whose result it is), ordered by the unit-time
    slot of that action (module doc), "up" (sent by ``lower``) before "down" in one slot.

    Each side posts its sends and receives on the link in this order (``run_zb_v``), so NCCL,
    which pairs a pair's operations in the order each side issues them, pairs every one. A
    rank's own sends come in its order (slots rise along it), and every message a rank receives
    comes before its own sends of later slots, which its action needing it follows: it may post
    every receive ahead of its next send, and it has when it needs one."""
    return _link_order(lower, p, n)


@functools.cache
def _link_order(lower: int, p: int, n: int) -> tuple[tuple[str, Action], ...]:
    slots = _slots(p, n)
    out = []
    for r, d in ((lower, "up"), (lower + 1, "down")):
        for a in _rank_order(r, p, n):
            if message(a, r, p) == d:
                out.append((slots[(r, a.kind, a.chunk, a.mb)], d == "down", (d, a)))
    return tuple(m for *_, m in sorted(out, key=lambda m: m[:2]))


@functools.cache
def _slots(p: int, n: int) -> dict[tuple[int, str, int, int], int]:
    """(rank, kind, chunk, mb) -> the unit-time slot of every action (module doc). Raises if the
    orders deadlock."""
    return {k: int(v) for k, v in _as_early_as_possible(p, n, dict.fromkeys("FBW", 1.0)).items()}


@dataclass(frozen=True)
class Moment:
    """What a rank holds at the end of a forward or of a B (before any W), the moments its
    activation memory can peak: chunk-microbatches in flight per chunk (from a forward to its B),
    W units per chunk (from a B to its W), on rank p - 1 the chunk-0 outputs handed to its own
    chunk 1 whose forward has not run yet (``handed``), and the receives posted ahead whose F or B
    has not run yet (``waiting``: ``posted_ahead``)."""

    kind: str  # the action that just ended: F or B
    chunk: int
    flight: tuple[int, int]
    units: tuple[int, int]
    handed: int = 0
    waiting: int = 0


@functools.cache  # the planner's memory formula asks for the same (rank, p, n) many times
def moments(rank: int, p: int, n: int) -> tuple[Moment, ...]:
    """Every forward end and B end of rank ``rank``'s order, with what it holds then."""
    flight, units, handed, out = [0, 0], [0, 0], 0, []
    waiting = iter(posted_ahead(rank, p, n))
    for a in _rank_order(rank, p, n):
        if a.kind == "W":
            units[a.chunk] -= 1
            continue
        step = 1 if a.kind == "F" else -1
        flight[a.chunk] += step
        if a.kind == "B":
            units[a.chunk] += 1
        elif rank == p - 1:  # the V's turn: chunk 0's output waits for chunk 1's forward
            handed += 1 if a.chunk == 0 else -1
        out.append(Moment(a.kind, a.chunk, (flight[0], flight[1]), (units[0], units[1]), handed,
                          next(waiting)))
    return tuple(out)


@functools.cache
def posted_ahead(rank: int, p: int, n: int) -> tuple[int, ...]:
    """At the end of each F and B of rank ``rank``'s order, the receives it has posted whose F or
    B has not run (the schedule's rule, ``run_zb_v``: on each link every receive ahead of its own
    next send there, posted at the start and after each send): each an activation or a gradient at
    the boundary. At most 2(p - 1), in the warm-up (rank 1 takes rank 0's first chunk-0 outputs
    before its first send down)."""
    links = {}  # direction this rank sends in -> [its link's order, next op]
    if rank < p - 1:
        links["up"] = [_link_order(rank, p, n), 0]
    if rank > 0:
        links["down"] = [_link_order(rank - 1, p, n), 0]
    waiting: set[tuple[str, int, int]] = set()

    def post(mine: str) -> None:
        ops, at = links[mine]
        while at < len(ops) and ops[at][0] != mine:
            waiting.add((ops[at][1].kind, ops[at][1].chunk, ops[at][1].mb))
            at += 1
        links[mine][1] = at

    for mine in links:
        post(mine)
    out = []
    for a in _rank_order(rank, p, n):
        if a.kind == "W":
            continue
        src = source(a, rank, p)
        if src is not None and src[0] != rank:
            waiting.remove((src[1], src[2], a.mb))
        out.append(len(waiting))
        sent = message(a, rank, p)
        if sent is not None:
            links[sent][1] += 1
            post(sent)
    return tuple(out)


@functools.cache
def distinct_moments(rank: int, p: int, n: int) -> tuple[Moment, ...]:
    """``moments``' distinct values in the order each first occurs: the first fullest of them is
    the first fullest of all (the steady state repeats the same few)."""
    return tuple(dict.fromkeys(moments(rank, p, n)))


def v_split(per_rank: list[int] | tuple[int, ...]) -> tuple[int, ...] | None:
    """The V's layers per virtual stage (2p entries, model order) that give each rank the layers
    ``per_rank`` gives it under 1F1B (so each rank holds 1F1B's layers): rank r's chunk 0 the
    larger half, ceil(c_r / 2), its chunk 1 the rest; () when that is even. None where a middle
    stage would be empty (a rank of fewer than 2 layers, other than rank 0, whose chunk 1 is the
    last stage)."""
    p = len(per_rank)
    counts = [0] * (2 * p)
    for r, c in enumerate(per_rank):
        counts[r], counts[2 * p - 1 - r] = -(-c // 2), c // 2
    if any(c == 0 for c in counts[1:-1]):
        return None
    return () if len(set(counts)) == 1 else tuple(counts)


def chunk_cut(rank: int, p: int, n: int, layers: int, act: float, unit: float,
              least: int = 1, spread: int = 2) -> int:
    """How many of rank ``rank``'s ``layers`` its chunk 0 takes (chunk 1 the rest, each at least
    ``least``, the two at most ``spread`` layers apart: a longer chunk lengthens the V's slots) so
    that the most it holds at any forward or B end (``moments``) is least, a layer of a
    chunk-microbatch in flight holding ``act`` bytes and of a W unit ``unit``; ties: the more even
    cut."""
    held = {(m.flight, m.units) for m in distinct_moments(rank, p, n)}

    def peak(k: int) -> float:
        return max((f[0] * k + f[1] * (layers - k)) * act + (u[0] * k + u[1] * (layers - k)) * unit
                   for f, u in held)

    apart = max(spread, layers % 2)  # an odd count's halves are 1 apart
    cuts = [k for k in range(least, layers - least + 1) if abs(layers - 2 * k) <= apart]
    return min(cuts, key=lambda k: (peak(k), abs(2 * k - layers)))


def idle_times(p: int, n: int, cost: dict[str, float],
               scale: list[tuple[float, float]] | None = None) -> list[float]:
    """Each rank's idle time over one step when its order runs with ``cost`` seconds per chunk F, B
    and W (times ``scale[rank][chunk]`` where given: chunks of different layers), each action as
    early as its rank's order and its input allow (the makespan less the rank's work)."""
    scale = scale or [(1.0, 1.0)] * p
    starts = _as_early_as_possible(p, n, cost, scale)
    makespan = max(t + cost[kind] * scale[r][c] for (r, kind, c, _), t in starts.items())
    return [makespan - n * sum(cost.values()) * sum(scale[r]) for r in range(p)]
