"""Plain-text tables for the analysis reports (no dependencies)."""

from __future__ import annotations

GB = 1e9  # reports use decimal GB (an "80 GB" A100 holds 80 GiB, so this errs on the safe side)


def gb(nbytes: float, digits: int = 1) -> str:
    return f"{nbytes / GB:.{digits}f}"


def pct_change(ratio: float, digits: int = 1) -> str:
    """``ratio`` - 1 as a signed percentage (``+3.2%``, ``-1.5%``); ``±0.0%`` when it rounds to zero, never
    ``-0.0%``."""
    value = round(100 * (ratio - 1), digits)
    return f"±{0:.{digits}f}%" if value == 0 else f"{value:+.{digits}f}%"


def table(headers: list[str], rows: list[list], left: tuple[int, ...] = (0,)) -> str:
    """Columns padded to their widest cell; columns in ``left`` left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
