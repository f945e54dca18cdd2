"""The saved-activation meter: the bytes autograd keeps for backward, measured -- one meter and one
rule for what it counts, used by ``seqpar memory --measure`` (one layer's forward,
``saved.measure_layer``; a rank's peak over a pipeline step, ``stages``/``activations``), the
trainer's start record and the benchmarks.

What counts:

* a **storage**, not a tensor: views and reshapes of one storage (Q, K, V of one QKV output; a
  linear's input reshaped to 2-D) count once; a DTensor counts by its local tensor's storage;
* storages are told apart by identity (``_cdata``: ``seqpar.storages``, offloading's rule too), not
  address, and each is held until the forward that saved it ends, so an address released and reused
  inside a forward is not taken for the earlier storage;
* its size is read when that forward ends: a storage released after it was saved (a recomputed norm
  output, resized to 0) counts 0;
* **parameters and buffers** of the metered modules never count, FSDP's gathered parameters included
  (``parameter_storages``), nor tensors ``exclude``\\ d (data: tokens, labels, packed documents'
  masks);
* only forward-time saves count, and what the caller adds (``keep``: a stage output the schedule
  holds, the inputs a non-reentrant checkpoint keeps alive outside autograd's saved tensors): the
  transient working set a recomputation rebuilds during a backward is not an activation held across
  the schedule (the paper's Eq. 5/6 leave it out, and it is the same for any number of microbatches
  in flight).

One forward: ``with meter:`` then ``total_bytes`` and ``tensors`` (each storage with the innermost
module that saved it). A pipeline step: ``meter.forward()`` per chunk-microbatch and ``hold`` per
kept output; a storage stops counting once freed, and since memory grows only during forwards and
holds, ``peak_bytes`` read there is the exact peak.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.multiprocessing.reductions import StorageWeakRef

from seqpar.storages import module_storages, storage_key, storage_of


@dataclass
class SavedTensor:
    name: str  # the innermost module running when autograd saved it
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # bytes of the whole storage it keeps alive

    def as_dict(self) -> dict:
        return asdict(self)


def parameter_storages(modules) -> set[int]:
    """The storages (``storages.storage_key``) of ``modules``' parameters and buffers, FSDP's
    gathered parameters included (each unit gathered once to find them; FSDP reuses their storages
    for every gather)."""
    keys: set[int] = set()
    for module in modules:
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        keys |= module_storages([module])
        for unit in units:
            unit.reshard()
        keys |= module_storages([module])
    return keys


class SavedTensorMeter:
    """Saved-activation bytes of ``modules`` on this rank (module doc): what one forward saved, and
    the live bytes and their peak over a schedule. ``names``: record the innermost module that saved
    each storage."""

    def __init__(self, *modules: nn.Module, names: bool = True):
        self.tensors: list[SavedTensor] = []  # every storage counted, in the order saved
        self.current_bytes = self.peak_bytes = 0
        self._exclude = parameter_storages(modules)
        # held until the forward ends
        self._pending: dict[int, tuple[torch.UntypedStorage, SavedTensor]] = {}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._stack: list[str] = []
        self._handles = [h for m in modules if names for name, sub in m.named_modules()
                         for h in (sub.register_forward_pre_hook(self._push(name or "<root>")),
                                   sub.register_forward_hook(self._pop))]

    @property
    def total_bytes(self) -> int:
        """Bytes of every storage counted (one forward: what it saved)."""
        return sum(t.bytes for t in self.tensors)

    def exclude(self, tensors) -> None:
        """Never count these tensors' storages (data, not activations)."""
        self._exclude.update(storage_key(t) for t in tensors)

    def keep(self, t: torch.Tensor):
        """Count ``t``'s storage as saved by the running forward (autograd's hook, and callers')."""
        storage = storage_of(t)
        key = storage._cdata
        if key not in self._exclude and key not in self._pending and storage.nbytes() > 0:
            where = self._stack[-1] if self._stack else "<outside>"
            self._pending[key] = (
                storage,
                SavedTensor(where, tuple(t.shape), str(t.dtype).removeprefix("torch."), 0),
            )
        return t

    def hold(self, t: torch.Tensor) -> None:
        """The schedule keeps ``t`` (a stage output) until its backward: count it while it lives."""
        self.keep(t)
        self._settle()

    @contextlib.contextmanager
    def forward(self):
        """Count what autograd saves inside this block (one chunk-microbatch forward)."""
        with torch.autograd.graph.saved_tensors_hooks(self.keep, lambda t: t):
            yield
        self._settle()

    @contextlib.contextmanager
    def scope(self, name: str):
        """Name what is saved inside this block ``name`` (where no module of its own saves it: a
        full-recompute group's input, saved by its checkpoint in the stage's forward); modules
        inside still name their own."""
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def live_bytes(self) -> int:
        """Bytes counted and still alive."""
        self._prune()
        return self.current_bytes

    def __enter__(self):
        self._forward = self.forward()
        self._forward.__enter__()
        return self

    def __exit__(self, *exc):
        self._forward.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _push(self, name):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _pop(self, module, args, output):
        if self._stack:
            self._stack.pop()

    def _prune(self) -> None:
        """Forget the storages freed since (after their backward)."""
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current_bytes -= self._live.pop(key)[1]

    def _settle(self) -> None:
        """Count what the last forward saved, at the size its storage has now that the forward is
        over."""
        self._prune()  # a freed storage's identity may be reused: forget the dead ones first
        for key, (storage, record) in self._pending.items():
            record.bytes = storage.nbytes()
            if key in self._live or record.bytes == 0:
                continue
            self._live[key] = (StorageWeakRef(storage), record.bytes)
            self.current_bytes += record.bytes
            self.tensors.append(record)
        self._pending.clear()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
