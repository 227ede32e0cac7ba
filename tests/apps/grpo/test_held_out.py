"""GRPO's held-out evaluation goes through the evaluator apps.eval and apps.sft report with (apps/held_out/), pure (a
stand-in generator service): one greedy sample a prompt, the whole evaluation one call per healthy replica, scored
by the task's reward under the evaluator's rules (a reward that raises or returns NaN fails its sample: left out and
counted, never scored 0 as the training rollout's RewardScorer would), a rollout error that ends the job ends it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apps.grpo.rollouts import HeldOut
from apps.grpo.summary import RunSummary
from forge.metrics import drain_local
from forge.service import NoHealthyReplicaError
from rl.rollout import SingleTurn
from rl.tasks.arithmetic import Problem
from rl.types import Completion, CompletionBatch


class Generators:
    """Answers prompt "p" with "p!" on either of 2 replicas; `error` fails every call."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls, self.generate_batch = error, [], self

    def healthy_replicas(self) -> list[int]:
        return [0, 1]

    async def route(self, prompts, params, min_policy_version=0):
        self.calls.append((list(prompts), params))
        if self.error is not None:
            raise self.error
        return CompletionBatch.pack([[Completion(prompt_ids=[1], token_ids=[5], text=f"{p}!", logprobs=[-1.0],
                                                 finish_reason="stop", policy_versions=[0])] for p in prompts])


def reward(text: str, answer: str) -> float:
    """Exact match; "nan!" gets NaN and "boom!" raises: the reward failed, not the model."""
    if text == "boom!":
        raise ValueError("stand-in reward failure")
    return float("nan") if text == "nan!" else float(text == answer)


PROBLEMS = [Problem("a", "a!"), Problem("b", "x"), Problem("boom", "boom!"), Problem("c", "c!"), Problem("nan", "")]


def held_out(generators: Generators, num_prompts: int = 5) -> HeldOut:
    cfg = SimpleNamespace(task=SimpleNamespace(reward=None), eval=SimpleNamespace(num_prompts=num_prompts),
                          rollout=SimpleNamespace(max_tokens=3))
    task = SimpleNamespace(held_out=lambda: PROBLEMS, stop_token_ids=[9], reward=reward)
    scorer = SimpleNamespace(failures=0, score=None)  # the training rollout's scorer: the evaluation never uses it
    return HeldOut(cfg, task, SingleTurn(generators, scorer))


async def test_the_held_out_score_is_the_shared_evaluators_with_failed_samples_left_out(capsys):
    generators = Generators()
    score = await held_out(generators).score("start")
    assert len(generators.calls) == 2  # one call per healthy replica, as the training groups are played
    assert [p for prompts, _ in generators.calls for p in prompts] == ["a", "b", "boom", "c", "nan"]
    params = generators.calls[0][1]
    assert (params.n, params.temperature, params.max_tokens, params.stop_token_ids) == (1, 0.0, 3, [9])
    # 2 right of the 3 scored; the reward's failures are left out and counted (scored 0 they would make it 2 of 5)
    assert score.mean_reward == 2 / 3 and score.failed_samples == 2
    assert score.failures == {"reward: ValueError: stand-in reward failure": 1,
                              "reward: ValueError: the reward returned NaN": 1}

    summary = RunSummary(held_out_score="accuracy")
    drain_local()
    assert summary.evaluated("start", 3, score) == 2 / 3
    assert drain_local()["eval/accuracy"].value() == pytest.approx(2 / 3)
    assert capsys.readouterr().out == (
        "eval (start, policy version 3): held-out greedy accuracy 66.7% on 3 prompts (2 more left out, failed: "
        "reward: ValueError: stand-in reward failure x1; reward: ValueError: the reward returned NaN x1)\n")
    assert summary.eval_environment_failures == 2

    only_two = await held_out(Generators(), num_prompts=2).score("end")  # eval.num_prompts: the first ones
    assert (only_two.prompts, only_two.mean_reward) == (2, 0.5)


async def test_a_failed_generation_is_a_failed_sample_and_no_healthy_replica_ends_the_job():
    score = await held_out(Generators(error=ConnectionError("stand-in: replica down"))).score("end")
    assert score.failures == {"ConnectionError: stand-in: replica down": 5}  # each problem alone, then counted
    with pytest.raises(NoHealthyReplicaError):
        await held_out(Generators(error=NoHealthyReplicaError("all dead"))).score("end")
