"""Activation offloading, beside recomputation: a module's saved tensors go to host memory after it
saves them and come back for its backward (``RecomputeConfig.offload_modules``, the names of
``config.OFFLOAD_MODULES``).

Each layer (or full-recompute group: ``RecomputePlan.layer_blocks``) runs inside one pair of
``saved_tensors_hooks``; the modules that offload mark where they run (``Offloader.scope``). A
tensor saved while an offloaded module runs -- or the layer's input where ``layer_input`` offloads
-- is copied, its whole storage once per layer, into a host buffer, and autograd keeps only a
handle: the device storage is freed as soon as the forward drops its last reference. The first
backward that unpacks one of a layer's handles brings the whole layer back and starts bringing back
the layer before it (its backward comes next). Parameters and buffers are never offloaded
(``seqpar.storages``, the meter's rule), nor a norm output that norm recomputation releases
(``sparing``).

Composition with a meter (``seqpar.measure``): the hooks found active when a layer starts (a
meter's) still see every tensor the layer keeps on the device; offloaded tensors do not reach them,
and ``Offloader.host_tensors`` lists what is on the host, per module -- the meter counts device
bytes, the offloader host bytes.

On CUDA: pinned host buffers from a pool reused across steps, copies on one side stream (device→host
after the producer, host→device before the consumer, events between), so a layer's copies run under
the next layer's forward and the previous layer's reload under this layer's backward; the stream and
events are the tensor's device's. Pinned blocks are what torch's caching host allocator reserves,
powers of two (``reserved_host_bytes`` beside the exact ``peak_host_bytes``). On CPU the copies are
real copies into the same kind of pool, synchronously: the code path and the accounting run in CI;
time figures there mean nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from seqpar import documents
from seqpar.analysis.formulas.memory import pinned_block_bytes
from seqpar.storages import module_storages, storage_key, storage_of


class HostPool:
    """Host byte buffers, reused across steps: ``take`` one, ``give`` it back. Pinned (on CUDA) a
    buffer is a view of a whole block of ``pinned_block_bytes`` -- what torch's caching host
    allocator reserves for it anyway -- so a block serves every size that rounds to it, and
    ``allocated_bytes`` is the pinned RAM really held."""

    def __init__(self):
        # whole blocks by (bytes, pinned)
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = defaultdict(list)
        self.allocated_bytes = 0  # every block the pool ever made, as the allocator reserves them

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        """uint8 ``[nbytes]``: a view of a free block of its size class, or of a new one."""
        size = pinned_block_bytes(nbytes) if pin else nbytes
        free = self._free[(size, pin)]
        if not free:
            self.allocated_bytes += size
            free.append(torch.empty(size, dtype=torch.uint8, pin_memory=pin))
        return free.pop()[:nbytes]  # [nbytes], a view of the block

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer ``take`` gave: its whole block is free again."""
        block = buffer._base if buffer._base is not None else buffer
        self._free[(block.numel(), block.is_pinned())].append(block)


class HostLedger:
    """Offloaded bytes on the host now and at most, over every offloader that shares it (a rank's
    chunks)."""

    def __init__(self):
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


class _Entry:
    """One device storage of a layer, on the host until its reload."""

    def __init__(self, module: str, host: torch.Tensor, device: torch.device, shape, dtype):
        self.module, self.host, self.device = module, host, device
        self.shape, self.dtype = tuple(shape), str(dtype).removeprefix("torch.")
        self.nbytes = host.numel()
        self.loaded: torch.Tensor | None = None  # uint8 [nbytes] on the device, once reloaded


def _document_storages() -> set[int]:
    """The storages of the microbatch's packed documents (their shared masks): data every layer
    reads, kept once on the device, never offloaded per layer (as the meter leaves them out)."""
    docs = documents.current()
    return set() if docs is None else {storage_key(t) for t in docs.held()}


class _LayerRecord:
    """What one layer's forward offloaded (storage key → entry), and the record of the layer before
    it."""

    def __init__(self, prev: _LayerRecord | None, input_key: int | None, modules: list):
        # weak: a finished layer's record may go
        self.prev = None if prev is None else weakref.ref(prev)
        self.input_key, self.modules = input_key, modules
        self._excluded: set[int] | None = None
        # storage key → (weak reference, entry): a storage freed during the forward may see its key
        # reused by a later one, which the dead reference tells apart
        self.entries: dict[int, tuple[StorageWeakRef, _Entry]] = {}
        self.reloaded = False
        self.ready: torch.cuda.Event | None = None  # the reload's copies are done (CUDA)
        self.ledger: HostLedger | None = None

    @property
    def excluded(self) -> set[int]:
        """The storages of the unit's parameters and buffers, read at its first save (after FSDP's
        pre-forward gather has put the unsharded parameters in place)."""
        if self._excluded is None:
            self._excluded = module_storages(self.modules)
        return self._excluded

    # a forward whose backward never came (its graph dropped): its host bytes are gone
    def __del__(self):
        if not self.reloaded and self.ledger is not None:
            self.ledger.add(-sum(e.nbytes for _, e in self.entries.values()))


class _Packed:
    """What autograd keeps for an offloaded tensor: its layer record, storage and view."""

    __slots__ = ("record", "entry", "dtype", "size", "stride", "offset")

    def __init__(self, record: _LayerRecord, entry: _Entry, t: torch.Tensor):
        self.record, self.entry, self.dtype = record, entry, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Offloader:
    """The offloading of one model stage: which modules, the scopes they run in, the host pool and
    the layers' records (weakly held: a record lives as long as the graph that can still unpack
    it)."""

    def __init__(self, modules=()):
        self.modules = frozenset(modules)
        self.pool = HostPool()
        self.ledger = HostLedger()
        self._stack: list[str] = []
        self._spared: set[int] = set()
        self._records: weakref.WeakSet[_LayerRecord] = weakref.WeakSet()
        self._last = None  # weakref to the record of the last layer run
        # the side stream per device (CUDA)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    # ------------------------------------------------------------------ where modules run
    def scope(self, module: str, run):
        """``run``, marked as ``module``'s: what it saves is offloaded."""
        return _Scope(self, module, run)

    def sparing(self, consumer):
        """``consumer(y)`` whose saves of ``y`` stay on the device (y is released and rebuilt by
        recomputation)."""
        return _Sparing(self, consumer) if self.modules else consumer

    @contextlib.contextmanager
    def running(self, module: str):
        self._stack.append(module)
        try:
            yield
        finally:
            self._stack.pop()

    @contextlib.contextmanager
    def spared(self, t: torch.Tensor):
        key = storage_key(t)
        self._spared.add(key)
        try:
            yield
        finally:
            self._spared.discard(key)

    def layer(self, block, first: bool, modules: list):
        """``block`` (a layer or a full-recompute group of ``modules``) run as one offloading unit;
        ``first``: the stage's first block (its record starts a new chain)."""
        return _Layer(self, block, first, modules) if self.modules else block

    def share(self, other: Offloader) -> None:
        """Use ``other``'s host pool and ledger (one rank's chunks: one pool, one peak)."""
        self.pool, self.ledger = other.pool, other.ledger

    # ------------------------------------------------------------------ accounting
    @property
    def peak_host_bytes(self) -> int:
        """The most offloaded bytes on the host at once (exact: what the formula's host terms
        count)."""
        return self.ledger.peak_bytes

    @property
    def reserved_host_bytes(self) -> int:
        """Host RAM the pool holds for them: pinned blocks as the allocator rounds them
        (``pinned_block_bytes``), up to 2x ``peak_host_bytes`` on CUDA; the same bytes on CPU."""
        return self.pool.allocated_bytes

    def host_tensors(self) -> list[_Entry]:
        """What is on the host now (offloaded, not yet reloaded), every layer of every microbatch in
        flight."""
        return [e for r in list(self._records) if not r.reloaded for _, e in r.entries.values()]

    def host_bytes(self) -> dict[str, int]:
        """Host bytes now per module."""
        out: dict[str, int] = defaultdict(int)
        for e in self.host_tensors():
            out[e.module] += e.nbytes
        return dict(out)

    # ------------------------------------------------------------------ the hooks
    def run_layer(self, block, first: bool, modules: list, x: torch.Tensor):
        # a checkpoint's forward, or its recomputation
        if not torch.is_grad_enabled() or _in_backward():
            return block(x)
        prev = None if first or self._last is None else self._last()
        record = _LayerRecord(prev, storage_key(x), modules)
        record.ledger = self.ledger
        self._records.add(record)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(record, outer, t), self._unpack
        ):
            y = block(x)
        self._last = weakref.ref(record)
        return y

    def _owner(self, record: _LayerRecord, key: int) -> str | None:
        if key in record.excluded or key in self._spared or key in _document_storages():
            return None
        if key == record.input_key and "layer_input" in self.modules:
            return "layer_input"
        module = self._stack[-1] if self._stack else None
        return module if module in self.modules else None

    def _pack(self, record: _LayerRecord, outer, t: torch.Tensor):
        storage = storage_of(t)
        key = storage._cdata
        module = self._owner(record, key)
        if module is None or storage.nbytes() == 0:
            return ("kept", outer[1] if outer else None, outer[0](t) if outer else t)
        ref, entry = record.entries.get(key, (None, None))
        if ref is None or ref.expired():
            entry = self._copy_out(module, t)
            # the dead storage's entry stays (its handles still point at it) under a new key
            if ref is not None:
                record.entries[object()] = record.entries[key]
            record.entries[key] = (StorageWeakRef(storage), entry)
            self.ledger.add(entry.nbytes)
        return _Packed(record, entry, t)

    def _unpack(self, packed):
        if isinstance(packed, tuple):
            _, unpack, inner = packed
            return unpack(inner) if unpack else inner
        record = packed.record
        self._reload(record)
        prev = None if record.prev is None else record.prev()
        if prev is not None:  # its backward comes next: start its copies now
            self._reload(prev)
        loaded = packed.entry.loaded
        if record.ready is not None:
            torch.cuda.current_stream(loaded.device).wait_event(record.ready)
        return torch.empty(0, dtype=packed.dtype, device=loaded.device).set_(
            loaded.untyped_storage(), packed.offset, packed.size, packed.stride)

    # ------------------------------------------------------------------ copies
    def _side(self, device: torch.device) -> torch.cuda.Stream:
        """The copies' side stream on ``device`` (the tensor's, which need not be the current
        device)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _copy_out(self, module: str, t: torch.Tensor) -> _Entry:
        storage = t.untyped_storage()
        # [nbytes], the whole storage
        source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        cuda = t.device.type == "cuda"
        entry = _Entry(
            module, self.pool.take(storage.nbytes(), pin=cuda), t.device, t.shape, t.dtype
        )
        if not cuda:
            entry.host.copy_(source)
            return entry
        side = self._side(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # the producer has written it
        with torch.cuda.device(t.device), torch.cuda.stream(side):
            entry.host.copy_(source, non_blocking=True)
        source.record_stream(side)  # its memory is not reused before the copy has read it
        return entry

    def _reload(self, record: _LayerRecord) -> None:
        """Bring ``record``'s storages back to the device (once); on CUDA on the side stream,
        ``ready`` when done."""
        if record.reloaded:
            return
        record.reloaded = True
        entries = [e for _, e in record.entries.values()]
        self.ledger.add(-sum(e.nbytes for e in entries))
        if not entries:
            return
        if entries[0].device.type != "cuda":
            for e in entries:
                # a real copy: the buffer goes back to the pool
                e.loaded = e.host.to(e.device, copy=True)
                self.pool.give(e.host)
            return
        for e in entries:  # allocated on the compute stream, which frees them after their backward
            e.loaded = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
        device = entries[0].device
        side = self._side(device)
        # the fresh blocks' earlier users are done
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(side):
            for e in entries:
                e.loaded.copy_(e.host, non_blocking=True)
                # the next copy into it is queued on this stream after this one
                self.pool.give(e.host)
            record.ready = torch.cuda.Event()
            record.ready.record(side)


class _Scope:
    def __init__(self, offloader: Offloader, module: str, run):
        self.offloader, self.module, self.run = offloader, module, run

    @torch.compiler.disable(recursive=False)
    def __call__(self, *args):
        with self.offloader.running(self.module):
            return self.run(*args)


class _Sparing:
    def __init__(self, offloader: Offloader, consumer):
        self.offloader, self.consumer = offloader, consumer

    @torch.compiler.disable(recursive=False)
    def __call__(self, y):
        with self.offloader.spared(y):
            return self.consumer(y)


class _Layer:
    def __init__(self, offloader: Offloader, block, first: bool, modules: list):
        self.offloader, self.block, self.first, self.modules = offloader, block, first, modules

    @torch.compiler.disable(recursive=False)
    def __call__(self, x):
        return self.offloader.run_layer(self.block, self.first, self.modules, x)
