"""Levenberg-Marquardt least squares for the handful of cost-model parameters (plain Python).

The analysis package runs without torch or numpy (``seqpar plan`` on a laptop), and the problems are
tiny (6 parameters, about 20 residuals), so the normal equations are solved by Gaussian elimination.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gaussian elimination, partial pivoting); a is small and positive definite."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            raise ZeroDivisionError("singular normal equations")
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def least_squares(residuals: Callable[[Sequence[float]], list[float]], x0: Sequence[float],
                  max_iter: int = 200, step: float = 1e-6) -> tuple[list[float], float]:
    """Minimise sum(residuals(x)^2) from ``x0``; returns (x, cost). Forward-difference Jacobian."""
    x = list(x0)
    r = residuals(x)
    cost = sum(v * v for v in r)
    damping = 1e-3
    for _ in range(max_iter):
        cols = []
        for j in range(len(x)):
            shifted = x[:]
            shifted[j] += step
            cols.append([(a - b) / step for a, b in zip(residuals(shifted), r, strict=True)])
        jtj = [
            [sum(ci * cj for ci, cj in zip(cols[i], cols[j], strict=True)) for j in range(len(x))]
            for i in range(len(x))
        ]
        jtr = [sum(c * v for c, v in zip(cols[i], r, strict=True)) for i in range(len(x))]
        improved = False
        while damping < 1e12:
            a = [
                [
                    jtj[i][j] + (damping * (jtj[i][i] + 1e-12) if i == j else 0.0)
                    for j in range(len(x))
                ]
                for i in range(len(x))
            ]
            dx = _solve(a, [-g for g in jtr])
            trial = [xi + d for xi, d in zip(x, dx, strict=True)]
            r_trial = residuals(trial)
            cost_trial = sum(v * v for v in r_trial)
            if math.isfinite(cost_trial) and cost_trial < cost:
                done = cost - cost_trial < 1e-12 * max(cost, 1e-30)
                x, r, cost, damping, improved = (
                    trial,
                    r_trial,
                    cost_trial,
                    max(damping / 3, 1e-9),
                    True,
                )
                break
            damping *= 4
        if not improved or done:
            break
    return x, cost
