"""apps/examples: the best-of-n app runs end to end, leaves no processes behind and rejects bad configs; the REST
client's loop scores its held-out prompts with the shared evaluator (apps/held_out/)."""

import ast
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from apps.examples.best_of_n import BestOfNConfig, main
from apps.examples.scorer import closeness_reward
from forge.config import load_config, validate
from rl.tasks.arithmetic import ArithmeticTask, Problem
from tests.support import job_processes

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "example_best_of_n.yaml"
RESULT_LINE = re.compile(r"^(\S+) \(answer (-?\d+)\): best (.+) reward ([\d.]+) \| mean ([\d.]+) over (\d+)$", re.M)


def _run_app(*overrides: str, timeout: float) -> tuple[int, subprocess.CompletedProcess]:
    """Runs the app to completion, reading all its output; returns its pid (the job id) and the result."""
    command = [sys.executable, "-m", "apps.examples.best_of_n", "--config", str(CONFIG), *overrides]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"the app ran past {timeout}s:\n{stdout}\n{stderr}")
    return proc.pid, subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def test_closeness_reward():
    assert closeness_reward("46", "46", 10.0) == 1.0
    assert closeness_reward(" 56x", "46", 10.0) == 0.5  # a leading integer 10 off: half credit
    assert closeness_reward("-4", "4", 2.0) == pytest.approx(0.2)
    assert closeness_reward("x46", "46", 10.0) == 0.0  # no leading integer


def test_the_client_loops_datums_carry_what_the_trainer_scores_a_sample_with():
    # Hand-built datums dropped a sample's temperature and top_k/top_p kept sets: the trainer then scored the tokens
    # under another distribution than the one they were drawn from.
    from apps.examples.client_rl_loop import group_datums
    from apps.server.client import Result

    samples = Result.wrap([{"tokens": [7, 8], "logprobs": [-0.5, -0.25], "temperature": 0.7,
                            "kept_token_ids": [[7, 9], [8]]},
                           {"tokens": [9], "logprobs": [-1.0], "temperature": 0.7, "kept_token_ids": [[9, 7]]}])
    first, second = [d.to_json()["loss_fn_inputs"] for d in group_datums([3, 4], samples, [1.0, 0.0])]
    assert first["temperature"] == second["temperature"] == 0.7
    assert first["kept_token_ids"] == [[], [7, 9], [8]] and second["kept_token_ids"] == [[], [9, 7]]
    assert first["advantages"] == [0.0, pytest.approx(1.0, abs=1e-5), pytest.approx(1.0, abs=1e-5)]
    assert first["reward"] == 1.0 and second["mask"] == [0.0, 1.0]


def test_the_client_loops_accuracy_is_the_held_out_evaluators_in_one_request():
    # apps/held_out/'s greedy figure over the server's sampling: every prompt in one request, greedy; a request that
    # fails leaves its samples out and says so (the apps' rule), where it once ended the program.
    from apps.examples.client_rl_loop import accuracy
    from apps.server.client import Result

    class Sampling:
        def __init__(self, error: Exception | None = None) -> None:
            self.error, self.requests = error, []

        async def answer(self, prompts: list[str]) -> Result:
            if self.error is not None:
                raise self.error
            return Result.wrap({"samples": [[{"text": "46" if p == "12+34=" else "0"}] for p in prompts]})

        def sample_many(self, prompts, sampling_params):
            self.requests.append((list(prompts), sampling_params))
            return self.answer(prompts)

    task, problems = ArithmeticTask(seed=0, num_digits=2), [Problem("12+34=", "46"), Problem("1+2=", "3")]
    sampling, log = Sampling(), []
    assert accuracy(sampling, task, problems, max_tokens=4, log=log.append) == 0.5 and log == []
    ((prompts, params),) = sampling.requests
    assert prompts == ["12+34=", "1+2="] and (params.n, params.temperature, params.max_tokens) == (1, 0.0, 4)
    failed = accuracy(Sampling(ConnectionError("server gone")), task, problems, max_tokens=4, log=log.append)
    assert math.isnan(failed)  # nothing was scored
    assert log == ["held-out: 2 of 2 samples failed, left out: {'ConnectionError: server gone': 2}"]


def test_shipped_config_is_valid():
    cfg = validate(load_config(CONFIG), BestOfNConfig)
    assert cfg.replicas == 2 and cfg.sampling.n > 1


@pytest.mark.slow
def test_best_of_n_runs_and_stops_every_process(tmp_path):
    num_prompts, n = 2, 4
    overrides = [f"generator.model={tmp_path / 'tiny'}", f"task.num_prompts={num_prompts}", f"sampling.n={n}"]
    pid, result = _run_app(*overrides, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "generator replicas: 2, policy versions [0, 0]" in result.stdout  # both replicas served

    rows = RESULT_LINE.findall(result.stdout)
    expected = [p.prompt for p in ArithmeticTask(0, 2, held_out=num_prompts).held_out()]
    assert [row[0] for row in rows] == expected, output
    best_rewards = []
    for prompt, answer, text, reward, mean, samples in rows:
        # The reported best is the user's reward of the reported text, and no worse than the average sample.
        assert float(reward) == pytest.approx(closeness_reward(ast.literal_eval(text), answer, 10.0), abs=1e-3)
        assert float(mean) <= float(reward) and int(samples) == n
        best_rewards.append(float(reward))
    summary = re.search(r"best-of-(\d+) over (\d+) prompts: mean best reward ([\d.]+)", result.stdout)
    assert summary and summary.group(1, 2) == (str(n), str(num_prompts)), output
    assert float(summary.group(3)) == pytest.approx(sum(best_rewards) / num_prompts, abs=2e-3)
    # Metrics recorded inside the scorer's process reached the controller's logger.
    assert f"scorer/samples={num_prompts * n} " in result.stdout, output

    assert (tmp_path / "tiny" / "model.safetensors").is_file()  # the tiny model was built on first use
    assert job_processes(pid) == []


def test_unknown_key_fails_before_spawning():
    pid, result = _run_app("task.num_promts=3", timeout=120)
    assert "task.num_promts=3: unknown key. Did you mean 'task.num_prompts'?" in result.stderr, result.stderr
    assert "generator replicas" not in result.stdout  # what the app prints once its actors are up
    assert result.returncode == 2 and job_processes(pid) == []


@pytest.mark.parametrize(
    "override, message",
    [("sampling.n=0", "sampling.n=0: must be >= 1"), ("scorer.distance_scale=-1", "scorer.distance_scale=-1.0: must be > 0"),
     ("task.num_prompts=60", "task.num_prompts=60: must be in [1, 50] for num_digits=1"),
     ("task.num_digits=0", "task.num_digits=0: must be >= 1")],
)
def test_bad_values_name_the_key(override, message, capsys):
    assert main(["--config", str(CONFIG), "task.num_digits=1", override]) == 2
    assert message in capsys.readouterr().err
