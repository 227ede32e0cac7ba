"""The two weight-sync checks: per-tensor checksums refuse a corrupted version at fetch, and the canary catches
weights that load but are not the trainer's (both sides score the same completion, on every generator replica)."""

from pathlib import Path

import pytest
import torch

from actors.engines.hf import HFEngine
from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from actors.generator import Generator
from actors.weight_canary import CanaryConfig, WeightSyncError, check_weight_sync, logprob_difference
from forge.weights.manifest import WeightChecksumError
from forge.weights.segment import HEADER, SHM_DIR
from rl.tiny_model import build_tiny_checkpoint
from forge.weights.store import WeightStore
from forge.weights.startup import start_weight_store

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)

PROMPT, COMPLETION = [5, 12, 7, 20, 9], [14, 3, 8, 1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


async def test_a_corrupted_tensor_fails_the_checksum_and_the_canary(checkpoint):
    await start_weight_store()
    store = WeightStore("canary-test")
    trainer = TitanTrainer(TrainerConfig(model_path=str(checkpoint), temperature=0.7))
    engine = HFEngine(checkpoint, seed=1)  # its own random weights until it loads the trainer's
    weights = trainer.hf_state_dict()
    manifest = await store.publish(weights, version=1)
    engine.load_weights(await store.fetch(1), 1)
    served, version = engine.score(PROMPT, COMPLETION)
    assert version == 1
    assert logprob_difference(trainer.score_tokens(PROMPT, COMPLETION), served, version=1, bound=1e-3) < 1e-5

    # Zero the output layer in shared memory: the fetch refuses the version, naming the tensor.
    entry = manifest.entries["lm_head.weight"]
    with open(SHM_DIR / manifest.segment, "r+b") as segment:
        segment.seek(HEADER + entry.offset)
        segment.write(bytes(entry.nbytes))
    with pytest.raises(WeightChecksumError, match=r"policy version 1: tensor 'lm_head\.weight'"):
        await store.fetch(1)
    await store.delete(1)

    # The same corruption where no checksum sees it (published so, or broken in the engine's load): the canary.
    corrupted = {**weights, "lm_head.weight": torch.zeros_like(weights["lm_head.weight"])}
    await store.publish(corrupted, version=2)
    engine.load_weights(await store.fetch(2), 2)
    served, _ = engine.score(PROMPT, COMPLETION)
    expected = trainer.score_tokens(PROMPT, COMPLETION)
    with pytest.raises(WeightSyncError, match=r"policy version 2: on canary token \d+ the trainer's log-prob is "
                                              r"-[\d.]+ and the generator's -4\.59512 .*> canary\.max_logprob_diff=0\.001"):
        logprob_difference(expected, served, version=2, bound=1e-3)  # zero logits: log(1/99) = -4.59512
    await store.delete(2)


def test_the_trainer_scores_at_temperature_one_whatever_it_trains_at(checkpoint):
    """vLLM's teacher-forced log-probs are raw-logit ones, so the canary compares at temperature 1 on both sides."""
    engine = HFEngine(checkpoint, seed=0)
    for temperature in (1.0, 0.5):
        trainer = TitanTrainer(TrainerConfig(model_path=str(checkpoint), temperature=temperature))
        served, _ = engine.score(PROMPT, COMPLETION)
        assert max(abs(a - b) for a, b in zip(trainer.score_tokens(PROMPT, COMPLETION), served)) < 1e-5


def test_a_difference_within_the_bound_is_returned_and_nan_is_refused():
    assert logprob_difference([-1.0, -2.0], [-1.0005, -2.0], version=3, bound=1e-3) == pytest.approx(5e-4)
    with pytest.raises(WeightSyncError, match="token 1"):
        logprob_difference([-1.0, -2.0], [-1.0, float("nan")], version=3, bound=1e-3)
    with pytest.raises(WeightSyncError, match="the trainer scored 2 canary tokens and the generator 1"):
        logprob_difference([-1.0, -2.0], [-1.0], version=3, bound=1e-3)
    with pytest.raises(ValueError, match="every=-1: must be >= 0"):
        CanaryConfig(every=-1)


class _LocalTrainer:
    """The trainer actor's `score_tokens` endpoint, served by a trainer in this process (the canary's trainer side)."""

    def __init__(self, trainer: TitanTrainer, version: int) -> None:
        self.trainer, self.version = trainer, version
        self.score_tokens = self

    async def call(self, prompt_ids: list[int], token_ids: list[int]) -> tuple[list[float], int]:
        return self.trainer.score_tokens(prompt_ids, token_ids), self.version


async def test_the_canary_scores_every_replica_and_names_the_one_serving_wrong_weights(checkpoint):
    """Two replicas report the same policy version; replica 1 loaded a corrupt publish of it (its lm_head zeroed)
    and replica 0 the right one. Scoring one replica could pick replica 0 and pass: every replica is scored."""
    await start_weight_store()
    store = WeightStore("canary-replicas")
    trainer = TitanTrainer(TrainerConfig(model_path=str(checkpoint)))
    weights = trainer.hf_state_dict()
    # The replicas load versions only when asked (no background poll within the test).
    service = await Generator.options(num_replicas=2, mesh_name="canary-gen").as_service(
        model=str(checkpoint), weight_namespace="canary-replicas", weight_poll_s=3600)
    try:
        await store.publish({**weights, "lm_head.weight": torch.zeros_like(weights["lm_head.weight"])}, version=1)
        assert await service.replicas[1].actor.update_weights.call_one(1) == 1
        await store.delete(1)
        await store.publish(weights, version=1)
        for _ in range(2):  # whichever replica a routed call would have picked
            with pytest.raises(WeightSyncError) as failure:
                await check_weight_sync(_LocalTrainer(trainer, 1), service, PROMPT, COMPLETION, bound=1e-3)
            message = str(failure.value)
            assert message.startswith("1 of 2 generator replicas failed the canary: policy version 1: ")
            assert "the generator replica 1 is not serving the trainer's weights" in message
            assert "replica 0" not in message
        assert await service.policy_version.by_replica() == {0: 1, 1: 1}

        # Replica 1 loads the right weights again: every replica passes, and the largest difference is returned.
        await store.publish(weights, version=2)
        assert await check_weight_sync(_LocalTrainer(trainer, 2), service, PROMPT, COMPLETION, bound=1e-3) < 1e-5
    finally:
        await service.stop()
