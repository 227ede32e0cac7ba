"""JobCheckpoints: whole or absent, the newest `keep` kept, the newest complete one resumed, corruption named.

The trainer here is a stand-in for the actor's two endpoints (write / read a folder); the real trainer's
checkpoints are exercised by tests/apps/test_grpo.py (kill and resume) and test_grpo_faults.py (a corrupt one).
"""

import re
from pathlib import Path

import pytest

from apps.grpo.checkpoints import JobCheckpoints


class _Endpoint:
    def __init__(self, fn) -> None:
        self.fn = fn

    async def call(self, path: str):
        return self.fn(path)


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
    path, state = await checkpoints.load_latest(trainer)
    assert path.name == "step_000006" and state == {"step": 6}
    assert trainer.loaded == [str(tmp_path / "ckpt" / "step_000006.partial" / "trainer")]  # written, then renamed


async def test_a_save_that_fails_leaves_the_previous_checkpoint_the_latest(tmp_path):
    checkpoints = JobCheckpoints(tmp_path, keep=3)
    await checkpoints.save(1, FolderTrainer(), {"step": 1})
    with pytest.raises(OSError, match="disk full"):
        await checkpoints.save(2, FolderTrainer(fail_saves=True), {"step": 2})
    assert not checkpoints.path(2).exists()
    path, state = await checkpoints.load_latest(FolderTrainer())
    assert path == checkpoints.path(1) and state["step"] == 1


async def test_a_corrupt_newest_checkpoint_is_refused_naming_the_older_ones(tmp_path):
    checkpoints = JobCheckpoints(tmp_path, keep=3)
    for step in (1, 2):
        await checkpoints.save(step, FolderTrainer(), {"step": step})
    state = checkpoints.path(2) / "job_state.pkl"
    state.write_bytes(state.read_bytes()[:10])
    with pytest.raises(RuntimeError, match=re.escape(f"checkpoint {checkpoints.path(2)} is corrupt or incomplete")
                       + r".*\(step_000001\)"):
        await checkpoints.load_latest(FolderTrainer())


async def test_resume_without_a_checkpoint_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint in {tmp_path / 'none'} (checkpoint.folder)")):
        await JobCheckpoints(tmp_path / "none", keep=1).load_latest(FolderTrainer())


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep=0: must be >= 1"):
        JobCheckpoints(tmp_path, keep=0)
