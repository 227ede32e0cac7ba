"""Actors and helpers shared by forge's tests (importable by the processes tests spawn, which start in the
repository root like the test run itself: `python -m pytest` from there)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from forge.actor import ForgeActor, endpoint
from forge.metrics import record_metric
from rl.tasks import ArithmeticTask
from forge.weights.store import WeightStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class EchoActor(ForgeActor):
    """Answers with its process id so tests can see which replica served a call."""

    def __init__(self, tag: str = "echo") -> None:
        self.tag = tag
        self.calls = 0
        self.setup_done = False

    @endpoint
    async def setup(self) -> None:
        self.setup_done = True

    @endpoint
    async def echo(self, value: object, delay: float = 0.0) -> tuple[str, int, object]:
        self.calls += 1
        if delay:
            await asyncio.sleep(delay)
        return self.tag, os.getpid(), value

    @endpoint
    async def identity(self, value: object) -> object:
        return value

    @endpoint
    async def wait_until_opened(self) -> str:
        """Returns once `open` was called: only an actor that serves its calls concurrently ever sees it."""
        self._gate = getattr(self, "_gate", None) or asyncio.Event()
        await self._gate.wait()
        return "opened"

    @endpoint
    async def open(self) -> None:
        self._gate = getattr(self, "_gate", None) or asyncio.Event()
        self._gate.set()

    @endpoint
    async def info(self) -> dict:
        return {"pid": os.getpid(), "calls": self.calls, "setup_done": self.setup_done, "env": dict(os.environ)}

    @endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    async def record(self, name: str, value: float, reduce: str = "mean") -> None:
        record_metric(name, value, reduce)


class SyncEndpointActor(ForgeActor):
    """Plain `def` endpoints next to ForgeActor's async `setup` and `teardown`."""

    @endpoint
    def half(self, value: int) -> int:
        if value % 2:
            raise ValueError(f"{value} is odd")
        return value // 2


def constant_state_dict(version: int) -> dict[str, torch.Tensor]:
    """A small HF-named state dict whose values are derived from `version` (easy to check after a fetch)."""
    return {
        "model.embed_tokens.weight": torch.full((32, 16), float(version)),
        "model.layers.0.mlp.up_proj.weight": torch.arange(48, dtype=torch.bfloat16).reshape(3, 16) + version,
        "lm_head.weight": torch.full((32, 16), -float(version)),
    }


class WeightReader(ForgeActor):
    @endpoint
    async def read(self, namespace: str, version: int) -> dict:
        store = WeightStore(namespace)
        weights = await store.fetch(version)
        return {"latest": await store.latest_version(), "sums": {k: float(v.float().sum()) for k, v in weights.items()},
                "pid": os.getpid()}


class ShardedPublisher(ForgeActor):
    """Two ranks holding FSDP (DTensor) shards publish one version together."""

    @endpoint
    async def publish_sharded(self, namespace: str, version: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        full = constant_state_dict(version)
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items() if v.shape[0] % 2 == 0}
        await WeightStore(namespace).publish(sharded, version)


# --- helpers for tests that run whole apps as subprocesses ------------------------------------------------
MARK_VARIABLE = "FORGE_TEST_MARK"


def marked_environment(mark: str) -> dict[str, str]:
    """The current environment plus a mark every process of the run inherits (Monarch's included)."""
    return {**os.environ, MARK_VARIABLE: mark}


def processes_with_mark(mark: str, timeout: float = 30.0) -> list[str]:
    """Processes still carrying `mark` after up to `timeout` seconds (empty when all have exited)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        left = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.environ().get(MARK_VARIABLE) == mark:
                    left.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:120]}")
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


class WatchedProcess:
    """A command run as a subprocess with its output in a file, so a test can watch it while it runs."""

    def __init__(self, command: list[str], log_path: Path, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(command, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, condition, what: str, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the process ended before {what}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.output()[-3000:]}"
            time.sleep(0.1)

    def finish(self, timeout: float = 400) -> int:
        """The exit code, waiting up to `timeout` seconds (then the process is killed)."""
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


def faulty_reward(completion_text: str, answer: str) -> float:
    """The arithmetic task's exact-match reward, except that a fixed quarter of completions make it raise,
    a quarter hang for 2 s and a quarter return NaN (fault-injection tests: `task.reward=tests.support:faulty_reward`)."""
    kind = zlib.crc32(completion_text.encode()) % 4
    if kind == 0:
        raise RuntimeError(f"injected reward failure for {completion_text!r}")
    if kind == 1:
        time.sleep(2.0)
    if kind == 2:
        return float("nan")
    return ArithmeticTask(seed=0, held_out=1).reward(completion_text, answer)


def job_processes(controller_pid: int) -> list[int]:
    """Monarch processes of the job whose controller had `controller_pid`, wherever they were re-parented.

    The provisioner tags every process it spawns with FORGE_JOB_ID=<controller pid>; an orphan left by a dead
    controller is re-parented to init, so looking only at the controller's descendants would miss it.
    """
    import psutil

    pids = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("FORGE_JOB_ID") == str(controller_pid) and any("monarch" in p for p in proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            pass
    return pids


def start_http_app(command: list[str], log_path: Path, cwd: Path, timeout: float = 400) -> tuple[subprocess.Popen, str]:
    """Start an HTTP app (`... http.port=N ...`) and wait for its /health. A start-up that dies is retried
    once: Monarch 0.1.2 on a loaded 2-core host has dropped start-up messages past their deadline."""
    import httpx

    port = next(arg.split("=", 1)[1] for arg in command if arg.startswith("http.port="))
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        for attempt in (1, 2):
            proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                        return proc, base_url
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            print(f"== {command[2]} start-up attempt {attempt} failed (exit {proc.returncode})", file=sys.stderr)
    raise RuntimeError(f"{' '.join(command)} did not come up:\n{log_path.read_text()[-4000:]}")


def stop_http_app(proc: subprocess.Popen, timeout: float = 90) -> int:
    """SIGTERM, wait (kill past `timeout`), then wait up to 30 s for the job's Monarch processes to go; returns
    the exit code. Leftover processes are an AssertionError."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    deadline = time.monotonic() + 30
    while job_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = job_processes(proc.pid)
    assert not left, f"processes of the stopped app are still running: {left}"
    return code


def assert_kept_sets_replay(model, completions, *, temperature, version, atol):
    """Each completion's behaviour log-probs equal the trainer's log-prob function over its recorded kept sets,
    and every token carries `version`."""
    from actors.logprobs import token_logprobs

    for c in completions:
        assert c.policy_versions == [version] * len(c.token_ids)
        assert c.kept_token_ids.shape[0] == len(c.token_ids)
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1]
        replayed = token_logprobs(logits, torch.tensor(c.token_ids), temperature, c.kept_token_ids)
        torch.testing.assert_close(replayed, torch.tensor(c.logprobs), atol=atol, rtol=0)


def flip_byte(path: Path, offset: int) -> None:
    """Flip the low bit of one byte of a file in place (a corrupted shared-memory segment)."""
    with open(path, "r+b") as segment:
        segment.seek(offset)
        byte = segment.read(1)
        segment.seek(offset)
        segment.write(bytes([byte[0] ^ 0x01]))


def tokenizer_merging_across_turns() -> PreTrainedTokenizerFast:
    """A chat tokenizer whose BPE merges the end of a turn's text ("e") with the "!" its template writes after it, so
    its template is not prefix-stable (the template is left to the caller)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    characters = sorted(set("abcdefghijklmnopqrstuvwxyz !?;:0123456789+=\n"))
    vocab = {token: i for i, token in enumerate(("<|endoftext|>", *characters, "e!"))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("e", "!")]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
