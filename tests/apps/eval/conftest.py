"""A run directory made cheaply, in this process: two step checkpoints written by the trainer's own code (TitanTrainer,
no actors) over two tiny models of the same shape. step_000001 holds the base model's weights (seed 0), step_000002
another model's (seed 1), so an evaluation must give step 1 the base's samples and step 2 others."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from rl.tiny_model import build_tiny_checkpoint


@dataclass
class TinyRun:
    base: Path  # the run's starting model (seed 0)
    other: Path  # the model step 2 holds (seed 1)
    run_dir: Path

    def step(self, n: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{n:06d}"


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    root = tmp_path_factory.mktemp("eval_run")
    run = TinyRun(build_tiny_checkpoint(root / "base", seed=0), build_tiny_checkpoint(root / "other", seed=1),
                  root / "run")
    for step, model in ((1, run.base), (2, run.other)):
        TitanTrainer(TrainerConfig(model_path=str(model))).save_checkpoint(run.step(step) / "trainer")
    return run
