"""A distillation run that is not learning from its teacher says so in its output: the reverse KL to the teacher
(the loss's `reverse_kl` metric) must fall; when it has not after `teacher.kl_check_steps` steps, a warning line names
it, not only the metrics file."""

from __future__ import annotations

import sys
from typing import TextIO

WINDOW = 5  # steps averaged at each end: one step's k1 estimate is noisy
MIN_DROP = 0.1  # the later mean must be at least this fraction under the first one
FLOOR = 0.05  # nats per token: a reverse KL this small has nothing left to fall (a student already at its teacher)


class ReverseKLWatch:
    """Feed it each step's `reverse_kl`; at every multiple of `check_steps` it compares the mean of the last WINDOW
    steps with the mean of the first WINDOW and prints a warning when the KL has not fallen by MIN_DROP of it."""

    def __init__(self, check_steps: int, out: TextIO | None = None) -> None:
        self.check_steps, self.out = check_steps, out
        self.values: list[float] = []
        self.warnings: list[str] = []

    def step(self, step: int, reverse_kl: float | None) -> str | None:
        """Record step `step`'s reverse KL (None: the step logged none); the warning printed, if any."""
        if reverse_kl is None or not self.check_steps:
            return None
        self.values.append(float(reverse_kl))
        if step % self.check_steps or len(self.values) < 2 * WINDOW:
            return None
        first = sum(self.values[:WINDOW]) / WINDOW
        last = sum(self.values[-WINDOW:]) / WINDOW
        if last < first * (1 - MIN_DROP) or last < FLOOR:
            return None
        warning = (f"warning: reverse_kl has not fallen after {step} steps (mean of the first {WINDOW} steps "
                   f"{first:.3g}, of the last {WINDOW} {last:.3g} nats per token): the student is not learning "
                   "from its teacher; check that the teacher is the intended checkpoint, scored at the student's "
                   "temperature, and trainer.lr (docs/distillation.md)")
        self.warnings.append(warning)
        print(warning, file=self.out or sys.stderr, flush=True)
        return warning
