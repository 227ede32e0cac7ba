"""A job's checkpoints, shared by apps.grpo and apps.sft: the `checkpoint` config section, and `folder/step_NNNNNN/`
holding the trainer's own checkpoint (`trainer/`) and the job's state (`job_state.pkl`: whatever the app saves, e.g.
step, policy version, RNG, episode counters, the replay buffer's contents, the data's position).

A checkpoint is written into `step_NNNNNN.partial/` and renamed when complete, so it is whole or absent; the
newest `keep` are kept. `--resume` reads the newest complete one's job state before the job starts its actors, then
loads its trainer checkpoint, and names the others if either is corrupt. Importing this module imports no torch or
Monarch: the config schemas that hold a `checkpoint` section are read before the training stack is imported.
"""

from __future__ import annotations

import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.trainer_config import CheckpointMismatch


@dataclass
class CheckpointConfig:
    """Job checkpoints (trainer, buffer, RNG, step, version), written atomically; `--resume` reads the newest."""

    interval: int = 0
    """Save the whole job every N steps (0: only at the end, when `final` is set)."""
    final: bool = True
    """Save when the job ends, also when it is stopped by a signal."""
    folder: str = "${run_dir}/checkpoints"
    """Where checkpoints go."""
    keep: int = 2
    """Newest job checkpoints kept on disk."""
    stop_grace_s: float = 600.0
    """On SIGINT/SIGTERM the job finishes its step and writes the `final` checkpoint within this many seconds; past
    it the step is cancelled and no checkpoint is written (raise it for steps or checkpoints that take longer)."""

    def __post_init__(self) -> None:
        if self.stop_grace_s <= 0:
            raise ValueError(f"stop_grace_s={self.stop_grace_s}: must be > 0 (seconds)")
        if self.interval < 0:
            raise ValueError(f"interval={self.interval}: must be >= 0 (0: only the final checkpoint)")
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: must be >= 1")


class JobCheckpoints:
    def __init__(self, folder: str | Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        self.folder, self.keep = Path(folder), keep

    def path(self, step: int) -> Path:
        return self.folder / f"step_{step:06d}"

    async def save(self, step: int, trainer: Any, job_state: dict[str, Any]) -> Path:
        """The trainer's checkpoint (its `save_checkpoint` endpoint) and `job_state`, as step `step`."""
        target, partial = self.path(step), self.folder / f"step_{step:06d}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        await trainer.save_checkpoint.call(str(partial / "trainer"))
        (partial / "job_state.pkl").write_bytes(pickle.dumps(job_state))
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # a checkpoint is complete or absent, never half-written
        for old in self._all()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        print(f"checkpoint: {target}", flush=True)
        return target

    def newest(self) -> tuple[Path, dict[str, Any]]:
        """The newest complete checkpoint and the job state saved with it, read before any actor starts, so a
        `--resume` with no checkpoint or a damaged job state fails at once rather than after the job's start-up."""
        done = [p for p in self._all() if (p / "job_state.pkl").exists()]
        if not done:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.folder} (checkpoint.folder)")
        path = done[-1]
        try:
            return path, pickle.loads((path / "job_state.pkl").read_bytes())
        except Exception as e:
            raise self._corrupt(path, e) from None

    async def load_trainer(self, path: Path, trainer: Any) -> None:
        """Load checkpoint `path` (from `newest`) into `trainer`, naming a mismatch of settings or a damaged file."""
        try:
            await trainer.load_checkpoint.call(str(path / "trainer"))
        except Exception as e:
            if _is_mismatch(e):  # intact, saved under other settings: an earlier checkpoint would be refused too
                raise RuntimeError(f"--resume: checkpoint {path} was saved under other settings: "
                                   f"{_first_line(e)}") from None
            raise self._corrupt(path, e) from None

    def _corrupt(self, path: Path, error: Exception) -> RuntimeError:
        older = [p.name for p in self._all() if p != path]
        return RuntimeError(f"--resume: checkpoint {path} is corrupt or incomplete ({type(error).__name__}: "
                            f"{_first_line(error)}); move it aside to resume from an earlier one "
                            f"({', '.join(older) or 'none left'})")

    def _all(self) -> list[Path]:
        """Every checkpoint folder (complete or not, `.partial` ones excluded), oldest first."""
        return sorted(self.folder.glob("step_*[0-9]"))


def _is_mismatch(error: Exception) -> bool:
    """Whether the trainer refused the checkpoint as one of other settings (CheckpointMismatch): its endpoint's
    exception arrives as an EndpointError naming the remote exception's type."""
    from forge.actor import EndpointError  # Monarch's: not imported where only the `checkpoint` section is read

    return isinstance(error, EndpointError) and f" raised {CheckpointMismatch.__name__}: " in str(error)


def _first_line(error: Exception) -> str:
    """An error's message without an endpoint's remote traceback."""
    return str(error).split("\n--- remote traceback", 1)[0]
