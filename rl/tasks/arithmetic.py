"""Integer arithmetic ("12+34=" -> "46"): a task whose reward is checked exactly, with no model judge.

With `reverse_answer` the answer is written least-significant digit first ("12+34=" -> "64"), the order in
which a left-to-right model can compute it: each output digit then depends only on operand digits and the
carry from the digit just written. Small transformers learn this format far faster and more reliably.

Problems are drawn from a seeded generator. A fixed held-out set is drawn first; training problems are
drawn from the same distribution with the held-out ones rejected, so the two sets never overlap and a
held-out score measures generalisation, not memorisation.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from rl.tiny_model import EOS_TOKEN

OPERATORS = ("+", "-")


class Problem(NamedTuple):
    prompt: str  # e.g. "12+34="
    answer: str  # e.g. "46"


class ArithmeticTask:
    """Sums (and differences) of non-negative integers with up to `num_digits` digits.

    Args:
        seed: fixes the held-out set.
        num_digits: operands are drawn uniformly from [0, 10**num_digits).
        held_out: size of the held-out evaluation set.
        operators: a non-empty subset of ("+", "-").
        eos_text: the tokenizer's end-of-sequence text; `reward` ignores everything from it on.
        reverse_answer: write the answer's digits least-significant first (a minus sign stays in front).
    """

    stop_token_ids: tuple[int, ...] = ()  # no chat template: answers end at EOS, where the engines stop anyway

    def __init__(
        self,
        seed: int,
        num_digits: int = 2,
        held_out: int = 500,
        operators: tuple[str, ...] = ("+",),
        eos_text: str = EOS_TOKEN,
        reverse_answer: bool = False,
    ) -> None:
        if num_digits < 1:
            raise ValueError(f"ArithmeticTask.num_digits={num_digits}: must be >= 1")
        if not operators or any(op not in OPERATORS for op in operators):
            raise ValueError(f"ArithmeticTask.operators={operators!r}: must be a non-empty subset of {OPERATORS}")
        most = self.max_held_out(num_digits, len(operators))
        if not 1 <= held_out <= most:
            raise ValueError(
                f"ArithmeticTask.held_out={held_out}: must be in [1, {most}] "
                f"(half of the {2 * most} problems with num_digits={num_digits})"
            )
        self.seed = seed
        self.num_digits = num_digits
        self.operators = tuple(operators)
        self.eos_text = eos_text
        self.reverse_answer = reverse_answer
        rng = random.Random(seed)
        held: dict[Problem, None] = {}  # insertion-ordered set: a deterministic order
        while len(held) < held_out:
            held[self._draw(rng)] = None
        self._held_out = list(held)
        self._held_out_set = set(held)

    @staticmethod
    def max_held_out(num_digits: int, num_operators: int = 1) -> int:
        """At most half the problems are held out, so rejection sampling of training problems stays cheap."""
        return num_operators * 10 ** (2 * num_digits) // 2

    def _draw(self, rng: random.Random) -> Problem:
        high = 10**self.num_digits - 1
        a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(self.operators)
        value = a + b if op == "+" else a - b
        digits = str(abs(value))[::-1] if self.reverse_answer else str(abs(value))
        return Problem(prompt=f"{a}{op}{b}=", answer=("-" if value < 0 else "") + digits)

    def sample_prompts(self, n: int, rng: random.Random) -> list[Problem]:
        """`n` training problems (never held-out ones); repeats are possible, as in any sampled dataset."""
        problems = []
        while len(problems) < n:
            problem = self._draw(rng)
            if problem not in self._held_out_set:
                problems.append(problem)
        return problems

    def held_out(self) -> list[Problem]:
        """The fixed evaluation set, in a deterministic order."""
        return list(self._held_out)

    def reward(self, completion_text: str, answer: str) -> float:
        """1.0 if the completion, cut at EOS and whitespace-stripped, is exactly the answer, else 0.0."""
        return float(completion_text.split(self.eos_text, 1)[0].strip() == answer)
