"""Verifiable tasks: prompts with answers that a reward function checks exactly."""

from forge.tasks.arithmetic import ArithmeticTask, Problem

__all__ = ["ArithmeticTask", "Problem"]
