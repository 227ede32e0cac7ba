"""actors.engine_scorer: an engine teacher's log-probs are the TorchTitan teacher's, episode by episode, in the flat
order of `completion_ids` (multi-turn episodes included: the environment's tokens are scored too, as the reference
actor scores them; the loss masks them)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from actors.engine_scorer import score_episodes
from actors.engines.hf import HFEngine
from actors.reference_model import ReferenceConfig, ReferenceModel
from rl.tiny_model import build_tiny_checkpoint
from rl.types import Episode, EpisodeBatch, TrainBatch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("teacher"), seed=3)


def episodes(count: int = 6) -> EpisodeBatch:
    rng = random.Random(0)
    made = []
    for i in range(count):
        prompt = [rng.randrange(3, 99) for _ in range(rng.randrange(2, 9))]
        completion = [rng.randrange(3, 99) for _ in range(rng.randrange(1, 7))]
        mask = [rng.randrange(2) for _ in completion] if i % 2 else None  # a multi-turn episode's carry mask
        made.append(Episode(episode_id=i, group_id=0, prompt_ids=prompt, completion_ids=completion,
                            behaviour_logprobs=[0.0] * len(completion), policy_versions=[0] * len(completion),
                            reward=0.0, completion_mask=mask))
    return EpisodeBatch.pack(made)


def test_the_hf_engine_teacher_scores_what_the_titan_teacher_scores(checkpoint: Path) -> None:
    batch = episodes()
    engine = asyncio.run(score_episodes(HFEngine(checkpoint), batch, temperature=0.7))  # the tiny configs' temperature
    titan = ReferenceModel(ReferenceConfig(model_path=str(checkpoint), temperature=0.7))
    expected = titan.logprobs(TrainBatch.from_episodes(batch, pad_id=0).input_ids)[batch.response_index()]
    assert engine.shape == batch.completion_ids.shape and engine.dtype == torch.float32
    assert (engine < 0).all()
    torch.testing.assert_close(engine, expected, atol=1e-4, rtol=0)
    # Each episode's own tokens: scoring one episode alone gives its slice of the whole batch's.
    third = asyncio.run(score_episodes(HFEngine(checkpoint), batch.select([2]), temperature=0.7))
    start = int(batch.completion_lengths[:2].sum())
    torch.testing.assert_close(third, engine[start: start + len(third)], atol=1e-5, rtol=0)
