"""The trainer scores exactly the tokens the generator produced in a multi-turn episode: its log-probs of the model's
tokens equal the generator's behaviour log-probs, and the environment's tokens are out of the loss (in plain text and
in chat mode, where the template's tokens are the environment's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from actors.engines.hf import HFEngine
from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from rl.environments.chat import ChatTemplate
from rl.environments.config import EnvironmentConfig
from rl.environments.protocol import StepResult
from rl.environments.rollout import run_episodes
from rl.tiny_model import build_tiny_checkpoint
from rl.types import SamplingParams, TrainBatch


class Tool:
    """Replies to every turn with a few characters (several tokens), never done: every episode runs max_turns."""

    async def reset(self, task: str) -> str:
        return task

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=f"<{len(action)}>;")


# A chat template in the tiny model's own tokens: its EOS ends each turn (as Qwen3's <|im_end|> does).
EOS_TURNS = ("{% for m in messages %}{{ m.role[0] }}:{{ m.content }}<|endoftext|>{% endfor %}"
             "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[TitanTrainer, HFEngine, Path]:
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)
    trainer = TitanTrainer(TrainerConfig(model_path=str(checkpoint), temperature=0.8))
    engine = HFEngine(checkpoint, seed=3)
    engine.load_weights(trainer.hf_state_dict(), 1)
    return trainer, engine, checkpoint


@pytest.mark.parametrize("chat_mode", [False, True], ids=["plain", "chat"])
async def test_trainer_logprobs_of_a_multi_turn_episode_equal_the_generators(models, chat_mode):
    trainer, engine, checkpoint = models
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = EOS_TURNS
    chat = ChatTemplate(tokenizer) if chat_mode else None

    async def generate(prompts, params):
        return [out[0] for out in engine.generate(prompts, params)]

    prompts = ["12+c=", "7+a=", "99+b=", "3+d="]
    params = SamplingParams(n=1, max_tokens=5, temperature=0.8)
    trajectories = await run_episodes(generate, [Tool() for _ in prompts], prompts, params,
                                      EnvironmentConfig(max_turns=3, max_total_tokens=64),
                                      encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                                      end_token_ids=[tokenizer.eos_token_id], chat=chat)
    if chat_mode:  # every episode in the template, and EOS (its end of turn) ended no episode: all run max_turns
        assert all(t.prompt_ids == chat.first_prompt(p) and len(t.turns) == 3 for t, p in zip(trajectories, prompts))
        assert all(tokenizer.decode(t.completion_ids[t.turns[0][1]:t.turns[1][0]]).endswith(";<|endoftext|>a:")
                   for t in trajectories)
    episodes = [t.to_episode(episode_id=i, group_id=0, reward=0.0) for i, t in enumerate(trajectories)]
    batch = TrainBatch.from_episodes(episodes, pad_id=tokenizer.pad_token_id)
    mask = batch.response_mask.bool()
    assert any(len(t.turns) == 3 and 0 in t.mask for t in trajectories)  # several turns, environment tokens between
    # The batch's rows are the episodes' exact ids: the prompt, then model and environment tokens as generated.
    for row, t in enumerate(trajectories):
        assert batch.input_ids[row, : len(t.ids)].tolist() == t.ids
        assert mask[row].sum() == sum(t.mask) == sum(end - start for start, end in t.turns)
    scored = trainer.logprobs(batch)
    assert torch.allclose(scored[mask], batch.behaviour_logprobs[mask], atol=1e-4), \
        (scored[mask] - batch.behaviour_logprobs[mask]).abs().max()
    assert (batch.policy_versions[mask] == 1).all() and (batch.policy_versions[~mask] == -1).all()
