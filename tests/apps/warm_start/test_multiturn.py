"""apps.warm_start.multiturn's accuracy: an evaluation episode whose environment failed is left out (counted and
reported), never scored 0; a warm start that cannot produce a correct episode fails naming its task."""

import pytest

from apps.warm_start.config import WarmStartConfig
from apps.warm_start.multiturn import warm_start_multiturn
from rl.environments.config import EnvironmentConfig
from rl.environments.protocol import StepResult
from rl.tiny_model import build_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


class Environment:
    """Problem "good" scores 1, "zero" scores 0, and the environment of "bad" (or of every problem, `broken`) fails
    at its reset, as a sandbox whose connection dropped."""

    broken = False

    async def reset(self, problem: str) -> str:
        if self.broken or problem == "bad":
            raise ConnectionError("sandbox gone")
        self.problem = problem
        return "1+1="

    async def step(self, action: str) -> StepResult:
        return StepResult(observation="", reward=float(self.problem == "good"), done=True)


class Task:
    stop_token_ids = ()

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken

    def transcript(self, problem) -> list[tuple[str, bool]]:
        return [("1+1=", False), ("2", True)]

    def environment(self) -> Environment:
        environment = Environment()
        environment.broken = self.broken
        return environment


def _warm_start(tiny, out_dir, task: Task, eval_problems: list[str], log: list[str]):
    config = WarmStartConfig(target_accuracy=0.4, lr=1e-3, batch_size=2, max_steps=2, eval_every=1)
    return warm_start_multiturn(tiny, out_dir, task=task, task_name="sandboxed", train_problems=lambda n: ["good"] * n,
                                eval_problems=eval_problems, limits=EnvironmentConfig(max_turns=1), config=config,
                                seed=0, max_tokens=2, log=log.append)


def test_failed_episodes_are_left_out_of_the_accuracy_and_reported(tiny, tmp_path):
    log: list[str] = []
    _, accuracy = _warm_start(tiny, tmp_path, Task(), ["good", "bad", "zero"], log)
    assert accuracy == 0.5  # 1 of the 2 that played; scored as 0, the failure made it 1/3, under the target
    # the shared evaluator's rules and words (apps/held_out/): a failed sample, counted with its reason
    assert any("1 of 3 evaluation episodes left out of the accuracy: they failed (first: EnvironmentFailed: "
               "ConnectionError: sandbox gone)" in line for line in log)
    assert any("warm start: 1 of 3 evaluation episodes failed over its checks" in line for line in log)


def test_a_warm_start_whose_every_episode_fails_stops_naming_the_task(tiny, tmp_path):
    with pytest.raises(RuntimeError, match=r"warm start of task 'sandboxed': all 3 evaluation episodes failed \(first: "
                                           r"EnvironmentFailed: ConnectionError: sandbox gone\)"):
        _warm_start(tiny, tmp_path, Task(broken=True), ["good", "zero", "good"], [])

