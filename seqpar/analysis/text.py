"""Plain-text tables for the analysis reports (no dependencies)."""

from __future__ import annotations

GB = 1e9  # the paper's tables (`seqpar paper`) print decimal GB, as the paper does
# every other memory report (plan, train --dry-run, memory): binary units, ``human_bytes``
GiB = 2**30


def gb(nbytes: float, digits: int = 1) -> str:
    return f"{nbytes / GB:.{digits}f}"


def gib(nbytes: float, digits: int = 2) -> str:
    """``nbytes`` in GiB, for a table column headed "GiB"."""
    return f"{nbytes / GiB:.{digits}f}"


def human_bytes(nbytes: float) -> str:
    """``nbytes`` in one binary unit, the same in every memory report: ``1,000 B``, ``1.50 KiB``,
    ``2.00 MiB``, ``59.96 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:,.0f} B" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    return f"{value:,.2f} GiB"


def exact_bytes(nbytes: float) -> str:
    """``nbytes`` exactly, then in ``human_bytes``: ``64,375,809,536 B (59.96 GiB)``; the form every
    report gives a rank's total in."""
    return f"{nbytes:,.0f} B" if abs(nbytes) < 1024 else f"{nbytes:,.0f} B ({human_bytes(nbytes)})"


def pct_change(ratio: float, digits: int = 1) -> str:
    """``ratio`` - 1 as a signed percentage (``+3.2%``, ``-1.5%``); ``±0.0%`` when it rounds to
    zero, never ``-0.0%``."""
    value = round(100 * (ratio - 1), digits)
    return f"±{0:.{digits}f}%" if value == 0 else f"{value:+.{digits}f}%"


def table(headers: list[str], rows: list[list], left: tuple[int, ...] = (0,)) -> str:
    """Columns padded to their widest cell; columns in ``left`` left-aligned, the rest
    right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
