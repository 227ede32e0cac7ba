"""SFTJob's held-out accuracy without actors (a stand-in trainer and generator service): a single-turn task's
prompts are sampled and scored by its reward; the multi-turn lookup task's are episodes its environment scores
(the tool call, its reply, then the answer), as apps.eval plays them."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

from apps.held_out.samplers import EpisodeSampler, GeneratorSampler
from apps.sft.cli import load_sft_config
from apps.sft.main import SFTJob
from apps.sft.sources import load_job_data
from rl.types import Completion

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs/sft_tiny.yaml")


async def done(*args) -> None:
    return None


class Policy:
    """A generator service whose model writes, for a prompt that starts with problem i's prompt, `turns[i]`'s first
    text when it is the prompt itself and the second after that (the answer after the tool's reply)."""

    def __init__(self, tokenizer, problems: list, turns: list[tuple[str, str]]) -> None:
        self.tokenizer, self.by_prompt = tokenizer, {p.prompt: t for p, t in zip(problems, turns)}
        self.generate_batch = SimpleNamespace(route=self.route_ids)
        self.generate = SimpleNamespace(route=self.route_text)
        self.update_weights = SimpleNamespace(fanout=done)

    @contextlib.asynccontextmanager
    async def session(self):
        yield self

    def write(self, prompt: str) -> Completion:
        first, after = next(t for p, t in self.by_prompt.items() if prompt.startswith(p))
        text = first if prompt in self.by_prompt else after
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Completion(prompt_ids=[], token_ids=ids, text=text, logprobs=[0.0] * len(ids), finish_reason="stop",
                          policy_versions=[0] * len(ids))

    async def route_ids(self, prompts: list[list[int]], params, min_policy_version: int = 0) -> list:
        return [[self.write(self.tokenizer.decode(ids))] for ids in prompts]

    async def route_text(self, prompt: str, params) -> list:
        return [self.write(prompt)]


async def accuracy(cfg, turns_of) -> tuple[float, object]:
    """The job's held-out accuracy with the model `turns_of(task, problems)` scripts, and its sampler."""
    tokenizer, data = load_job_data(cfg)
    job = SFTJob(cfg, tokenizer, data)
    job.trainer = SimpleNamespace(wait_published=SimpleNamespace(call=done))
    job.generators = Policy(tokenizer, data.problems, turns_of(data.task, data.problems))
    job.sampler = await job.held_out_sampler()
    return await job.accuracy("test"), job.sampler


async def test_the_lookup_tasks_accuracy_is_played_against_its_environment(tmp_path):
    cfg, _ = load_sft_config(["--config", TINY, "data.task.name=lookup", "data.task.held_out=20", "eval.num_prompts=4",
                              f"run_dir={tmp_path}", "environment.max_turns=3"])

    def turns(task, problems):  # ask for the variable, then answer: right for problems 0 and 2, wrong for 1 and 3
        asks = [task.transcript(p)[1][0] for p in problems]
        return [(ask, p.answer if i % 2 == 0 else p.answer + "0") for i, (ask, p) in enumerate(zip(asks, problems))]

    score, sampler = await accuracy(cfg, turns)
    # Sampled as single prompts, every first completion would be the tool call: 0, not 0.5.
    assert isinstance(sampler, EpisodeSampler) and score == 0.5


async def test_a_single_turn_tasks_accuracy_is_its_rewards_mean(tmp_path):
    cfg, _ = load_sft_config(["--config", TINY, "eval.num_prompts=4", f"run_dir={tmp_path}"])
    score, sampler = await accuracy(cfg, lambda task, problems: [(p.answer if i < 3 else "x", "")
                                                                 for i, p in enumerate(problems)])
    assert isinstance(sampler, GeneratorSampler) and score == 0.75
