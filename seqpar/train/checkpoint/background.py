"""``--async-save``: a checkpoint written in a background thread from a CPU copy of this rank's
shards.

Training stalls only for the copy (``stage``: every shard out of the device into CPU buffers kept
from save to save);
the thread then runs the same atomic, checksummed ``store.save`` as a synchronous save, its
collectives on a gloo group of their own (``seqpar.parallel.comm.side_group``) so they never
interleave with the step's. ``latest`` moves only when the checkpoint is whole; a failure or a kill
during the background write leaves the previous checkpoint (and ``latest``) as they were. One save
at a time: the next save, the end of training and an interruption first wait for the last
(``wait``), which raises its error.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import torch

from seqpar.analysis.formulas.memory import pinned_block_bytes
from seqpar.parallel.comm import side_group
from seqpar.train.checkpoint.store import save


def stage(tensors: dict, buffers: dict[str, torch.Tensor]) -> dict:
    """A copy of ``tensors`` (shard views or tensors) in CPU memory that training no longer touches,
    made in ``buffers`` (key -> CPU tensor, kept from the last save: no fresh pages to fault in;
    pinned for a device's copy), which this fills where a key is new or its shape changed."""
    def into(key: str, local: torch.Tensor) -> torch.Tensor:
        held = buffers.get(key)
        if held is None or held.shape != local.shape or held.dtype != local.dtype:
            held = buffers[key] = torch.empty(
                local.shape, dtype=local.dtype, pin_memory=local.device.type == "cuda"
            )
        return held.copy_(local.detach(), non_blocking=local.device.type == "cuda")

    def copied(key: str, value):
        if isinstance(value, torch.Tensor):
            return into(key, value)
        view = copy.copy(value)  # the same chunks and offsets, a copy of the local data
        view.local = into(key, value.local)
        return view

    staged = {key: copied(key, value) for key, value in tensors.items()}
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies out of the device have landed
    return staged


class BackgroundSave:
    """At most one checkpoint in flight; ``start`` it (after the last finished), ``wait`` for it."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group = None
        self._made_group = False
        self._buffers: dict[str, torch.Tensor] = {}  # the staging copies, reused from save to save

    @property
    def pending(self) -> bool:
        return self._thread is not None

    @property
    def host_bytes(self) -> int:
        """Host RAM the staging copies hold between saves: a pinned one as torch's caching host
        allocator reserves it (``seqpar.analysis.formulas.memory.pinned_block_bytes``: a power of
        two, up to 2x its bytes), others exactly."""
        return sum(
            pinned_block_bytes(b.nbytes) if b.is_pinned() else b.nbytes
            for b in self._buffers.values()
        )

    def start(self, root: str | Path, step: int, tensors: dict, meta: dict, keep: int, written=None,
              files: dict[str, Path] | None = None) -> None:
        """Wait for the last save, copy ``tensors`` to the CPU and write them in the background
        (every rank calls this at the same step)."""
        self.wait()
        if not self._made_group:
            self._group, self._made_group = side_group(), True
        staged, meta = stage(tensors, self._buffers), copy.deepcopy(meta)
        self._thread = threading.Thread(
            target=self._write,
            args=(root, step, staged, meta, keep, written, files),
            name=f"seqpar-save-step-{step}",
            daemon=True,
        )
        self._thread.start()

    def _write(self, root, step, staged, meta, keep, written, files) -> None:
        try:
            save(root, step, staged, meta, keep, written=written, files=files, group=self._group)
        except BaseException as err:  # raised in the training thread by the next wait()
            self._error = err

    def wait(self) -> None:
        """Until the save in flight (if any) is committed; its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
