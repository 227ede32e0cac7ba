"""Look up a value, then answer: a two-step environment written to forge's Environment protocol.

The prompt "12+c=" names a number and a variable whose value (a digit) is hidden. The model asks for it ("c?"),
reads the reply ("7;"), and answers the sum ("19"); only that answer scores.
"""

import random

from rl.environments.protocol import StepResult

NAMES = "abcd"


class LookupEnv:
    stop_texts = ("?",)  # a model turn ends after "?" (one token), so a lookup is a turn of its own

    def __init__(self, digits: int = 2) -> None:  # task.options are these keyword arguments
        self.digits = digits
        self.values: dict[str, int] = {}
        self.answer = ""

    async def reset(self, problem) -> str:
        """A new episode, drawn from problem.seed: returns the first prompt."""
        rng = random.Random(problem.seed)
        self.values = {name: rng.randint(0, 9) for name in NAMES}
        name, number = rng.choice(NAMES), rng.randint(0, 10**self.digits - 1)
        self.answer = str(number + self.values[name])
        return f"{number}+{name}="

    async def step(self, action: str) -> StepResult:
        """The model's turn, as text: a lookup ("c?") gets the value; anything else is the answer."""
        text = action.strip()
        if len(text) == 2 and text[0] in self.values and text[1] == "?":
            return StepResult(observation=f"{self.values[text[0]]};")
        return StepResult(observation="", reward=float(text == self.answer), done=True)
