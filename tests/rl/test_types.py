"""Completions and episodes packed for the wire come back unchanged; kept sets of truncated sampling travel
Completion -> Episode -> TrainBatch, and the trainer's log-prob function
renormalises over exactly them."""

import pickle
import random

import pytest
import torch

from actors.logprobs import token_logprobs
from rl.types import Completion, CompletionBatch, Episode, EpisodeBatch, TrainBatch


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


def random_episode(rng: random.Random, episode_id: int, *, masked: bool, kept: bool, ref: bool) -> Episode:
    prompt, length = rng.randint(1, 6), rng.randint(0, 7)
    return Episode(episode_id=episode_id, group_id=episode_id // 3,
                   prompt_ids=[rng.randrange(50) for _ in range(prompt)],
                   completion_ids=[rng.randrange(50) for _ in range(length)],
                   behaviour_logprobs=[-rng.random() for _ in range(length)],
                   policy_versions=[rng.randrange(-1, 5) for _ in range(length)], reward=rng.randrange(8) / 4,
                   advantage=rng.randrange(-8, 8) / 4,  # float32 on the wire: exact in it
                   completion_mask=[rng.randrange(2) for _ in range(length)] if masked else None,
                   ref_logprobs=[-rng.random() for _ in range(length)] if ref else None,
                   kept_token_ids=torch.randint(-1, 50, (length, rng.randint(1, 3)), dtype=torch.int32) if kept else None)


def same_episode(a: Episode, b: Episode) -> bool:
    kept = (a.kept_token_ids is None and b.kept_token_ids is None) or torch.equal(a.kept_token_ids, b.kept_token_ids)
    values = lambda e: (e.behaviour_logprobs, e.ref_logprobs)  # float32 on the wire
    rounded = [None if v is None else torch.tensor(v, dtype=torch.float32).tolist() for v in values(a)]
    return kept and a == Episode(**{**b.__dict__, "behaviour_logprobs": rounded[0], "ref_logprobs": rounded[1]})


def reference_train_batch(episodes: list[Episode], pad_id: int) -> TrainBatch:
    """TrainBatch.from_episodes written row by row, as the module docstring states the alignment."""
    length = max(len(e.prompt_ids) + len(e.completion_ids) for e in episodes)
    ids = torch.full((len(episodes), length), pad_id, dtype=torch.long)
    mask, behaviour, ref = torch.zeros(len(episodes), length - 1), torch.zeros(len(episodes), length - 1), None
    versions = torch.full((len(episodes), length - 1), -1, dtype=torch.long)
    for row, e in enumerate(episodes):
        p, c = len(e.prompt_ids), len(e.completion_ids)
        ids[row, : p + c] = torch.tensor(e.prompt_ids + e.completion_ids)
        mask[row, p - 1 : p - 1 + c] = torch.tensor(e.completion_mask or [1] * c, dtype=torch.float32)
        behaviour[row, p - 1 : p - 1 + c] = torch.tensor(e.behaviour_logprobs)
        versions[row, p - 1 : p - 1 + c] = torch.tensor(e.policy_versions, dtype=torch.long)
    return TrainBatch(input_ids=ids, response_mask=mask, behaviour_logprobs=behaviour, policy_versions=versions,
                      advantages=torch.tensor([e.advantage for e in episodes]),
                      rewards=torch.tensor([e.reward for e in episodes]), ref_logprobs=ref)


@pytest.mark.parametrize("masked,kept,ref", [(False, False, False), (True, True, True)])
def test_episodes_packed_for_the_wire_come_back_unchanged(masked, kept, ref):
    rng = random.Random(0)
    episodes = [random_episode(rng, i, masked=masked, kept=kept, ref=ref) for i in range(9)]
    packed = pickle.loads(pickle.dumps(EpisodeBatch.pack(episodes)))
    assert len(packed) == 9 and packed.completion_ids.dtype == torch.int32
    assert all(same_episode(a, b) for a, b in zip(packed.unpack(), episodes))
    joined = EpisodeBatch.cat([EpisodeBatch.pack(episodes[:4]), EpisodeBatch.pack(episodes[4:])])
    assert all(same_episode(a, b) for a, b in zip(joined.unpack(), episodes))


def test_joining_batches_with_and_without_masks_and_kept_sets_keeps_each_episodes_meaning():
    rng = random.Random(1)
    plain = [random_episode(rng, i, masked=False, kept=False, ref=False) for i in range(3)]
    multi_turn = [random_episode(rng, 3 + i, masked=True, kept=True, ref=False) for i in range(3)]
    joined = EpisodeBatch.cat([EpisodeBatch.pack(plain), EpisodeBatch.pack(multi_turn)]).unpack()
    for before, after in zip(plain, joined[:3]):  # no mask: every token the model's; no kept set: full vocabulary
        assert after.completion_mask == [1] * len(before.completion_ids) and after.kept_token_ids is None
    assert all(same_episode(a, b) for a, b in zip(joined[3:], multi_turn))


def test_a_train_batch_scatters_every_episode_to_its_documented_positions():
    rng = random.Random(2)
    episodes = [random_episode(rng, i, masked=i % 2 == 0, kept=False, ref=False) for i in range(12)]
    episodes[0].completion_ids = episodes[0].behaviour_logprobs = episodes[0].policy_versions = []
    episodes[0].completion_mask = []
    batch, expected = TrainBatch.from_episodes(episodes, pad_id=99), reference_train_batch(episodes, pad_id=99)
    for name in ("input_ids", "response_mask", "behaviour_logprobs", "policy_versions", "advantages", "rewards"):
        torch.testing.assert_close(getattr(batch, name), getattr(expected, name), rtol=0, atol=0, msg=name)


def test_completions_packed_for_the_wire_read_like_the_lists_they_pack():
    rng = random.Random(3)
    groups = []
    for prompt in range(5):
        prompt_ids = [rng.randrange(50) for _ in range(rng.randint(1, 5))]
        group = []
        for sample in range(rng.randint(1, 3)):
            n = rng.randint(0, 4)
            group.append(Completion(prompt_ids=prompt_ids, token_ids=[rng.randrange(50) for _ in range(n)],
                                    text=f"p{prompt}s{sample}", logprobs=[-0.5] * n, finish_reason="stop",
                                    policy_versions=[prompt] * n,
                                    kept_token_ids=torch.zeros(n, 2, dtype=torch.int32) if sample == 1 else None))
        groups.append(group)
    packed = pickle.loads(pickle.dumps(CompletionBatch.pack(groups)))

    def same(a: list[list[Completion]], b: list[list[Completion]]) -> bool:
        return a == b and all((x.kept_token_ids is None and y.kept_token_ids is None)
                              or torch.equal(x.kept_token_ids, y.kept_token_ids)
                              for ga, gb in zip(a, b) for x, y in zip(ga, gb))

    assert len(packed) == 5 and same(list(packed), groups) and same([packed[3], packed[-1]], [groups[3], groups[-1]])
    with pytest.raises(IndexError):
        packed[5]
    # A GRPO rollout slices a call's answer into its prompts' groups.
    for start, stop in [(0, 2), (2, 5), (1, 4), (4, 4)]:
        assert isinstance(packed[start:stop], CompletionBatch) and same(list(packed[start:stop]), groups[start:stop])
    with pytest.raises(ValueError, match="only contiguous slices"):
        packed[::2]


def test_an_episode_id_beyond_int64_is_refused_by_name():
    episode = Episode(episode_id=1 << 63, group_id=0, prompt_ids=[1], completion_ids=[2], behaviour_logprobs=[0.0],
                      policy_versions=[0], reward=0.0)
    with pytest.raises(ValueError, match=r"episode_id=9223372036854775808 must fit in int64"):
        EpisodeBatch.pack([episode])


def test_a_group_becomes_episodes_straight_from_the_generators_tensors():
    rng = random.Random(4)
    group = [Completion(prompt_ids=[5, 6, 7], token_ids=[rng.randrange(50) for _ in range(n)], text="",
                        logprobs=[-0.25] * n, finish_reason="stop", policy_versions=[2] * n) for n in (3, 0, 5)]
    other = [Completion(prompt_ids=[9], token_ids=[1, 2], text="", logprobs=[-1.0, -2.0], finish_reason="length",
                        policy_versions=[1, 3])]
    completions = CompletionBatch.pack([other, group])[1:]  # as a rollout slices one prompt's group
    packed = EpisodeBatch.from_completions(completions, episode_ids=[10, 11, 12], group_ids=[1] * 3,
                                           rewards=[1.0, 0.0, 0.5], advantages=[1.0, -1.0, 0.0])
    expected = [Episode.from_completion(c, episode_id=10 + i, group_id=1, reward=r, advantage=a)
                for i, (c, r, a) in enumerate(zip(group, [1.0, 0.0, 0.5], [1.0, -1.0, 0.0]))]
    assert packed.unpack() == expected


def test_selected_rows_and_oldest_versions_match_the_episodes():
    rng = random.Random(5)
    episodes = [random_episode(rng, i, masked=True, kept=True, ref=True) for i in range(8)]
    packed = EpisodeBatch.pack(episodes)
    rows = [6, 1, 1, 4]
    assert all(same_episode(a, episodes[r]) for a, r in zip(packed.select(rows).unpack(), rows))
    assert packed.oldest_policy_versions().tolist() == [e.oldest_policy_version for e in episodes]


def with_teacher_topk(episode: Episode, k: int, seed: int) -> Episode:
    """The episode with a teacher's top-k at each completion token: ids [len, k] and bucket log-probs [len, k+1]."""
    generator, length = torch.Generator().manual_seed(seed), len(episode.completion_ids)
    episode.ref_topk_ids = torch.randint(0, 50, (length, k), generator=generator, dtype=torch.int32)
    episode.ref_topk_logprobs = -torch.rand(length, k + 1, generator=generator)
    return episode


def test_the_teachers_topk_travels_with_its_episodes_and_lands_at_their_positions():
    rng = random.Random(3)
    episodes = [with_teacher_topk(random_episode(rng, i, masked=False, kept=False, ref=True), 3, i) for i in range(7)]
    packed = pickle.loads(pickle.dumps(EpisodeBatch.pack(episodes)))
    joined = EpisodeBatch.cat([EpisodeBatch.pack(episodes[:2]), EpisodeBatch.pack(episodes[2:])])
    for batch in (packed, joined, joined.select(range(7))):
        for before, after in zip(episodes, batch.unpack()):
            assert torch.equal(after.ref_topk_ids, before.ref_topk_ids)
            assert torch.equal(after.ref_topk_logprobs, before.ref_topk_logprobs)
    assert [e.episode_id for e in joined.select([5, 1]).unpack()] == [5, 1]
    assert torch.equal(joined.select([5, 1]).unpack()[0].ref_topk_ids, episodes[5].ref_topk_ids)
    train = TrainBatch.from_episodes(packed, pad_id=0)
    assert train.ref_topk_ids.shape == (7, train.input_ids.shape[1] - 1, 3)
    assert train.ref_topk_logprobs.shape == (7, train.input_ids.shape[1] - 1, 4)
    for row, e in enumerate(episodes):  # completion token i is predicted at position p-1+i, as ref_logprobs
        p, c = len(e.prompt_ids), len(e.completion_ids)
        assert torch.equal(train.ref_topk_ids[row, p - 1 : p - 1 + c], e.ref_topk_ids.long())
        assert torch.equal(train.ref_topk_logprobs[row, p - 1 : p - 1 + c], e.ref_topk_logprobs)
    sliced = train.slice(2, 5)
    assert torch.equal(sliced.ref_topk_ids, train.ref_topk_ids[2:5])
    assert torch.equal(sliced.ref_topk_logprobs, train.ref_topk_logprobs[2:5])


def test_a_teachers_topk_of_the_wrong_shape_is_refused_by_name():
    episode = Episode(episode_id=8, group_id=0, prompt_ids=[1], completion_ids=[2, 3], behaviour_logprobs=[0.0, 0.0],
                      policy_versions=[0, 0], reward=0.0, ref_logprobs=[0.0, 0.0],
                      ref_topk_ids=torch.zeros(2, 2, dtype=torch.int32), ref_topk_logprobs=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"^Episode 8: ref_topk_ids has shape \(2, 2\) and ref_topk_logprobs \(2, 2\); "
                                         r"must be \[2, K\] and \[2, K\+1\]"):
        EpisodeBatch.pack([episode])
