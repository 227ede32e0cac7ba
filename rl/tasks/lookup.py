"""Lookup-and-add, a multi-turn task that cannot be solved without its environment.

The prompt names a number and a variable whose value, a digit, is hidden ("12+c="). The model must ask the
environment for the variable with a tool call ("c?"), read the reply ("7;"), then answer the sum ("91":
least-significant digit first with `reverse_answer`, as in the arithmetic task) and end with EOS:

    12+c= | c? | 7; | 91<eos>         prompt | model turn | environment | model turn

Every problem draws fresh hidden values, so an answer given without asking is right 1 time in 10 at best. (Hidden
values of two digits make the same task; the tiny model's warm start then takes about twice as long.)
Asking for a variable that is not in the prompt is allowed (the environment answers); only the final answer
scores. The held-out problems are fixed by `seed`; training problems that coincide with one (same number,
value; any variable) are rejected, so the held-out score measures generalisation to sums never trained.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from rl.environments.protocol import StepResult
from rl.tiny_model import EOS_TOKEN

NAMES = "abcd"  # the variables of every problem
QUERY = "?"  # ends a tool call: "c?"
REPLY_END = ";"  # ends the environment's reply: "7;"


class LookupProblem(NamedTuple):
    prompt: str  # "12+c="
    answer: str  # the sum, as the model must write it
    values: tuple[int, ...]  # the hidden value of each of NAMES


class LookupTask:
    """Args: seed (fixes the held-out set), held_out (its size), num_digits (the visible operand is drawn from
    [0, 10**num_digits)), reverse_answer, tokenizer (the model's: the query character must be one token, which
    ends a model turn)."""

    def __init__(self, *, seed: int, held_out: int, tokenizer, num_digits: int = 2, reverse_answer: bool = True,
                 eos_text: str = EOS_TOKEN) -> None:
        if num_digits < 1:
            raise ValueError(f"task.num_digits={num_digits}: must be >= 1")
        query = tokenizer.encode(QUERY, add_special_tokens=False)
        if len(query) != 1:
            raise ValueError(f"task.name='lookup': the model's tokenizer encodes {QUERY!r} as {query}; the task needs "
                             "it to be one token (it ends a tool call)")
        self.stop_token_ids = tuple(query)
        most = self.max_held_out(num_digits)
        if not 1 <= held_out <= most:
            raise ValueError(f"task.held_out={held_out}: must be in [1, {most}] for the lookup task with "
                             f"num_digits={num_digits} (half of its {2 * most} number-and-value pairs)")
        self.num_digits, self.reverse_answer, self.eos_text = num_digits, reverse_answer, eos_text
        rng = random.Random(seed)
        held: dict[tuple[int, int], LookupProblem] = {}
        while len(held) < held_out:
            problem = self._draw(rng)
            held.setdefault(self._key(problem), problem)
        self._held_out = list(held.values())
        self._held_out_keys = set(held)

    @staticmethod
    def max_held_out(num_digits: int) -> int:
        """Half of the (visible number, hidden digit) pairs, which decide an answer."""
        return 10**num_digits * 10 // 2

    def _draw(self, rng: random.Random) -> LookupProblem:
        high = 10**self.num_digits - 1
        a, name = rng.randint(0, high), rng.choice(NAMES)
        values = tuple(rng.randint(0, 9) for _ in NAMES)
        total = str(a + values[NAMES.index(name)])
        return LookupProblem(prompt=f"{a}+{name}=", answer=total[::-1] if self.reverse_answer else total,
                             values=values)

    @staticmethod
    def _key(problem: LookupProblem) -> tuple[int, int]:
        """What decides the answer: the visible number and the value of the variable the prompt names (the name
        itself does not: a held-out pair is never trained under any name)."""
        return int(problem.prompt.split("+")[0]), problem.values[NAMES.index(problem.prompt[-2])]

    def sample_prompts(self, n: int, rng: random.Random) -> list[LookupProblem]:
        problems = []
        while len(problems) < n:
            problem = self._draw(rng)
            if self._key(problem) not in self._held_out_keys:
                problems.append(problem)
        return problems

    def held_out(self) -> list[LookupProblem]:
        return list(self._held_out)

    def environment(self) -> LookupEnvironment:
        return LookupEnvironment(self.reward)

    def reward(self, completion_text: str, answer: str) -> float:
        """1.0 if the final turn, cut at EOS and stripped, is exactly the answer."""
        return float(completion_text.split(self.eos_text, 1)[0].strip() == answer)

    def transcript(self, problem: LookupProblem) -> list[tuple[str, bool]]:
        """A correct episode as (text, written by the model) segments, for a supervised warm start; the last model
        segment is followed by EOS."""
        name = problem.prompt[-2]
        return [(problem.prompt, False), (name + QUERY, True), (reply(problem, name), False), (problem.answer, True)]


def reply(problem: LookupProblem, name: str) -> str:
    return f"{problem.values[NAMES.index(name)]}{REPLY_END}"


class LookupEnvironment:
    """One episode: answers "x?" with x's hidden value; any other turn is the final answer, scored by `reward`."""

    def __init__(self, reward) -> None:
        self.reward = reward
        self.problem: LookupProblem | None = None

    async def reset(self, problem: LookupProblem) -> str:
        self.problem = problem
        return problem.prompt

    async def step(self, action: str) -> StepResult:
        text = action.strip()
        if len(text) == 2 and text[0] in NAMES and text[1] == QUERY:
            return StepResult(observation=reply(self.problem, text[0]), info={"asked": text[0]})
        return StepResult(observation="", reward=self.reward(text, self.problem.answer), done=True)
