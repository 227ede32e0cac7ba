"""Kept sets of truncated sampling travel Completion -> Episode -> TrainBatch, and the trainer's log-prob function
renormalises over exactly them."""

import pytest
import torch

from actors.logprobs import token_logprobs
from forge.types import Completion, Episode, TrainBatch


def completion(prompt, tokens, kept=None):
    return Completion(prompt_ids=prompt, token_ids=tokens, text="", logprobs=[0.0] * len(tokens),
                      finish_reason="length", policy_versions=[3] * len(tokens),
                      kept_token_ids=None if kept is None else torch.tensor(kept, dtype=torch.int32))


def test_kept_sets_are_aligned_with_their_targets_and_sliced_with_their_rows():
    episodes = [Episode.from_completion(c, episode_id=i, group_id=0, reward=0.0) for i, c in enumerate([
        completion([1, 2, 3], [7, 8], kept=[[7, 4, -1], [8, -1, -1]]),
        completion([5], [6, 9, 4], kept=[[6, 2, 1, 0], [9, -1, -1, -1], [4, 5, -1, -1]]),
        completion([2, 2], [1]),  # sampled without truncation: the full vocabulary
    ])]
    batch = TrainBatch.from_episodes(episodes, pad_id=0)
    assert batch.kept_token_ids.shape == (3, 4, 4) and batch.kept_token_ids.dtype == torch.int32
    # Target t+1 is predicted at position t: the first completion's tokens at positions 2 and 3.
    assert batch.kept_token_ids[0].tolist() == [[-1] * 4, [-1] * 4, [7, 4, -1, -1], [8, -1, -1, -1]]
    assert batch.kept_token_ids[1, :3].tolist() == [[6, 2, 1, 0], [9, -1, -1, -1], [4, 5, -1, -1]]
    assert (batch.kept_token_ids[2] == -1).all()
    assert torch.equal(batch.slice(1, 3).kept_token_ids, batch.kept_token_ids[1:3])
    assert TrainBatch.from_episodes(episodes[2:], pad_id=0).kept_token_ids is None


def test_a_kept_set_with_a_row_per_token_is_required():
    episode = Episode.from_completion(completion([1], [2, 3], kept=[[2, 3]]), episode_id=7, group_id=0, reward=0.0)
    with pytest.raises(ValueError, match=r"Episode 7: kept_token_ids has shape \(1, 2\); must be \[2, K\]"):
        TrainBatch.from_episodes([episode], pad_id=0)


def test_token_logprobs_renormalise_over_the_kept_set_in_float64_reference():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=generator, requires_grad=True)
    targets = torch.tensor([[4, 1, 0], [2, 2, 10]])
    kept = torch.full((2, 3, 4), -1, dtype=torch.int32)
    kept[0, 0, :3] = torch.tensor([4, 7, 1])
    kept[1, 2, :2] = torch.tensor([3, 10])
    out = token_logprobs(logits, targets, 0.7, kept)

    z = logits.detach().double() / 0.7
    expected = z.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    expected[0, 0] = z[0, 0, 4] - z[0, 0, [4, 7, 1]].logsumexp(-1)
    expected[1, 2] = z[1, 2, 10] - z[1, 2, [3, 10]].logsumexp(-1)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)

    # Gradients are finite and reach only the kept logits at a truncated position.
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0].nonzero().flatten().tolist() == [1, 4, 7]


def test_a_target_outside_its_kept_set_is_an_error():
    kept = torch.tensor([[[3, 5]], [[-1, -1]]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"position \(0, 0\) the target token 4 is not in the kept set"):
        token_logprobs(torch.zeros(2, 1, 8), torch.tensor([[4], [4]]), 1.0, kept)
    with pytest.raises(ValueError, match=r"kept_token_ids: shape \(2, 2\); must be \[\*targets.shape, K\]"):
        token_logprobs(torch.zeros(2, 1, 8), torch.tensor([[4], [4]]), 1.0, kept[:, 0])


def test_a_multi_turn_episode_trains_on_the_model_tokens_only():
    # prompt [1, 2] | model [3, 4] | environment [5, 6] | model [7]: positions predict the next token.
    episode = Episode(episode_id=1, group_id=0, prompt_ids=[1, 2], completion_ids=[3, 4, 5, 6, 7],
                      behaviour_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3], policy_versions=[4, 5, -1, -1, 5],
                      reward=1.0, completion_mask=[1, 1, 0, 0, 1])
    batch = TrainBatch.from_episodes([episode], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert batch.response_mask.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert batch.behaviour_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, -0.3])
    assert batch.policy_versions.tolist() == [[-1, 4, 5, -1, -1, 5]]
    assert episode.oldest_policy_version == 4  # the environment's -1 is no version


def test_a_batch_knows_each_sequences_oldest_policy_version_as_its_episode_does():
    # The training loop logs the version lag from the batch's tensors, not from the episodes.
    episodes = [Episode(episode_id=1, group_id=0, prompt_ids=[1, 2], completion_ids=[3, 4, 5, 6, 7],
                        behaviour_logprobs=[0.0] * 5, policy_versions=[6, 5, -1, -1, 7], reward=1.0,
                        completion_mask=[1, 1, 0, 0, 1]),
                Episode(episode_id=2, group_id=0, prompt_ids=[1], completion_ids=[3], behaviour_logprobs=[0.0],
                        policy_versions=[2], reward=0.0),
                Episode(episode_id=3, group_id=0, prompt_ids=[1, 2, 3], completion_ids=[], behaviour_logprobs=[],
                        policy_versions=[], reward=0.0)]
    batch = TrainBatch.from_episodes(episodes, pad_id=0)
    assert batch.oldest_policy_versions().tolist() == [e.oldest_policy_version for e in episodes] == [5, 2, -1]
    assert batch.slice(1, 2).oldest_policy_versions().tolist() == [2]


def test_a_completion_mask_of_the_wrong_length_is_refused():
    episode = Episode(episode_id=3, group_id=0, prompt_ids=[1], completion_ids=[2, 3], behaviour_logprobs=[0.0, 0.0],
                      policy_versions=[0, 0], reward=0.0, completion_mask=[1])
    with pytest.raises(ValueError, match=r"Episode 3: completion_mask has 1 entries; must have one per completion "
                                         r"token \(2\)"):
        TrainBatch.from_episodes([episode], pad_id=0)
