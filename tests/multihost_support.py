"""Simulated hosts on one machine, for tests of multi-host jobs (root only).

Each host is a network namespace joined to a bridge in the root namespace by a veth pair, with its own
hostname, /etc/hosts, resolv.conf (pointing at 127.0.0.1, so no name query leaves the machine), a private
tmpfs /dev/shm, and its own PID namespace (a remote pid means nothing to the controller, as on real
machines). Inside it runs forge's per-host agent (`python -m forge.hosts.agent`, a Monarch
worker). The test process is the controller, on the bridge's address: it runs again in a
hostname and hosts file of its own (`relaunch_as_controller_host`) so that Monarch listens there.

Addresses come from 198.18.0.0/15 only; traffic stays between the bridge and these namespaces. Every
name starts with `PREFIX` and the owning pid, so leftovers of a crashed run are removed by the next one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PREFIX = "fmh"  # forge multi-host: namespaces, links and folders of these tests
PORT = 26600  # every host's agent listens on the same port (Monarch's remote allocator requires it)
ROOT = Path(__file__).resolve().parent.parent


def namespaces_unavailable() -> str | None:
    """Why simulated hosts cannot be made here (the module skips with this reason), or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, mounts)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the `{tool}` command"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    return None


def _run(*command: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess:
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
    return result


def _owner(name: str) -> int | None:
    digits = "".join(c for c in name[len(PREFIX):].split("h")[0] if c.isdigit())
    return int(digits) if digits else None


def remove_leftovers() -> list[str]:
    """Remove namespaces, links and folders of earlier runs whose test process is gone."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = _owner(name)
        if name.startswith(PREFIX) and (owner is None or not psutil.pid_exists(owner)):
            for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        owner = _owner(link)
        if link.startswith(PREFIX) and (owner is None or not psutil.pid_exists(owner)):
            _run("ip", "link", "del", link, check=False)
            removed.append(link)
    for folder in Path("/tmp").glob(f"{PREFIX}*"):
        owner = _owner(folder.name)
        if owner is None or not psutil.pid_exists(owner):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


CONTROLLER_MARK = "FORGE_MULTIHOST_CONTROLLER"  # the pid of a test process already on its controller host


SUBNET_MARK = "FORGE_MULTIHOST_SUBNET"  # the subnet this test process chose (kept across its relaunch)


def subnet_of(pid: int) -> str:
    """One /24 per test process, two runs at once never sharing one: the first from `pid % 250` on that no interface
    here has an address in (a subnet from the pid alone collided 1 time in 250 between concurrent runs), chosen once
    and kept in the environment so the relaunched process and its hosts agree."""
    if os.environ.get(SUBNET_MARK):
        return os.environ[SUBNET_MARK]
    used = set(re.findall(r"inet (198\.18\.\d+)\.", _run("ip", "-o", "-4", "addr", "show", check=False).stdout))
    for step in range(250):
        subnet = f"198.18.{(pid + step) % 250 + 1}"
        if subnet not in used:
            os.environ[SUBNET_MARK] = subnet
            return subnet
    raise RuntimeError("simulated hosts: every 198.18.N.0/24 subnet (N = 1..250) is in use on this machine")


def relaunch_as_controller_host() -> None:
    """Run this test process again (same pid, same command line) with a hostname and hosts file of its own
    that name its bridge address: Monarch's processes, the controller's included, listen on the address their
    host's name resolves to, and they resolve it on threads of their own, so the process must start in its
    namespaces (a namespace entered later applies to the calling thread only). No-op once done."""
    if os.environ.get(CONTROLLER_MARK) == str(os.getpid()):
        return
    name, folder = f"{PREFIX}{os.getpid()}ctl", Path("/tmp") / f"{PREFIX}{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "controller-hosts").write_text(f"127.0.0.1 localhost\n{subnet_of(os.getpid())}.1 {name}\n")
    os.environ[CONTROLLER_MARK] = str(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    script = f'hostname {name} && mount --bind {folder}/controller-hosts /etc/hosts && exec "$0" "$@"'
    os.execvp("unshare", ["unshare", "--uts", "--mount", "sh", "-c", script, *sys.orig_argv])


# A simulated host's pid 1: runs its agent, reaps every orphan, exits with the agent.
_INIT = ("import os, subprocess, sys\n"
         "agent = subprocess.Popen(sys.argv[1:])\n"
         "while os.wait()[0] != agent.pid: pass")


@dataclass
class SimulatedHost:
    index: int
    name: str  # its network namespace and hostname
    address: str
    port: int
    folder: Path  # its hosts file, resolv.conf, agent log and process logs (FORGE_HOST_LOG_DIR)
    # `ip netns exec ... unshare ...`, whose child is the host's init. Not a child of the test process: a
    # controller kills its own Monarch descendants at shutdown, and another host's processes are none of those.
    agent_pid: int | None = None

    @property
    def log_dir(self) -> Path:
        return self.folder / "logs"

    def init_pid(self) -> int | None:
        """The root-namespace pid of this host's first process (pid 1 inside it)."""
        if self.agent_pid is None:
            return None
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(self.agent_pid).children()  # `ip netns exec` became `unshare`
            return children[0].pid if children else None
        return None

    def run(self, script: str, timeout: float = 20) -> subprocess.CompletedProcess:
        """Run a shell script inside this host (its network, hostname, mounts and PID namespace)."""
        init = self.init_pid()
        if init is None:
            raise RuntimeError(f"host {self.name} is not running")
        return _run("nsenter", "-t", str(init), "-n", "-u", "-m", "-p", "--", "sh", "-c", script,
                    check=False, timeout=timeout)

    def processes(self) -> list[psutil.Process]:
        """Every live process on this host but its init and agent (as the root namespace sees them)."""
        init = self.init_pid()
        found = []
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process(init).children(recursive=True) if init else []:
                with contextlib.suppress(psutil.Error):
                    if proc.status() != psutil.STATUS_ZOMBIE and "forge.hosts.agent" not in proc.cmdline():
                        found.append(proc)
        return found

    def shared_memory(self) -> list[str]:
        return self.run("ls -A /dev/shm").stdout.split()

    def kill_agent(self) -> None:
        init = self.init_pid()
        if init is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)


@dataclass
class SimulatedHosts:
    """`count` hosts on a private bridge; `start()` brings them up, `close()` removes everything."""

    count: int = 2
    port: int = PORT
    start_timeout_s: float = 60.0
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: list[SimulatedHost] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.subnet = subnet_of(os.getpid())
        self.controller_address = f"{self.subnet}.1"
        self.bridge = f"{self.tag}br"
        self.folder = Path("/tmp") / self.tag

    @property
    def addresses(self) -> list[str]:
        return [host.address for host in self.hosts]

    def start(self) -> SimulatedHosts:
        remove_leftovers()
        try:
            self._make_network()
            self._start_agents()
        except BaseException:
            self.close()
            raise
        return self

    def _make_network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self.folder.mkdir(parents=True, exist_ok=True)
        names = [f"{self.tag}h{i}" for i in range(self.count)]
        # The controller's name too: a process that advertises host names (Monarch's SlurmJob) must be reached.
        hosts_file = f"127.0.0.1 localhost\n{self.controller_address} {self.tag}ctl\n" + "".join(
            f"{self.subnet}.{i + 2} {name}\n" for i, name in enumerate(names))
        for i, name in enumerate(names):
            host = SimulatedHost(i, name, f"{self.subnet}.{i + 2}", self.port, self.folder / name)
            self.hosts.append(host)
            host.log_dir.mkdir(parents=True, exist_ok=True)
            (host.folder / "hosts").write_text(hosts_file)
            (host.folder / "resolv.conf").write_text("nameserver 127.0.0.1\n")
            outside, inside = f"{self.tag}v{i}", f"{self.tag}p{i}"
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            _run("ip", "link", "set", inside, "netns", name)
            _run("ip", "netns", "exec", name, "ip", "addr", "add", f"{host.address}/24", "dev", inside)
            _run("ip", "netns", "exec", name, "ip", "link", "set", inside, "up")
            _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")

    def host_program(self, host: SimulatedHost) -> str:
        """The command line of the program a host runs under its init (the host ends with it): forge's agent."""
        return (f"{sys.executable} -m forge.hosts.agent --addr {host.address} --port {host.port} "
                f"--log-dir {host.log_dir}")

    def _start_agent(self, host: SimulatedHost) -> None:
        # Inside: own hostname, hosts file, resolver, /dev/shm and /proc; pid 1 reaps orphans like a host's init
        # and exits with the agent (then the kernel kills everything else on the host).
        script = (
            f"set -e; hostname {host.name}; "
            f"mount --bind {host.folder}/hosts /etc/hosts; mount --bind {host.folder}/resolv.conf /etc/resolv.conf; "
            f"mount -t tmpfs -o size=4g tmpfs /dev/shm; "
            f"exec {sys.executable} -c '{_INIT}' {self.host_program(host)}"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        command = ["ip", "netns", "exec", host.name, "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc",
                   "--kill-child", "sh", "-c", script]
        # Started in the background by a shell that exits at once: the host is re-parented away from us.
        launched = subprocess.run(["sh", "-c", f'"$@" >> {host.folder}/agent.log 2>&1 < /dev/null & echo $!', "sh", *command],
                                  capture_output=True, text=True, cwd=ROOT, env=env, timeout=10, start_new_session=True)
        host.agent_pid = int(launched.stdout.strip())

    def _wait_for_agent(self, host: SimulatedHost, deadline: float) -> None:
        while True:
            with contextlib.suppress(OSError), socket.create_connection((host.address, host.port), timeout=1):
                return
            if not psutil.pid_exists(host.agent_pid) or time.monotonic() > deadline:
                log = (host.folder / "agent.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"host {host.name}: its agent did not start listening on "
                                   f"{host.address}:{host.port}:\n{log}")
            time.sleep(0.2)

    def restart_agents(self) -> None:
        """Every host as freshly booted: its processes killed, a new agent, an empty /dev/shm, so that one failed
        test cannot fail every later one through what it left on a host."""
        self._stop_hosts()
        self._start_agents()

    def _start_agents(self) -> None:
        for host in self.hosts:
            self._start_agent(host)
        deadline = time.monotonic() + self.start_timeout_s
        for host in self.hosts:
            self._wait_for_agent(host, deadline)

    def _stop_hosts(self) -> None:
        for host in self.hosts:
            host.kill_agent()
            if host.agent_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(host.agent_pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while psutil.pid_exists(host.agent_pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
        for host in self.hosts:
            for pid in _run("ip", "netns", "pids", host.name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    def set_link_rate(self, gbit: float | None) -> None:
        """Shape every host's sending side of its link (its end of the veth pair) to `gbit` Gbit/s with a token
        bucket (tc tbf), or remove the shaping (None). Removed with the namespace on `close`."""
        if gbit is not None and not gbit > 0:
            raise ValueError(f"gbit={gbit!r}: must be > 0, or None for an unshaped link")
        for i, host in enumerate(self.hosts):
            inside = f"{self.tag}p{i}"
            if gbit is None:
                _run("ip", "netns", "exec", host.name, "tc", "qdisc", "del", "dev", inside, "root", check=False)
                continue
            # The bucket must hold at least one timer tick's worth of bytes, or tbf cannot reach its rate.
            burst = max(256 << 10, int(gbit * 1e9 / 8 / 250))
            _run("ip", "netns", "exec", host.name, "tc", "qdisc", "replace", "dev", inside, "root", "tbf", "rate",
                 f"{gbit:g}gbit", "burst", str(burst), "latency", "50ms")

    def close(self) -> None:
        """Kill every process of every host, remove namespaces, links and folders (idempotent)."""
        self._stop_hosts()
        for host in self.hosts:
            _run("ip", "netns", "del", host.name, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.hosts.clear()

    def __enter__(self) -> SimulatedHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- an actor for multi-host tests (imported by the processes the tests spawn on every host) ------------------

from forge.actor import ForgeActor, endpoint  # noqa: E402


class HostProbe(ForgeActor):
    """Says where it runs and moves tensors through torchstore."""

    @endpoint
    async def where(self) -> dict:
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        return {"host": socket.gethostname(), "pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}

    @endpoint
    def rank_sum(self) -> float:
        """Joins the mesh's process group from the environment the provisioner set, and all-reduces RANK."""
        import torch
        import torch.distributed as dist

        from forge.distributed import init_from_environment

        rank, _ = init_from_environment("cpu")
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        return float(total)

    @endpoint
    async def say(self, text: str) -> None:
        print(text, flush=True)

    @endpoint
    async def put(self, key: str, value: object) -> None:
        from forge import compat

        await compat.import_torchstore().put(key, value)

    @endpoint
    async def get(self, key: str) -> dict:
        from forge import compat

        # In a dict: a bare tensor has a `values` method, which `compat.raise_if_failed` takes for a ValueMesh.
        return {"value": await compat.import_torchstore().get(key), "host": socket.gethostname()}

    @endpoint
    async def publish(self, namespace: str, version: int, numel: int, fail_after_s: float | None = None) -> None:
        """Publish a 2-tensor state dict whose values say its version, and delete every older version. With
        `fail_after_s`, writing the second tensor into a new file fails that long after the first was written (/dev/shm
        full)."""
        import errno

        import torch

        from forge.weights.store import WeightStore

        store = WeightStore(namespace)
        real_pwrite, tensors_written = os.pwrite, []

        def pwrite_failing_at_the_second_tensor(fd: int, data, offset: int) -> int:
            if offset >= 64 and len(data) > 8:  # a tensor's bytes, not the header
                tensors_written.append(offset)
                if len(tensors_written) == 2:
                    time.sleep(fail_after_s)
                    raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd, data, offset)

        if fail_after_s is not None:
            # Only a new file's pwrite meets a full /dev/shm: a reused spare (all its pages there) is copied into
            # through a mapping. Without the spare, this version is written into a new file.
            store._spare_path().unlink(missing_ok=True)
            os.pwrite = pwrite_failing_at_the_second_tensor
        try:
            await store.publish({"w": torch.full((numel,), float(version)), "b": torch.arange(7.0) + version}, version)
        finally:
            os.pwrite = real_pwrite
        await store.delete_older_than(version)

    @endpoint
    async def read_newest(self, namespace: str) -> dict:
        """The newest version readable here, what its tensors hold, and this process's weight metrics."""
        import asyncio

        from forge import metrics
        from forge.weights.store import WeightStore, WeightVersionError

        store, refused = WeightStore(namespace), []
        for attempt in range(20):
            version = await store.latest_version()
            try:
                weights = await store.fetch(version) if version is not None else {}
                break
            except WeightVersionError:  # replaced or abandoned meanwhile: a generator retries too
                refused.append(version)
                if attempt == 19:
                    raise
                await asyncio.sleep(0.05)
        drained = metrics.drain_local()
        return {"host": socket.gethostname(), "version": version, "refused": refused,
                "values": {name: sorted(set(t.tolist())) for name, t in weights.items() if name == "w"},
                "b": weights["b"].tolist() if weights else None,
                "metrics": {name: (p.count, p.total, p.high) for name, p in drained.items()}}


class TrainStepProbe(ForgeActor):
    """One FSDP training step of a tiny model on a fixed batch, in whatever mesh it is spawned on."""

    @endpoint
    def step(self, model_path: str) -> dict:
        """Joins the mesh's process group from the provisioner's environment and takes one step; returns the
        metrics, and the full weights after the step on rank 0."""
        import torch

        from actors.titan_trainer import TitanTrainer
        from actors.trainer_config import TrainerConfig
        from forge.distributed import init_from_environment
        from rl.types import TrainBatch

        torch.set_num_threads(1)
        rank, world_size = init_from_environment("cpu")
        # Adam's eps well above float rounding of near-zero gradients (a different summation order).
        config = TrainerConfig(model_path=model_path, lr=1e-3, eps=1e-6, loss="dapo", micro_batch_size=2)
        trainer = TitanTrainer(config, rank=rank, world_size=world_size)
        generator = torch.Generator().manual_seed(3)
        rows, length = 4, 10
        response_mask = torch.zeros(rows, length - 1)
        for row in range(rows):
            response_mask[row, 3 : length - 1 - row] = 1  # responses of different lengths
        batch = TrainBatch(input_ids=torch.randint(3, 90, (rows, length), generator=generator),
                           response_mask=response_mask,
                           behaviour_logprobs=torch.full((rows, length - 1), -4.0),
                           policy_versions=torch.where(response_mask > 0, 0, -1).long(),
                           advantages=torch.linspace(1.0, -1.0, rows), rewards=torch.linspace(1.0, 0.0, rows))
        metrics = trainer.train_step(batch)
        weights = trainer.hf_state_dict()  # a collective: the full weights on rank 0
        return {"rank": rank, "world_size": world_size, "host": socket.gethostname(), "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"], "weights": weights if rank == 0 else None}


# -- a small forge job across the simulated hosts, run as its own controller process (the fault tests) --------


def small_job(addresses: list[str], port: int) -> int:
    """`python -m tests.multihost_support ADDRESS,ADDRESS PORT`: a forge job (forge.lifecycle) whose publisher on
    host 0 publishes version 1 and whose reader on host 1 reads it (relayed into host 1's shared memory); prints
    a line once both hosts hold it, then runs until it is killed or a failure ends it."""
    from forge.hosts.config import HostsConfig

    return run_small_job(HostsConfig(addresses=addresses, port=port, roles={"pub": [0], "readers": [1]}))


def run_small_job(hosts: object) -> int:
    """`small_job` on the hosts of a `hosts` section (a HostsConfig whose roles place `pub` and `readers`)."""
    from forge import provisioner
    from forge.lifecycle import run_job

    provisioner.configure_hosts(hosts)

    async def main() -> None:
        import asyncio

        from forge.weights.startup import start_weight_store

        await start_weight_store()
        publisher = await HostProbe.options(procs=1, mesh_name="pub").as_actor()
        reader = await HostProbe.options(procs=1, mesh_name="readers").as_actor()
        await publisher.publish.call_one("small", 1, 1024)
        while (await reader.read_newest.call_one("small"))["version"] != 1:
            await asyncio.sleep(0.2)
        print("ready: version 1 on both hosts", flush=True)
        await asyncio.Event().wait()

    return run_job(main)


if __name__ == "__main__":
    from tests.multihost_support import run_small_job, small_job as job  # actors pickled by their module's real name

    if sys.argv[1] == "slurm":  # `python -m tests.multihost_support slurm PORT LOG_DIR PARTITION`: hosts.slurm, 2 nodes
        from forge.hosts.config import HostsConfig, SlurmConfig

        sys.exit(run_small_job(HostsConfig(port=int(sys.argv[2]), roles={"pub": [0], "readers": [1]}, slurm=SlurmConfig(
            nodes=2, log_dir=sys.argv[3], partition=sys.argv[4], start_timeout_s=120))))
    sys.exit(job(sys.argv[1].split(","), int(sys.argv[2])))
