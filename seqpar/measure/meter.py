"""Peak activation bytes held by one rank over a whole pipeline step (Sec. 4.2.3, 4.3, App. B).

Unlike ``seqpar.measure.saved.SavedTensorMeter`` (what ONE forward saves), this tracks what is
LIVE over time: a storage is counted when autograd saves it during a forward step (or when the
schedule keeps a stage output for its backward, ``hold``) and stops counting when the storage is
freed -- after its backward, or when App. B frees a sent output. Storages are de-duplicated (Q, K, V
are views of one QKV output; a linear keeps its input reshaped) and parameters are excluded.
Sizes are read when each forward ends. Memory grows only during forwards and holds, so checking
the total there gives the exact peak.

Only forward-time saves count: the transient working set that recomputation rebuilds during a
backward is not an activation held across the schedule (it is the same for any number of
microbatches in flight) and is left out, as the paper's Eq. 5/6 leave it out.
"""

from __future__ import annotations

import contextlib

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from seqpar.parallel.fsdp import parameter_storages


class ScheduleMeter:
    """Live saved-activation bytes of this rank, and their peak."""

    def __init__(self, modules, detail: bool = False):
        self.detail = detail  # keep (shape, dtype, bytes) of what is live at the peak
        self.peak_tensors: list[tuple[tuple[int, ...], str, int]] = []
        self._exclude: set[int] = set()  # storage addresses
        self._exclude_storages = parameter_storages(modules)  # storage identities (FSDP's gathers move)
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._what: dict[int, tuple[tuple[int, ...], str, int]] = {}
        self._pending: dict[int, tuple[torch.UntypedStorage, tuple[int, ...], str]] = {}
        self.peak_bytes = 0
        self.current_bytes = 0

    def exclude(self, tensors) -> None:
        """Never count these tensors' storages (e.g. the input tokens: data, not activations)."""
        self._exclude.update(t.untyped_storage().data_ptr() for t in tensors)

    def _prune(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current_bytes -= self._live.pop(key)[1]
            self._what.pop(key, None)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        # The storage object's identity, not its address: a storage released during the forward (a
        # recomputed norm output, resized to 0) frees its address for a later tensor of the same forward,
        # which an address key would take for the released one and skip. Holding the storage in _pending
        # keeps the identity unique until the forward ends; _prune drops dead ones before reuse.
        key = storage._cdata
        if (storage.data_ptr() not in self._exclude and key not in self._exclude_storages and storage.nbytes() > 0
                and key not in self._pending):
            self._pending[key] = (storage, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return t

    def _settle(self) -> None:
        """Count what the last forward saved, at the size its storage has now that the forward is over
        (a storage the model released after saving it -- a recomputed norm output -- counts 0)."""
        self._prune()  # a freed storage's address may be reused: forget the dead ones first
        for key, (storage, shape, dtype) in self._pending.items():
            nbytes = storage.nbytes()
            if key in self._live or nbytes == 0:
                continue
            self._live[key] = (StorageWeakRef(storage), nbytes)
            self.current_bytes += nbytes
            if self.detail:
                self._what[key] = (shape, dtype, nbytes)
        self._pending.clear()
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            if self.detail:
                self.peak_tensors = [self._what[k] for k in self._live]

    def hold(self, t: torch.Tensor) -> None:
        """The schedule keeps ``t`` (a stage output) until its backward: count it while it lives."""
        self._pack(t)
        self._settle()

    @contextlib.contextmanager
    def forward(self):
        """Count what autograd saves inside this block (one chunk-microbatch forward). Memory only
        grows during a forward, so reading the total when it ends gives the exact peak."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield
        self._settle()

    def live_bytes(self) -> int:
        self._prune()
        return self.current_bytes
