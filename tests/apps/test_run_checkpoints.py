"""apps.run_checkpoints' JobCheckpoints: whole or absent, the newest `keep` kept, the newest complete one resumed, corruption named.

The trainer here is a stand-in for the actor's two endpoints (write / read a folder); the real trainer's
checkpoints are exercised by tests/apps/grpo/test_main.py (kill and resume) and test_faults.py (a corrupt one).
"""

import re
import traceback
from pathlib import Path

import pytest

from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from apps.run_checkpoints import JobCheckpoints
from forge.compat import EndpointError, RaisedInEndpoint
from rl.tiny_model import build_tiny_checkpoint


class _Endpoint:
    """An actor endpoint as its caller sees it: what the method raises arrives as an EndpointError naming it."""

    def __init__(self, fn) -> None:
        self.fn = fn

    async def call(self, path: str):
        try:
            return self.fn(path)
        except Exception as e:
            raise RaisedInEndpoint("TrainerActor", self.fn.__name__, f"{type(e).__name__}: {e}",
                                   traceback.format_exc()).exception() from None


class FolderTrainer:
    """Saves a marker file into the folder it is given; loading reads it back."""

    def __init__(self, fail_saves: bool = False) -> None:
        self.loaded: list[str] = []
        self.save_checkpoint = _Endpoint(self._save)
        self.load_checkpoint = _Endpoint(self._load)
        self.fail_saves = fail_saves

    def _save(self, path: str) -> None:
        if self.fail_saves:
            raise OSError("disk full")
        Path(path).mkdir(parents=True)
        (Path(path) / "weights").write_text(path)

    def _load(self, path: str) -> None:
        self.loaded.append((Path(path) / "weights").read_text())


async def test_save_keeps_the_newest_and_resume_loads_the_latest(tmp_path):
    checkpoints = JobCheckpoints(tmp_path / "ckpt", keep=2)
    trainer = FolderTrainer()
    for step in (2, 4, 6):
        saved = await checkpoints.save(step, trainer, {"step": step})
        assert saved == tmp_path / "ckpt" / f"step_{step:06d}"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000004", "step_000006"]
    path, state = checkpoints.newest()
    assert path.name == "step_000006" and state == {"step": 6}
    await checkpoints.load_trainer(path, trainer)
    assert trainer.loaded == [str(tmp_path / "ckpt" / "step_000006.partial" / "trainer")]  # written, then renamed


async def test_a_save_that_fails_leaves_the_previous_checkpoint_the_latest(tmp_path):
    checkpoints = JobCheckpoints(tmp_path, keep=3)
    await checkpoints.save(1, FolderTrainer(), {"step": 1})
    with pytest.raises(EndpointError, match="raised OSError: disk full"):
        await checkpoints.save(2, FolderTrainer(fail_saves=True), {"step": 2})
    assert not checkpoints.path(2).exists()
    path, state = checkpoints.newest()
    assert path == checkpoints.path(1) and state["step"] == 1


async def test_a_corrupt_newest_job_state_is_refused_before_any_trainer_naming_the_older_ones(tmp_path):
    checkpoints = JobCheckpoints(tmp_path, keep=3)
    for step in (1, 2):
        await checkpoints.save(step, FolderTrainer(), {"step": step})
    state = checkpoints.path(2) / "job_state.pkl"
    state.write_bytes(state.read_bytes()[:10])
    with pytest.raises(RuntimeError, match=re.escape(f"checkpoint {checkpoints.path(2)} is corrupt or incomplete")
                       + r".*\(step_000001\)"):
        checkpoints.newest()  # no trainer yet: `--resume` reads this before the job starts its actors


class LoRATrainer:
    """The trainer actor's two checkpoint endpoints over a real LoRA TitanTrainer (tiny model, in this process)."""

    def __init__(self, model: Path, **lora) -> None:
        config = TrainerConfig(model_path=str(model), lora={"rank": 4, "alpha": 8.0, **lora})
        self.trainer = TitanTrainer(config)
        self.save_checkpoint = _Endpoint(self.trainer.save_checkpoint)
        self.load_checkpoint = _Endpoint(self.trainer.load_checkpoint)


async def test_a_resume_under_other_settings_says_so_and_only_corruption_is_called_corrupt(tmp_path):
    # "Move it aside" would not help: every checkpoint of the run was saved under the settings that differ.
    model = build_tiny_checkpoint(tmp_path / "tiny", seed=0)
    checkpoints = JobCheckpoints(tmp_path / "ckpt", keep=2)
    for step in (1, 2):
        await checkpoints.save(step, LoRATrainer(model), {"step": step})
    path, _ = checkpoints.newest()
    with pytest.raises(RuntimeError) as refused:
        await checkpoints.load_trainer(path, LoRATrainer(model, alpha=16.0))
    assert str(refused.value) == (
        f"--resume: checkpoint {checkpoints.path(2)} was saved under other settings: TrainerActor.load_checkpoint "
        "raised CheckpointMismatch: trainer.lora differs from the settings the checkpoint's adapters were trained "
        "with (alpha=8.0 there, 16.0 here): set them as they were to resume")
    # A damaged file is corruption: its message says so and names the earlier checkpoint (no remote traceback).
    weights = next((checkpoints.path(2) / "trainer").glob("*.distcp"))
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.raises(RuntimeError, match=re.escape(f"checkpoint {checkpoints.path(2)} is corrupt or incomplete")
                       + r" \(EndpointError: TrainerActor.load_checkpoint raised RuntimeError: load_checkpoint: .* is "
                       r"corrupt: .*\); move it aside to resume from an earlier one \(step_000001\)$") as corrupt:
        await checkpoints.load_trainer(path, LoRATrainer(model))
    assert "remote traceback" not in str(corrupt.value)


def test_resume_without_a_checkpoint_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint in {tmp_path / 'none'} (checkpoint.folder)")):
        JobCheckpoints(tmp_path / "none", keep=1).newest()


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep=0: must be >= 1"):
        JobCheckpoints(tmp_path, keep=0)
