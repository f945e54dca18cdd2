"""Host-device synchronisations of a region of code, counted where they are written (issue 53).

On an accelerator three kinds of call stall the host until the device's stream has caught up, or
copy through pageable memory while the host waits:

* ``copy``: a tensor built from Python data on the device (``torch.tensor(3, device=x.device)``,
  ``torch.as_tensor``, ``x.new_tensor``): a blocking host-to-device copy.
  ``torch.full((), 3, device=...)`` is a fill kernel instead, and no copy.
* ``read``: a device tensor's value read on the host: ``item``, ``tolist``,
  ``bool``/``int``/``float``/ ``__index__``/``__format__`` (``if t:``, ``range(t)``, ``f"{t}"``,
  ``math.isfinite(t)``), ``cpu``, ``numpy``, ``to("cpu")``.
* ``shape``: an operator whose output size depends on the values (``nonzero``, ``masked_select``,
  boolean indexing, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``): its
  CUDA kernel reads the size back before it can allocate.

``SyncCounter`` replaces these functions and methods (``torch.tensor``, ``torch.Tensor.item``, ...)
with counting wrappers for the length of a ``with`` block, in every thread, and records for each
call the innermost frame inside seqpar (``path:line function``). Not a
``torch.overrides.TorchFunctionMode``, although every one of them goes through
``__torch_function__`` on torch 2.13: a mode is thread-local state that autograd does not carry into
``backward`` (a custom ``Function``'s backward, recomputation and the grouped GEMMs' gradients run
with no mode; on CUDA in another thread), so it would see the forward only (checked in
tests/test_syncs.py).

What it cannot see: a sync inside an operator it does not list (a data-dependent kernel of a library
it calls); a name bound before the block (``from torch import tensor``); code inside a compiled
graph (``torch.compile`` runs its own kernels: count eager steps); and, on the CPU, which tensors
would live on the host in an accelerator run. On the CPU the step's device is the host, so a value
read of the data pipeline's tensors (host data on an accelerator, no sync there) is counted too:
such sites are named in the caller's allow-list. A construction with no explicit device is not
counted: it lands on the CPU in an accelerator run, which is a placement question
(``DevicelessFactories``), not a copy.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
from dataclasses import dataclass

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../seqpar
_ROOT = os.path.dirname(_PACKAGE)
_THIS = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))

# (owner, attribute name, kind): every callable the counter wraps
COPIES = [(torch, "tensor"), (torch, "as_tensor"), (torch.Tensor, "new_tensor")]
READS = [
    (torch.Tensor, n)
    for n in (
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__format__",
        "cpu",
        "numpy",
        "to",
    )
]
SHAPES = [
    (torch, n)
    for n in (
        "nonzero",
        "masked_select",
        "unique",
        "unique_consecutive",
        "bincount",
        "argwhere",
        "repeat_interleave",
        "where",
    )
]
SHAPES += [
    (torch.Tensor, n)
    for n in (
        "nonzero",
        "masked_select",
        "unique",
        "bincount",
        "repeat_interleave",
        "__getitem__",
        "__setitem__",
        "index_put_",
    )
]


@dataclass(frozen=True)
class Sync:
    """One call that synchronises host and device: its kind, the operator and where seqpar called
    it."""

    kind: str  # copy | read | shape
    op: str
    site: str  # "seqpar/parallel/rng.py:104 prefix_bits"
    caller: str = ""  # the innermost frame: the site itself, or inside a library seqpar called

    @property
    def where(self) -> str:
        """``path function``: the site without its line (what an allow-list names)."""
        return _where(self.site)

    @property
    def inner(self) -> str:
        """``path function`` of the innermost caller (a library's function, when seqpar called
        it)."""
        return _where(self.caller or self.site)


def _where(site: str) -> str:
    path, fn = site.split(" ", 1)
    return f"{path.rsplit(':', 1)[0]} {fn}"


def _frame(frame) -> str:
    """``path:line function``, the path relative to seqpar's root, or to torch's for torch's own
    files."""
    path = os.path.abspath(frame.f_code.co_filename)
    # first: torch may sit inside the checkout (make test's .venv)
    if path.startswith(_TORCH + os.sep):
        path = os.path.relpath(path, os.path.dirname(_TORCH))
    elif path.startswith(_ROOT + os.sep):
        path = os.path.relpath(path, _ROOT)
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


def _caller() -> str:
    """The innermost frame outside this module (inside torch, for a call torch makes)."""
    return _frame(sys._getframe(2))


def _site() -> str:
    """The innermost frame inside the seqpar package (else the innermost outside torch), as
    ``path:line fn``."""
    frame, fallback = sys._getframe(2), None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS and path.startswith(_PACKAGE + os.sep):
            return f"{os.path.relpath(path, _ROOT)}:{frame.f_lineno} {frame.f_code.co_name}"
        if fallback is None and path != _THIS and f"{os.sep}torch{os.sep}" not in path:
            fallback = f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "?"


def _on(t, device: torch.device) -> bool:
    return isinstance(t, torch.Tensor) and t.device == device


def _copy(name: str, args, kwargs, device: torch.device) -> bool:
    """Python data onto ``device`` named explicitly (or ``new_tensor``'s own device)."""
    if name == "new_tensor":
        target, data = (
            kwargs.get("device", args[0].device),
            args[1] if len(args) > 1 else kwargs.get("data"),
        )
    else:
        target, data = kwargs.get("device"), args[0] if args else kwargs.get("data")
    return (
        target is not None and torch.device(target) == device and not isinstance(data, torch.Tensor)
    )


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _shape(name: str, args, kwargs) -> bool:
    if name in ("__getitem__", "__setitem__", "index_put_"):
        return len(args) > 1 and _bool_index(args[1])
    if name == "repeat_interleave":
        # (repeats) alone: its own
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "where":
        return len(args) == 1 and not kwargs
    return True


def _read(name: str, args, kwargs, device: torch.device) -> bool:
    if name != "to":
        return True
    return device.type != "cpu" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))


def kind_of(kind: str, name: str, args, kwargs, device: torch.device) -> bool:
    """Whether the call ``name(*args, **kwargs)`` of group ``kind`` synchronises with ``device``."""
    if kind == "copy":
        return _copy(name, args, kwargs, device)
    if not args or not _on(args[0], device):
        return False
    return _read(name, args, kwargs, device) if kind == "read" else _shape(name, args, kwargs)


class SyncCounter:
    """``with SyncCounter(device) as c: step()`` → ``c.syncs``: every host-device sync of the region
    on ``device``, in any thread (see the module's docstring for what is and is not seen). One at a
    time."""

    def __init__(self, device):
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.accelerator.current_device_index())
        self.device, self.syncs = device, []
        # a wrapped call made by another (Tensor.__format__ → item): not again
        self._inside = threading.local()
        self._saved: list[tuple[object, str, object, bool]] = []

    def _wrap(self, kind: str, owner, name: str):
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if getattr(self._inside, "depth", 0) == 0 and kind_of(
                kind, name, args, kwargs, self.device
            ):
                self.syncs.append(Sync(kind, name, _site(), _caller()))
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        return counted

    def __enter__(self) -> SyncCounter:
        for kind, pairs in (("copy", COPIES), ("read", READS), ("shape", SHAPES)):
            for owner, name in pairs:
                self._saved.append((owner, name, getattr(owner, name), name in vars(owner)))
                setattr(owner, name, self._wrap(kind, owner, name))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original, own in reversed(self._saved):
            if own or owner is torch:
                setattr(owner, name, original)
            # inherited from torch._C.TensorBase: remove the wrapper, the base's method shows again
            else:
                delattr(owner, name)
        self._saved.clear()

    def by_site(self) -> dict[str, int]:
        """``{"kind op at site": count}``, most frequent first."""
        counts = collections.Counter(f"{s.kind} {s.op} at {s.site}" for s in self.syncs)
        return dict(counts.most_common())


def allowed_by(sync: Sync, allowed: dict) -> str | None:
    """The key of ``allowed`` ({``path function``: why it stays}) naming ``sync``'s site or its
    innermost caller."""
    return next((k for k in (sync.where, sync.inner) if k in allowed), None)


def unexpected(syncs: list[Sync], allowed: dict) -> list[Sync]:
    """The syncs no key of ``allowed`` names (``allowed_by``)."""
    return [s for s in syncs if allowed_by(s, allowed) is None]


# -------------------------------------------------------------------------------- the placement net
FACTORIES = (
    "tensor",
    "as_tensor",
    "arange",
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "logspace",
    "eye",
    "empty_strided",
)


def _deviceless(name: str, args, kwargs, path: str) -> bool:
    """A factory call from a seqpar file that names no device (a copy of a tensor keeps the
    tensor's)."""
    if kwargs.get("device") is not None or not path.startswith(_PACKAGE + os.sep) or path == _THIS:
        return False
    return not (name in ("tensor", "as_tensor") and args and isinstance(args[0], torch.Tensor))


class DevicelessFactories:
    """``with DevicelessFactories() as net: step()``: every tensor factory seqpar calls in the block
    without naming a device (``torch.arange(n)``, ``torch.tensor(values)``, ...) is made on ``meta``
    instead of the CPU, and its site recorded in ``net.sites``. On an accelerator such a tensor
    lands on the CPU, and the first operator mixing it with device tensors fails (or a collective
    under NCCL refuses it); on the CPU it would pass silently. On ``meta`` it fails on the CPU as
    well: ``Tensor on device meta is not on the expected device cpu``, a gloo collective on it, a
    copy out of it. (Stricter than CUDA, which takes a 0-dim CPU tensor as a scalar operand.) Calls
    torch makes itself (``torch.optim``'s CPU step counts) are left alone: only a call whose caller
    is a seqpar file is moved. Global while it lasts, in every thread (autograd's backward
    included), as ``SyncCounter``."""

    def __init__(self):
        self.sites: list[str] = []
        self._saved: list[tuple[str, object]] = []

    def _wrap(self, name: str):
        original = getattr(torch, name)

        @functools.wraps(original)
        def placed(*args, **kwargs):
            caller = sys._getframe(1)
            if _deviceless(name, args, kwargs, os.path.abspath(caller.f_code.co_filename)):
                self.sites.append(f"{_frame(caller)} torch.{name}")
                kwargs["device"] = "meta"
                kwargs.pop("pin_memory", None)
            return original(*args, **kwargs)

        return placed

    def __enter__(self) -> DevicelessFactories:
        for name in FACTORIES:
            self._saved.append((name, getattr(torch, name)))
            setattr(torch, name, self._wrap(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in reversed(self._saved):
            setattr(torch, name, original)
        self._saved.clear()
