"""Jobs across hosts, on hosts simulated by network namespaces (tests/multihost_support.py): the `hosts`
section refused before anything starts, a mesh across 2 hosts (ranks, rendezvous, torchstore both ways),
processes known by (host, pid), remote output in a file on its host, each weight version relayed to a host once
(forge/weights/relay.py), a 2-host FSDP step equal to the 1-host one, apps.grpo with its trainer and generator on
different hosts, a lost host failing the job by name, and nothing left on any host after shutdown or after the
controller is SIGKILLed. The tests of the section, the job secret and the host agent need no simulated hosts and run
everywhere; the others (those using the `hosts` fixture) skip where network namespaces cannot be made (not root)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.multihost_support import (
    HostProbe,
    SimulatedHosts,
    TrainStepProbe,
    namespaces_unavailable,
    relaunch_as_controller_host,
)

from forge import compat, provisioner
from forge.actor import mesh_of
from forge.hosts.config import HostsConfig, HostsError
from forge.job_auth import SECRET_VARIABLE
from forge.job import job_id
from forge.weights.startup import relays, start_weight_store

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)

_UNAVAILABLE = namespaces_unavailable()
if _UNAVAILABLE is None:
    relaunch_as_controller_host()  # at collection, before any test ran: nothing is lost


@pytest.fixture(scope="module")
def hosts():
    """Two simulated hosts; every test that uses them (directly or through `job`) skips where they cannot be made."""
    if _UNAVAILABLE is not None:
        pytest.skip(_UNAVAILABLE)
    simulated = SimulatedHosts(count=2)
    try:
        simulated.start()
        yield simulated
    finally:
        simulated.close()


_failures_seen = [0]


@pytest.fixture(autouse=True)
def _hosts_rebooted_after_a_failure(request):
    """A test that failed can leave a host's allocator refusing every later job (SimulatedHosts.restart_agents):
    the next test that uses the hosts gets them fresh, so it passes or fails on its own."""
    if "hosts" in request.fixturenames and request.session.testsfailed > _failures_seen[0]:
        _failures_seen[0] = request.session.testsfailed
        request.getfixturevalue("hosts").restart_agents()
    yield


def _config(hosts: SimulatedHosts, **kwargs) -> HostsConfig:
    return HostsConfig(addresses=hosts.addresses, port=hosts.port, **kwargs)


def _listening_beyond_its_address(host) -> list[str]:
    """Every TCP socket listening on `host` on another address than the host's own or loopback (every interface:
    `*` or `[::]`)."""
    listening = [line.split()[3] for line in host.run("ss -ltnH").stdout.splitlines() if line.strip()]
    return [address for address in listening if address.rsplit(":", 1)[0] not in (host.address, "127.0.0.1")]


async def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.2)


# -- the section, refused before anything starts ------------------------------------------------------------


@pytest.mark.parametrize("section, field", [
    (dict(addresses=["198.18.0.2", "198.18.0.2"]), "hosts.addresses[1]='198.18.0.2': duplicate of hosts.addresses[0]"),
    (dict(addresses=["hostb.example"]), "hosts.addresses[0]='hostb.example': must be an IP address"),
    (dict(addresses=["127.0.0.1"]), "hosts.addresses[0]='127.0.0.1': a loopback"),
    (dict(addresses=["198.18.0.2"], roles={"trainer": [1]}), "hosts.roles.trainer: host index 1 is out of range"),
    (dict(addresses=["198.18.0.2"], port=0), "hosts.port=0"),
])
def test_a_bad_section_is_refused_naming_the_field(section, field):
    with pytest.raises(HostsError) as error:
        HostsConfig(**section).validate()
    assert field in str(error.value)


def test_an_unreachable_host_is_refused_within_its_timeout(hosts):
    silent = f"{hosts.subnet}.250"  # on the test's bridge, where nothing answers
    section = HostsConfig(addresses=[hosts.addresses[0], silent], port=hosts.port, connect_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(HostsError) as error:
        section.check_reachable()
    assert f"hosts.addresses[1]='{silent}': no agent answers on port {hosts.port}" in str(error.value)
    assert "addresses[0]" not in str(error.value)
    assert time.monotonic() - started < 5


def test_more_processes_than_a_host_offers_are_refused():
    section = HostsConfig(addresses=["198.18.0.2", "198.18.0.3"], procs_per_host=2).validate()
    section.check_capacity({1: 1}, 1, 1, "mesh 'generator'")
    with pytest.raises(HostsError, match=r"hosts.procs_per_host=2: mesh 'generator' needs 2 process\(es\) on host 1 "
                                         r"\(198.18.0.3\), which already runs 1"):
        section.check_capacity({1: 1}, 1, 2, "mesh 'generator'")


def test_the_host_mesh_attaches_to_every_hosts_worker():
    from forge.hosts.config import worker_address

    section = HostsConfig(addresses=["198.18.0.2", "198.18.0.3"], port=26601).validate()
    assert [worker_address(a, section.port) for a in section.addresses] == ["tcp://198.18.0.2:26601",
                                                                             "tcp://198.18.0.3:26601"]


def test_the_job_secret_is_made_once_by_the_controller_and_refused_when_missing_or_short(monkeypatch):
    """The controller makes it (forge.hosts.host_mesh.allocate_host_mesh); its own host's processes inherit it and the
    provisioner passes it to other hosts' processes with their environment (checked by the relay test below)."""
    from forge.job_auth import job_secret, make_job_secret

    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    with pytest.raises(RuntimeError, match=f"{SECRET_VARIABLE} is not set in this process"):
        job_secret()  # a relay without it refuses to start rather than make a secret of its own
    secret = make_job_secret()
    assert len(secret) == 64 and os.environ[SECRET_VARIABLE] == secret and job_secret() == secret.encode()
    assert make_job_secret() == secret  # one per controller: every host gets the same
    monkeypatch.setenv(SECRET_VARIABLE, "short")
    with pytest.raises(RuntimeError, match=f"{SECRET_VARIABLE}: 5 characters; a job secret needs at least 32"):
        job_secret()


def test_the_lifeline_holds_only_connections_that_prove_the_job_secret(monkeypatch):
    """A watch process's lifeline is held for the life of the controller; a stranger's connection is closed after
    the handshake (it was held for ever too, one file descriptor each)."""
    from forge import job_auth
    from forge.hosts import host_mesh

    monkeypatch.setenv(SECRET_VARIABLE, "s" * 64)
    monkeypatch.setattr(job_auth, "HANDSHAKE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(host_mesh, "controller_address", lambda: "127.0.0.1")
    monkeypatch.setattr(host_mesh, "_lifeline", None)  # this test's own server, forgotten after it
    monkeypatch.setattr(host_mesh, "_lifeline_connections", [])
    address = host_mesh.lifeline_address()
    with socket.create_connection(address, timeout=10) as silent, \
            socket.create_connection(address, timeout=10) as guessing:
        guessing.sendall(bytes(job_auth.NONCE_BYTES + job_auth.MAC_BYTES))
        for stranger in (silent, guessing):
            received = b""
            while chunk := stranger.recv(4096):  # the end of the connection, not the test's 10 s
                received += chunk
            assert received.startswith(host_mesh._LIFELINE_HELLO)
            assert len(received) == len(host_mesh._LIFELINE_HELLO) + job_auth.NONCE_BYTES
    with job_auth.connect(address, b"s" * 64, host_mesh._LIFELINE_HELLO, timeout=10) as watch:
        deadline = time.monotonic() + 10
        while len(host_mesh._lifeline_connections) != 1:
            assert time.monotonic() < deadline, "the watch process's lifeline was not held"
            time.sleep(0.05)
        watch.settimeout(1.0)
        with pytest.raises(TimeoutError):  # held open: nothing sent, not closed
            watch.recv(1)
    host_mesh._lifeline_connections[0].close()


def test_the_host_agent_states_its_trust_boundary_at_start_and_tells_its_processes_its_address(
        tmp_path, monkeypatch, capsys):
    from forge.hosts import agent as host_agent

    class Served(Exception):
        pass

    def serve_jobs(address: str, environment: dict[str, str]) -> None:
        served.update(address=address, env=environment)
        raise Served

    served: dict = {}
    before = dict(os.environ)
    monkeypatch.setattr(host_agent, "serve_jobs", serve_jobs)
    address = socket.gethostbyname(socket.gethostname())  # the agent refuses an address its host's name does not name
    with pytest.raises(Served):
        host_agent.main(["--addr", address, "--port", "26611", "--log-dir", str(tmp_path)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith(f"forge host agent: trust boundary: Monarch's worker on {address}:26611 ")
    assert "without authentication" in printed[1] and "private network" in printed[1], printed
    assert "docs/several_hosts.md" in printed[1]
    assert served["address"] == f"tcp://{address}:26611"
    assert served["env"][host_agent.ADDRESS_VARIABLE] == address  # where the relay on this host listens
    assert served["env"][host_agent.LOG_DIR_VARIABLE] == str(tmp_path)
    assert served["env"]["HYPERACTOR_MESH_DEFAULT_TRANSPORT"] == "tcp"
    assert dict(os.environ) == before  # the worker's environment is its own: this process writes none (compat 30)


# -- a job across two hosts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def job(hosts):
    provisioner.configure_hosts(_config(hosts, procs_per_host=4, roles={"pair": [0, 1], "solo": [1], "svc": [0, 1], "pub": [0], "readers": [1]}))
    yield provisioner.get_provisioner()
    await provisioner.shutdown()


async def test_a_mesh_across_two_hosts_has_ranks_and_rendezvous_right_on_every_host(hosts, job):
    pair = await HostProbe.options(procs=2, hosts=2, mesh_name="pair").as_actor()
    where = sorted((await pair.where.call()).values(), key=lambda w: int(w["RANK"]))
    assert [w["host"] for w in where] == [hosts.hosts[0].name] * 2 + [hosts.hosts[1].name] * 2
    assert [(w["RANK"], w["LOCAL_RANK"], w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"]) for w in where] == [
        ("0", "0", "4", "2"), ("1", "1", "4", "2"), ("2", "0", "4", "2"), ("3", "1", "4", "2")]
    assert {(w["MASTER_ADDR"], w["MASTER_PORT"]) for w in where} == {(hosts.addresses[0], where[0]["MASTER_PORT"])}
    # The rendezvous works across the hosts: gloo over MASTER_ADDR/PORT, every rank in one group.
    assert list((await pair.rank_sum.call()).values()) == [6.0] * 4
    # No process of the job listens beyond its host's address: the rendezvous store (torch's own listened on every
    # interface), gloo, Monarch's allocator and host processes.
    assert {host.name: _listening_beyond_its_address(host) for host in hosts.hosts} == {h.name: [] for h in hosts.hosts}
    mesh = mesh_of(pair)
    assert [str(p) for p in mesh.processes] == [f"{w['host']}:{w['pid']}" for w in where]
    assert not any(p.local for p in mesh.processes)
    with pytest.raises(ValueError, match="known by \\(host, pid\\)"):
        mesh.pids
    assert mesh.hosts == [0, 1]
    # Host B runs 2 of the 4 processes it offers: a mesh of 3 more there is refused before it starts.
    with pytest.raises(HostsError, match=r"hosts.procs_per_host=4: mesh 'solo' needs 3 process\(es\) on host 1"):
        await HostProbe.options(procs=3, mesh_name="solo").as_actor()
    await HostProbe.shutdown(pair)
    assert not mesh.failed and not job.failures.fatal_failures


async def test_a_tensor_goes_through_torchstore_each_way_between_hosts(hosts, job):
    await start_weight_store(job)
    pair = await HostProbe.options(procs=1, hosts=2, mesh_name="pair").as_actor()
    on_a, on_b = pair.slice(hosts=0), pair.slice(hosts=1)
    sent = torch.arange(1024, dtype=torch.float32)
    await on_a.put.call_one("a_to_b", sent)
    got = await on_b.get.call_one("a_to_b")
    assert got["host"] == hosts.hosts[1].name and torch.equal(got["value"], sent)
    await on_b.put.call_one("b_to_a", sent * 2)
    got = await on_a.get.call_one("b_to_a")
    assert got["host"] == hosts.hosts[0].name and torch.equal(got["value"], sent * 2)
    await HostProbe.shutdown(pair)


async def test_a_remote_process_is_watched_by_its_host_and_its_output_stays_there(hosts, job):
    solo = await HostProbe.options(procs=1, mesh_name="solo").as_actor()
    mesh = mesh_of(solo)
    (proc,) = mesh.processes
    assert (proc.host, proc.local, mesh.hosts) == (hosts.hosts[1].name, False, [1])
    await solo.say.call_one("a line from host B")
    log = hosts.hosts[1].folder / "logs" / mesh.log_files[0].split("/logs/", 1)[1]
    assert mesh.log_files[0].startswith(str(hosts.hosts[1].log_dir))
    await _until(lambda: log.exists() and "a line from host B" in log.read_text(), 10, "the line in the host's log")
    # Its pid is a pid of host B's table only: the controller's reads nothing for it.
    assert f"{mesh.name}[0]" not in job.memory_rss()
    assert (await job.remote_memory_rss())[f"{mesh.name}[0]"] > 10_000_000
    await asyncio.sleep(2)  # a few watcher polls: a live remote process is not reported
    assert not mesh.failed and not job.failures.fatal_failures
    # Killed on its host: reported within seconds, by Monarch's supervision or by the host's watch agent
    # (which reads host B's process table and names the process by host and pid).
    hosts.hosts[1].run(f"kill -9 {proc.pid}")
    await _until(lambda: job.failures.fatal_failures, 15, "the remote death reported")
    await job.stop_proc_mesh(mesh)  # a stopped mesh's later reports are ignored
    failures, job.failures.fatal_failures[:] = list(job.failures.fatal_failures), []
    assert {f.mesh_name for f in failures} == {mesh.name}
    assert any(f"process {proc} of mesh {mesh.name!r} exited" in f.message or "Killed(sig=9)" in f.message
               for f in failures)


async def test_a_replica_killed_on_host_b_is_restarted_on_host_b_and_serves_again(hosts, job):
    svc = await HostProbe.options(num_replicas=2, mesh_name="svc").as_service()
    try:
        assert [r.mesh.hosts for r in svc.replicas] == [[0], [1]]
        victim = svc.replicas[1].mesh.processes[0]
        assert victim.host == hosts.hosts[1].name
        hosts.hosts[1].run(f"kill -9 {victim.pid}")
        await _until(lambda: svc.replicas[1].restarts == 1 and svc.replicas[1].healthy, 120, "replica 1 restarted")
        restarted = svc.replicas[1].mesh
        assert restarted.hosts == [1] and restarted.processes[0] != victim
        answers = {(await svc.where.route())["host"] for _ in range(4)}
        assert answers == {hosts.hosts[0].name, hosts.hosts[1].name}
        assert not job.failures.fatal_failures
    finally:
        await svc.stop()


async def _all_read(readers, version: int) -> bool:
    return all(a["version"] == version and a["values"] == {"w": [float(version)]}
               for a in (await readers.read_newest.call("relayed")).values())


async def test_each_version_crosses_to_host_b_once_through_its_relay_and_readers_read_it_from_shared_memory(
        hosts, job):
    await start_weight_store(job)
    assert sorted([(await relay.status.call_one())["host"] for relay in relays(job)]) == [h.name for h in hosts.hosts]
    publisher = await HostProbe.options(procs=1, mesh_name="pub").as_actor()
    readers = await HostProbe.options(procs=2, mesh_name="readers").as_actor()
    numel = 1 << 20  # 4 MB
    relay_b = next(r for r in relays(job) if mesh_of(r).hosts == [1])
    try:
        assert {r["version"] for r in (await readers.read_newest.call("relayed")).values()} == {None}
        seen: dict[int, list[int]] = {}  # by reader: each one's versions in the order it read them
        for version in (1, 2, 3):
            await publisher.publish.call_one("relayed", version, numel)
            deadline = time.monotonic() + 30
            while True:
                answers = list((await readers.read_newest.call("relayed")).values())
                for reader, a in enumerate(answers):
                    if a["version"] is not None:
                        seen.setdefault(reader, []).append(a["version"])
                if all(a["version"] == version for a in answers):
                    break
                assert time.monotonic() < deadline, f"host B's readers never saw version {version}: {answers}"
                await asyncio.sleep(0.2)
            for answer in answers:
                assert answer["host"] == hosts.hosts[1].name
                assert answer["values"] == {"w": [float(version)]} and answer["b"] == [i + version for i in range(7)]
                # Read from host B's shared memory, never from torchstore by the reader itself.
                assert "weights/fetches_past_relay" not in answer["metrics"]
        # A reader never goes back to an older version (two readers may see a new one a poll apart).
        assert all(versions == sorted(versions) for versions in seen.values()), seen
        assert {host.name: _listening_beyond_its_address(host) for host in hosts.hosts} == {
            h.name: [] for h in hosts.hosts}  # the relays' servers included
        # The relays authenticated each other with the job's secret, which no command line or agent log shows.
        secret = os.environ[SECRET_VARIABLE]
        for host in hosts.hosts:
            assert not [p.pid for p in host.processes() if secret in " ".join(p.cmdline())]
            assert secret not in (host.folder / "agent.log").read_text()
        assert (await relay_b.status.call_one())["relayed"] == {"relayed": 3}
        # Host B holds the relay's copy of the newest version; the copies of versions the trainer deleted are
        # gone (one kept as the spare the next copy is written into).
        await _until(lambda: sorted(n for n in hosts.hosts[1].shared_memory() if "-relayed-" in n) ==
                     sorted(f"forge-{job_id()}-relayed-{s}" for s in ("spare", "v3")),
                     10, "host B's shared memory holding v3 and the spare only")
        # Once to host B per version (host A's relay copies nothing: the publisher wrote A's segment).
        copied = sum(group["relay/bytes"].total for group in await job.collect_metrics() if "relay/bytes" in group)
        assert copied == 3 * (4 * numel + 4 * 7)
        # Without RDMA no tensor goes through torchstore: host A's relay streamed the segments to host B's.
        assert not await compat.keys_with_prefix(compat.import_torchstore(), "relayed/tensors/")
        # A publish that fails after its first tensor crossed: host B's readers start reading it as it lands
        # (its relay streams it while it is written), are refused when it is abandoned, and serve version 3 meanwhile;
        # nothing of it stays on host B, and the next version crosses as before.
        failing = asyncio.ensure_future(publisher.publish.call_one("relayed", 4, numel, 3.0))
        during: list[dict] = []
        while not failing.done():
            during += list((await readers.read_newest.call("relayed")).values())
        with pytest.raises(Exception, match="No space left on device"):
            await failing
        assert during and {a["version"] for a in during} == {3}
        assert any(4 in a["refused"] for a in during), during
        assert not [n for n in hosts.hosts[1].shared_memory() if n.endswith(("-relayed-v4", "-relayed-v4.tmp"))]
        await publisher.publish.call_one("relayed", 5, numel)
        deadline = time.monotonic() + 30
        while not await _all_read(readers, 5):
            assert time.monotonic() < deadline, "host B's readers never read version 5"
            await asyncio.sleep(0.2)
    finally:
        await HostProbe.shutdown(publisher)
        await HostProbe.shutdown(readers)


async def test_a_two_host_fsdp_step_equals_the_one_host_two_process_step(hosts, job):
    from rl.tiny_model import build_tiny_checkpoint

    model = str(build_tiny_checkpoint(hosts.folder / "tiny", seed=0))
    across = await TrainStepProbe.options(procs=1, hosts=2, mesh_name="pair").as_actor()  # a rank on A, one on B
    one_host = await TrainStepProbe.options(procs=2, mesh_name="solo").as_actor()  # both ranks on B
    try:
        two_hosts_step, one_host_step = await asyncio.gather(across.step.call(model), one_host.step.call(model))
    finally:
        await TrainStepProbe.shutdown(across)
        await TrainStepProbe.shutdown(one_host)
    two, one = (sorted(s.values(), key=lambda r: r["rank"]) for s in (two_hosts_step, one_host_step))
    assert [(r["host"], r["world_size"]) for r in two] == [(hosts.hosts[0].name, 2), (hosts.hosts[1].name, 2)]
    assert [(r["host"], r["world_size"]) for r in one] == [(hosts.hosts[1].name, 2)] * 2
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], abs=1e-6)
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)
    assert two[0]["weights"].keys() == one[0]["weights"].keys()
    for name, tensor in one[0]["weights"].items():
        torch.testing.assert_close(two[0]["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)


def _job_processes(host) -> list:
    """The job's processes on `host` (Monarch's procs: every actor's process), not the allocation's host process."""
    found = []
    for proc in host.processes():
        with contextlib.suppress(psutil.Error):  # exited since it was listed
            if "bootstrap_main" in " ".join(proc.cmdline()):
                found.append(proc)
    return found


async def test_shutdown_leaves_no_job_process_and_no_shared_memory_on_any_host(hosts, job):
    assert all(_job_processes(host) for host in hosts.hosts)  # the store on A, the watch agents on A and B
    await provisioner.shutdown()
    for host in hosts.hosts:
        await _until(lambda: not _job_processes(host), 40, f"no job process left on {host.name}")
        assert host.shared_memory() == []
        assert host.init_pid() is not None  # the host's agent stays up for the next job


# -- apps.grpo across two hosts (each run its own controller process, on this test's controller host) --------

ROOT = Path(__file__).resolve().parents[2]


def _grpo(hosts: SimulatedHosts, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """apps.grpo with its own `hosts` section: the trainer on host A, the generator on host B."""
    hosts.restart_agents()  # see _small_job
    command = [sys.executable, "-m", "apps.grpo", "--config", "configs/grpo_tiny.yaml", f"run_dir={run_dir}",
               "warm_start.enabled=false", "eval.at_start=false", "eval.num_prompts=32", "checkpoint.final=false",
               "rollout.concurrency=2", "replay_buffer.batch_size=32", "trainer.micro_batch_size=32",
               f"hosts.addresses=[{','.join(hosts.addresses)}]", f"hosts.port={hosts.port}",
               "hosts.roles={trainer: [0], generator: [1]}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command, cwd=ROOT, stdout=(run_dir / "stdout.log").open("w"),
                            stderr=(run_dir / "stderr.log").open("w"), start_new_session=True)


def _agent_logs(hosts: SimulatedHosts) -> str:
    return "".join(f"\n--- {h.name} agent (init {h.init_pid()}):\n" + (h.folder / "agent.log").read_text()[-1500:]
                   for h in hosts.hosts)


def _nothing_left(hosts: SimulatedHosts) -> bool:
    return all(not _job_processes(host) and host.shared_memory() == [] for host in hosts.hosts)


def test_grpo_with_the_trainer_on_host_a_and_the_generator_on_host_b_finishes_and_accounts_for_every_episode(
        hosts, tmp_path):
    run_dir = tmp_path / "grpo"
    app = _grpo(hosts, run_dir, "steps=3")
    try:
        assert app.wait(timeout=400) == 0, (run_dir / "stderr.log").read_text()[-3000:] + _agent_logs(hosts)
    finally:
        if app.poll() is None:
            os.killpg(app.pid, signal.SIGKILL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["policy_version"]) for r in rows] == [1, 2, 3]
    assert sum(r.get("generator/weight_swaps", 0) for r in rows) >= 1  # host B's generator took relayed versions
    assert sum(r.get("relay/bytes", 0) for r in rows) > 0
    # Every version host B's generator reads comes through its relay: it learns of one only once B can read it.
    assert sum(r.get("weights/fetches_past_relay", 0) for r in rows) == 0
    e = json.loads((run_dir / "summary.json").read_text())["episodes"]
    assert e["generated"] > 0 and e["trained"] > 0
    assert e["generated"] == e["trained"] + e["held_in_buffer"] + e["dropped_too_old"] + e["dropped_buffer_full"] + \
        e["dropped_zero_variance"]
    deadline = time.monotonic() + 60
    while not _nothing_left(hosts):
        assert time.monotonic() < deadline, "job processes or shared memory left on a host after the run"
        time.sleep(1)


def _small_job(hosts: SimulatedHosts, folder: Path) -> subprocess.Popen:
    """A forge job of its own (tests.multihost_support.small_job): version 1 published on host A, relayed to B."""
    # Agents that served no job yet: after this module's in-process job, a host's allocator refused the next
    # controller now and then ("no process has ever been allocated on <address>"); a job on a real cluster
    # gets hosts whose agents serve it alone.
    hosts.restart_agents()
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "tests.multihost_support", ",".join(hosts.addresses), str(hosts.port)],
                            cwd=ROOT, stdout=(folder / "stdout.log").open("w"), stderr=(folder / "stderr.log").open("w"),
                            start_new_session=True)


def _wait_until_ready(job: subprocess.Popen, folder: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while "ready: version 1 on both hosts" not in (folder / "stdout.log").read_text():
        assert job.poll() is None, f"the job exited with {job.returncode}:\n{(folder / 'stderr.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the job was not ready in {timeout} s"
        time.sleep(0.5)


def test_a_sigkilled_controller_leaves_nothing_on_any_host_within_60_s(hosts, tmp_path):
    job = _small_job(hosts, tmp_path)
    try:
        _wait_until_ready(job, tmp_path)
        assert all(_job_processes(host) and host.shared_memory() for host in hosts.hosts)  # version 1 on A and B
        # Monarch 0.7 runs no process of a multi-host job on the controller's own host; any there must go too.
        local = [p for p in psutil.Process(job.pid).children(recursive=True) if "bootstrap" in " ".join(p.cmdline())]
        os.kill(job.pid, signal.SIGKILL)
        killed = time.monotonic()
        job.wait(timeout=10)
        while not _nothing_left(hosts) or any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in local):
            assert time.monotonic() - killed < 60, (
                f"left after 60 s: {[(h.name, [p.pid for p in _job_processes(h)], h.shared_memory()) for h in hosts.hosts]}"
                f", on the controller's host: {[p.pid for p in local if p.is_running()]}")
            time.sleep(1)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_a_host_whose_agent_dies_mid_run_fails_the_job_within_30_s_naming_the_host(hosts, tmp_path):
    job = _small_job(hosts, tmp_path)
    try:
        _wait_until_ready(job, tmp_path)
        lost = hosts.hosts[1]
        lost.kill_agent()  # host B's agent and every process on it, as when the machine goes
        killed = time.monotonic()
        stderr = tmp_path / "stderr.log"
        while "FATAL" not in stderr.read_text():
            assert time.monotonic() - killed < 30, f"the job did not fail within 30 s:\n{stderr.read_text()[-3000:]}"
            time.sleep(0.5)
        assert job.wait(timeout=60) != 0
        fatal = stderr.read_text().split("FATAL", 1)[1]
        assert lost.name in fatal or lost.address in fatal, fatal[:2000]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
