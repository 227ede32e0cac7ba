"""Simulated hosts on one machine, for tests of multi-host jobs (root only).

Each host is a network namespace joined to a bridge in the root namespace by a veth pair, with its own
hostname, /etc/hosts, resolv.conf (pointing at 127.0.0.1, so no name query leaves the machine), a private
tmpfs /dev/shm, and its own PID namespace (a remote pid means nothing to the controller, as on real
machines). Inside it runs forge's per-host agent (`python -m forge.host_agent`, Monarch's
process_allocator). The test process is the controller; its hostname (in a private UTS namespace) is
its bridge address, so Monarch's processes listen there and every host can reach it.

Addresses come from 198.18.0.0/15 only; traffic stays between the bridge and these namespaces. Every
name starts with `PREFIX` and the owning pid, so leftovers of a crashed run are removed by the next one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
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
CLONE_NEWUTS = 0x04000000
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


def become_controller_host(address: str) -> None:
    """This process (the test's controller) names itself `address` in a private UTS namespace: Monarch's
    processes listen on the address their host's name resolves to, and a numeric name needs no lookup."""
    libc = ctypes.CDLL(None, use_errno=True)
    if socket.gethostname() == address:
        return
    if libc.unshare(CLONE_NEWUTS) != 0 or libc.sethostname(address.encode(), len(address)) != 0:
        raise OSError(ctypes.get_errno(), f"cannot name this process's host {address}")


@dataclass
class SimulatedHost:
    index: int
    name: str  # its network namespace and hostname
    address: str
    port: int
    folder: Path  # its hosts file, resolv.conf, agent log and process logs (FORGE_HOST_LOG_DIR)
    agent: subprocess.Popen | None = None  # `ip netns exec ... unshare ...`: the host's init is its child

    @property
    def log_dir(self) -> Path:
        return self.folder / "logs"

    def init_pid(self) -> int | None:
        """The root-namespace pid of this host's first process (pid 1 inside it: the agent)."""
        if self.agent is None or self.agent.poll() is not None:
            return None
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(self.agent.pid).children()  # `ip netns exec` became `unshare`
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
        """Every process on this host but its agent (as the root namespace sees them)."""
        init = self.init_pid()
        with contextlib.suppress(psutil.Error):
            return psutil.Process(init).children(recursive=True) if init else []
        return []

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
        # One /24 per test process: two runs at once never share a subnet.
        self.subnet = f"198.18.{os.getpid() % 250 + 1}"
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
            for host in self.hosts:
                self._start_agent(host)
            deadline = time.monotonic() + self.start_timeout_s
            for host in self.hosts:
                self._wait_for_agent(host, deadline)
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
        hosts_file = "127.0.0.1 localhost\n" + "".join(
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

    def _start_agent(self, host: SimulatedHost) -> None:
        # Inside: own hostname, hosts file, resolver, /dev/shm and /proc, then the agent as pid 1 (when it
        # dies, the kernel kills everything else on the host).
        script = (
            f"set -e; hostname {host.name}; "
            f"mount --bind {host.folder}/hosts /etc/hosts; mount --bind {host.folder}/resolv.conf /etc/resolv.conf; "
            f"mount -t tmpfs -o size=4g tmpfs /dev/shm; "
            f"exec {sys.executable} -m forge.host_agent --addr {host.address} --port {host.port} "
            f"--log-dir {host.log_dir}"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        with open(host.folder / "agent.log", "ab") as log:
            host.agent = subprocess.Popen(
                ["ip", "netns", "exec", host.name, "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc",
                 "--kill-child", "sh", "-c", script],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
                start_new_session=True)

    def _wait_for_agent(self, host: SimulatedHost, deadline: float) -> None:
        while True:
            with contextlib.suppress(OSError), socket.create_connection((host.address, host.port), timeout=1):
                return
            if host.agent.poll() is not None or time.monotonic() > deadline:
                log = (host.folder / "agent.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"host {host.name}: its agent did not start listening on "
                                   f"{host.address}:{host.port}:\n{log}")
            time.sleep(0.2)

    def close(self) -> None:
        """Kill every process of every host, remove namespaces, links and folders (idempotent)."""
        for host in self.hosts:
            host.kill_agent()
            if host.agent is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(host.agent.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.agent.wait(timeout=10)
        for host in self.hosts:
            for pid in _run("ip", "netns", "pids", host.name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
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
    async def say(self, text: str) -> None:
        print(text, flush=True)

    @endpoint
    async def put(self, key: str, value: object) -> None:
        from forge import compat

        await compat.import_torchstore().put(key, value)

    @endpoint
    async def get(self, key: str) -> object:
        from forge import compat

        return await compat.import_torchstore().get(key)
