"""pass@k and mean@k against a hand computation, and failed samples left out of them, counted (pure)."""

import math
from itertools import combinations

import pytest

from apps.held_out.scores import ProblemResult, pass_at_k, score_task


def test_pass_at_k_is_the_unbiased_estimator_by_hand():
    # 1 - C(n-c, k) / C(n, k): n=4, c=1, k=2 -> 1 - C(3,2)/C(4,2) = 1 - 3/6; c=2 -> 1 - 1/6; c=0 -> 0; n-c < k -> 1
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # k=1: c/n
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample():
    # The estimator's meaning, counted: every k-subset of 6 samples with the first 2 correct.
    samples = [1, 1, 0, 0, 0, 0]
    for k in range(1, 7):
        subsets = list(combinations(samples, k))
        assert pass_at_k(6, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_a_task_s_pass_at_k_and_mean_at_n_by_hand():
    results = [ProblemResult([0, 0, 0, 0]), ProblemResult([1, 0, 0, 0]), ProblemResult([1, 1, 0, 0]),
               ProblemResult([1, 1, 1, 1])]
    score = score_task(results, n=4, ks=[1, 2, 4], correct_at=1.0)
    assert score.pass_at[1] == pytest.approx((0 + 0.25 + 0.5 + 1) / 4)
    assert score.pass_at[2] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert score.pass_at[4] == pytest.approx(3 / 4)
    assert score.mean_reward == pytest.approx(0.4375)  # binary rewards: mean@n is pass@1
    assert (score.prompts, score.samples, score.failed_samples) == (4, 16, 0)


def test_graded_rewards_count_as_correct_from_correct_at():
    results = [ProblemResult([0.5, 1.0]), ProblemResult([0.25, 0.25])]
    score = score_task(results, n=2, ks=[1, 2], correct_at=0.5)
    assert score.pass_at[1] == pytest.approx((1 + 0) / 2)
    assert score.pass_at[2] == pytest.approx((1 + 0) / 2)
    assert score.mean_reward == pytest.approx((0.75 + 0.25) / 2)


def test_failed_samples_are_left_out_and_counted_never_scored_zero():
    # Problem 2 kept 1 of its 3 samples: it counts for pass@1 (from its one sample), not for pass@2 or pass@3.
    results = [ProblemResult([1, 0, 1]), ProblemResult([1], ["EndpointError: HTTP 500"] * 2),
               ProblemResult([], ["TimeoutError"] * 3)]
    score = score_task(results, n=3, ks=[1, 2, 3], correct_at=1.0)
    assert score.pass_at[1] == pytest.approx((2 / 3 + 1) / 2)
    assert score.pass_at[2] == pytest.approx(1.0) and score.problems_scored == {1: 2, 2: 1, 3: 1}
    assert score.mean_reward == pytest.approx((2 / 3 + 1) / 2)
    assert score.failed_samples == 5
    assert score.failures == {"TimeoutError": 3, "EndpointError: HTTP 500": 2}
    assert score.as_json()["failed_samples"] == 5


def test_no_scored_problem_is_nan_not_zero():
    score = score_task([ProblemResult([], ["boom"])], n=1, ks=[1], correct_at=1.0)
    assert math.isnan(score.pass_at[1]) and math.isnan(score.mean_reward) and score.problems_scored == {1: 0}


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match=r"pass_at_k\(n=2, c=3, k=1\)"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match=r"k=3"):
        pass_at_k(2, 1, 3)
