"""pass@k and mean@k from n samples per problem, with the unbiased estimator (Chen et al. 2021, "Evaluating Large
Language Models Trained on Code", eq. 1), and a task's scores over its problems. Plain Python.

A problem with n samples of which c are correct: pass@k = 1 - C(n-c, k) / C(n, k), the probability that k samples
drawn from the n without replacement hold at least one correct one; the task's pass@k is its mean over problems.
mean@k, the expected mean reward of k such samples, is the mean of all n rewards for every k <= n (each sample is in
the same share of the k-subsets), so one figure, `mean@n`, estimates all of them.

A sample whose generation or reward failed is not scored: it is counted in `failed_samples` and left out, so a
problem keeps its n - failed samples, and a problem with fewer than k left is left out of pass@k (counted in
`problems_scored`). Never scored 0: a failure is not the model's answer.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), as a product (no huge binomials): 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): needs 0 <= c <= n and 1 <= k <= n")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class ProblemResult:
    """One problem's samples: the rewards of those that were scored, and the errors of those that failed."""

    rewards: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per failed sample: "ExceptionType: message"

    def correct(self, correct_at: float) -> int:
        return sum(r >= correct_at for r in self.rewards)


@dataclass
class TaskScore:
    """A task's scores over its problems; `pass_at` and `problems_scored` are keyed by k."""

    prompts: int
    samples: int  # asked for: prompts x n
    failed_samples: int
    mean_reward: float  # mean@n: the mean over problems of each problem's mean reward
    pass_at: dict[int, float]
    problems_scored: dict[int, int]
    failures: dict[str, int]  # failed samples by error ("ExceptionType: message", first line)

    def as_json(self) -> dict:
        return {"prompts": self.prompts, "samples": self.samples, "failed_samples": self.failed_samples,
                "mean_reward": self.mean_reward, **{f"pass@{k}": v for k, v in self.pass_at.items()},
                "problems_scored": {f"pass@{k}": v for k, v in self.problems_scored.items()},
                "failures": self.failures}


def score_task(results: list[ProblemResult], n: int, ks: list[int], correct_at: float) -> TaskScore:
    """pass@k for each k in `ks` and mean@n over `results` (n samples asked for each); NaN where no problem counts."""
    pass_at, scored = {}, {}
    for k in ks:
        values = [pass_at_k(len(r.rewards), r.correct(correct_at), k) for r in results if len(r.rewards) >= k]
        pass_at[k], scored[k] = _mean(values), len(values)
    means = [sum(r.rewards) / len(r.rewards) for r in results if r.rewards]
    failures = Counter(e for r in results for e in r.errors)
    return TaskScore(prompts=len(results), samples=len(results) * n, failed_samples=sum(failures.values()),
                     mean_reward=_mean(means), pass_at=pass_at, problems_scored=scored,
                     failures=dict(failures.most_common()))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
