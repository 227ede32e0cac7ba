"""RunSummary: the episode accounting it reports, its text and summary.json."""

import json

from apps.grpo.summary import EpisodeCounters, RunSummary

BUFFER_STATS = {"added": 90, "sampled": 64, "consumed": 64, "held": 20, "dropped_too_old": 4, "dropped_buffer_full": 2}


def finished_run(**overrides) -> RunSummary:
    fields = dict(steps=4, policy_version=4, wall_s=12.0, train_s=8.0, steps_this_run=4, reward_failures=3,
                  controller_cpu_s=1.0,
                  accuracy_start=0.25, accuracy_end=0.5, hf_model="runs/x/hf_model")
    summary = RunSummary(**{**fields, **overrides})
    rss = iter([{"controller": 100 * 2**20}, {"controller": 120 * 2**20}])
    summary.step_logged({"reward/mean": 0.1}, memory=lambda: next(rss))
    summary.step_logged({"reward/mean": 0.4}, memory=lambda: next(rss))
    summary.rss_end = {"controller": 130 * 2**20}
    summary.count_episodes(EpisodeCounters(generated=111, zero_variance_dropped=16, trained=64, generation_failures=1,
                                           environment_failures=2, environment_dropped=5), BUFFER_STATS)
    return summary


def test_episodes_add_up_and_the_text_says_so():
    summary = finished_run()
    e = summary.episodes
    assert e == {"generated": 111, "trained": 64, "consumed_by_buffer": 64, "held_in_buffer": 20, "dropped_too_old": 4,
                 "dropped_buffer_full": 2, "dropped_zero_variance": 16, "dropped_environment_failure": 5}
    assert e["generated"] == sum(v for k, v in e.items()
                                 if k.startswith("dropped_") or k in ("trained", "held_in_buffer"))
    text = summary.text()
    assert ("episodes: generated 111 = trained 64 + held 20 + dropped (too old 4, buffer full 2, zero-variance 16, "
            "environment failure 5); environment failures 2, reward failures 3, failed generations 1 (prompt groups)"
            ) in text
    assert "held-out accuracy: 25.0% -> 50.0% (+25.0%)" in text
    assert "reward (batch mean): first step 0.100 -> last step 0.400" in text  # the first logged step is kept
    assert "throughput: 0.50 steps/s, 8.0 trained episodes/s, controller CPU 0.250 core-s per step" in text
    assert "controller 100 -> 130" in text
    assert "exported HF model: runs/x/hf_model" in text and "interrupted" not in text


def test_an_interrupted_run_says_what_it_skipped():
    text = finished_run(interrupted="SIGTERM", accuracy_end=None).text()
    assert "interrupted by SIGTERM after step 4: no final evaluation or export" in text
    assert "exported HF model" not in text and "held-out accuracy" not in text


def test_summary_json_holds_everything_but_the_per_step_metrics(tmp_path):
    path = tmp_path / "run_dir" / "summary.json"  # run_dir made here if nothing else did (metrics.jsonl elsewhere)
    finished_run(checkpoint="runs/x/checkpoints/step_000004").write(path)
    written = json.loads(path.read_text())
    assert "first_step" not in written and "last_step" not in written
    assert written["episodes"]["held_in_buffer"] == 20 and written["generation_failures"] == 1
    assert written["environment_failures"] == 2 and written["episodes"]["dropped_environment_failure"] == 5
    assert written["held_out_score"] == "accuracy"
    assert written["rss_start"] == {"controller": 100 * 2**20} and written["checkpoint"].endswith("step_000004")


def test_the_text_reports_the_largest_clip_and_the_last_steps_mismatch_by_lag():
    summary = finished_run()
    mismatch = {"abs_logp_diff": 0.02, "kl_k3": 3e-4, "chi2": 6e-4, "out_of_band": 0.001, "masked": 0.0025,
                "tis_truncated": 0.5, "token_share": 0.75}
    step = {"clip_fraction": 0.01, **{f"mismatch/{lag}/{k}": v for lag in ("lag0", "lag1", "all")
                                      for k, v in mismatch.items()}}
    summary.step_logged({"clip_fraction": 0.06}, memory=dict)
    summary.step_logged(step, memory=dict)
    lines = summary.text().splitlines()
    assert "PPO clip fraction: largest step 0.0600" in lines
    mismatch_lines = [line for line in lines if line.startswith("off-policy, last step")]
    assert [line.split(",")[2].split()[0] for line in mismatch_lines] == ["lag0", "lag1", "all"]
    assert mismatch_lines[0] == ("off-policy, last step, lag0 (75% of tokens): |dlogp| 2.00e-02, KL k3 3.00e-04, "
                                 "chi2 6.00e-04, out of band 0.10%, masked 0.25%, truncated 50.00%")
