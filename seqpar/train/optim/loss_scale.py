"""Dynamic loss scaling for fp16 training, with ``torch.amp.GradScaler``'s semantics.

fp16 has 5 exponent bits: small gradients flush to zero (at h=256 about 2% of them). The loss is
multiplied by ``scale`` before backward; the fp32 main gradients are divided by it after the
cross-rank reductions. A step whose gradients overflow (non-finite global norm) is skipped and the
scale halves; after ``window`` good steps in a row it doubles.

Why not ``GradScaler`` itself: it checks for inf/NaN in each rank's own gradients, so under tensor
or pipeline parallelism one rank could step while another skips. Here the overflow test is the
global gradient norm, which every rank of every group computes to the same value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DynamicLossScaler:
    scale: float = 65536.0
    window: int = 2000  # good steps in a row before growing
    growth: float = 2.0
    backoff: float = 0.5
    # below this an overflow is a real non-finite gradient, not a scale too high
    min_scale: float = 1.0
    good_steps: int = 0

    def update(self, finite: bool) -> bool:
        """Record one step's outcome; returns False when an overflow cannot be cured by a lower
        scale."""
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= self.growth
                self.good_steps = 0
            return True
        self.good_steps = 0
        if self.scale * self.backoff < self.min_scale:
            return False
        self.scale *= self.backoff
        return True

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, type(getattr(self, key))(value))
