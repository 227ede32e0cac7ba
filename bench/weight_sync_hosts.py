"""Weight sync across hosts: the publisher on simulated host A, 2 generator processes on simulated host B
(network namespaces, tests/multihost_support.py; root only), three ways side by side in one run.

    cd <repo> && .venv/bin/python -m bench.weight_sync --hosts 2 --size-gb 1.0 --dtypes bf16 --repeats 2

(a) forge's relay: `WeightStore.publish` on A (A's shared memory; torchstore gets the keys and manifest, and the
    tensors only where it has RDMA); host B's relay copies the version into B's shared memory (streamed from A's
    relay without RDMA); both readers read it there (`fetch(v, into=...)`).
(b) plain torchstore: `ts.put_state_dict` on A, `ts.get_state_dict` in each reader on B (each reader pulls
    the whole state dict across the link).
(c) the link's limit: one raw TCP stream of the same number of bytes from a process on A to one on B.

publish-to-ready: from the start of the publish until both readers on B hold the version in their own
pre-allocated tensors (checked by a fingerprint), measured in the controller (the bench's process, on the
bridge between the hosts); `publish s` is when the publisher's call returned (in (a) the relay may already be
copying). (c) is timed by its receiver, from connect to the last byte.

CPU core-s: the CPU time (user + system) the path used in all processes on both hosts and in the controller ((c):
its sender and receiver, from connect to the last byte); the hosts share this machine's cores, so a path that
needs more CPU seconds than the cores give in its time is CPU-bound here.

(a)'s stages, from the same run (wall-clock times of the relay and the readers, all processes on this machine,
seconds after the publish started): when host B's relay started its copy, had received the last byte, and
advertised the complete copy; when each reader started its fetch and when it returned the verified version.
Then (a) again with no reader on host B: from the start of the publish until host B's relay advertised its copy
(the stream on its own, without the readers' CPU). `host B CPU core-s` is the CPU time of host B's processes alone (its
relay and both readers) per version.

With `--link-gbit 1,10,25`, each host's side of its link is shaped with tc (a token bucket, tbf) to that rate, one
set of rows per rate (torn down with the namespaces); (a) is also printed against the link's time for the bytes sent.

    .venv/bin/python -m bench.weight_sync --hosts 2 --size-gb 1.0 --dtypes bf16 --repeats 2 --link-gbit 1,10,25
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.multihost_support import SimulatedHost, SimulatedHosts, namespaces_unavailable, relaunch_as_controller_host

from bench.weight_sync_actors import DTYPES, Publisher, Reader, delete_torchstore_prefix, state_dict_shapes
from actors.generator_config import GeneratorConfig
from forge import provisioner
from forge.actor import endpoint, mesh_of
from forge.hosts.config import HostsConfig
from forge.weights.store import WeightStore
from forge.weights.startup import relays, start_weight_store

RAW_PORT = 26650  # the raw copy's port on host A (inside its namespace: nothing else listens there)


class RelayPublisher(Publisher):
    def __init__(self) -> None:
        super().__init__()
        self.stores: dict[str, WeightStore] = {}

    @endpoint
    async def mark(self, version: int) -> list[float]:
        """The version stamped into every tensor's ends."""
        return self.stamp(version)

    @endpoint
    async def publish_relayed(self, namespace: str, version: int) -> None:
        # relayed mode: the provisioner set FORGE_MULTI_HOST in this process
        store = self.stores.setdefault(namespace, WeightStore(namespace))
        await store.publish(self.weights, version)
        await store.delete_older_than(version)


class RelayReader(Reader):
    def __init__(self) -> None:
        super().__init__()
        self.stores: dict[str, WeightStore] = {}

    @endpoint
    async def fetch_relayed(self, namespace: str, version: int, timeout_s: float = 300.0) -> tuple[float, float]:
        """Wait until this host can read `version` (complete, or arriving: its relay is streaming it), checking as
        often as a generator does by default (`weight_poll_s`: each check is 3 torchstore calls, ~3-4 ms of CPU here across
        the processes involved), then read it into the live weights; returns when the fetch started and ended (wall
        clock)."""
        store = self.stores.setdefault(namespace, WeightStore(namespace))
        await store.wait_for_version(version, timeout_s, GeneratorConfig.weight_poll_s)  # as a generator learns of it
        started = time.time()
        await store.fetch(version, into=self.live)
        return started, time.time()


def cpu_seconds(hosts: SimulatedHosts) -> float:
    """CPU seconds (user + system) used so far by every process on the simulated hosts and by this controller."""
    return sum(os.times()[:2]) + sum(host_cpu_seconds(host) for host in hosts.hosts)


def host_cpu_seconds(host: SimulatedHost) -> float:
    """CPU seconds (user + system) used so far by the processes on one simulated host."""
    total = 0.0
    for process in host.processes():
        with contextlib.suppress(psutil.Error):
            total += sum(process.cpu_times()[:2])
    return total


async def _check(readers: RelayReader, expected: list[float], path: str) -> None:
    for rank, got in (await readers.fingerprint.call()).items():
        if got != expected:
            raise RuntimeError(f"{path}: reader {rank} does not hold the version just published")


async def relay_once(publisher: RelayPublisher, readers: RelayReader, relay_b, namespace: str, version: int,
                     hosts: SimulatedHosts) -> tuple[float, float, dict, float]:
    """(publish-to-ready, publish, stages, CPU core-s) of one version through path (a)."""
    expected = await publisher.mark.call_one(version)
    cpu, cpu_b = cpu_seconds(hosts), host_cpu_seconds(hosts.hosts[1])
    start, wall = time.perf_counter(), time.time()

    async def publish() -> float:
        await publisher.publish_relayed.call_one(namespace, version)
        return time.perf_counter() - start

    published, fetches = await asyncio.gather(publish(), readers.fetch_relayed.call(namespace, version))
    seconds, cpu = time.perf_counter() - start, cpu_seconds(hosts) - cpu
    cpu_b = host_cpu_seconds(hosts.hosts[1]) - cpu_b
    await _check(readers, expected, "relay")
    copy = await _advertised_copy(relay_b, version)  # the readers may finish first
    stages = {f"relay {k}": copy[k] - wall for k in ("started", "received", "advertised")}
    reads = list(fetches.values())
    stages["readers started"] = min(r[0] for r in reads) - wall
    stages["readers done"] = max(r[1] for r in reads) - wall
    stages["host B CPU core-s"] = cpu_b
    return seconds, published, stages, cpu


async def _advertised_copy(relay_b, version: int) -> dict:
    """Host B's relay's times of its copy of `version`, once it advertised it (a version is copied only once
    its publish returned: until then the relay's last copy is an older version)."""
    deadline = time.monotonic() + 30
    while "advertised" not in (copy := (await relay_b.status.call_one())["last_copy"]) \
            or copy.get("version", -1) < version:
        if time.monotonic() > deadline:
            raise RuntimeError(f"host B's relay never advertised its copy of version {version}: {copy}")
        await asyncio.sleep(0.01)
    if copy.get("version") != version:
        raise RuntimeError(f"host B's relay's last copy is {copy}, not version {version}")
    return copy


async def relay_alone_once(publisher: RelayPublisher, relay_b, namespace: str, version: int,
                           hosts: SimulatedHosts) -> tuple[float, float, float]:
    """(a) with no reader on host B: (publish to host B's copy advertised, publish, CPU core-s) of one version."""
    await publisher.mark.call_one(version)
    cpu = cpu_seconds(hosts)
    start, wall = time.perf_counter(), time.time()
    await publisher.publish_relayed.call_one(namespace, version)
    published = time.perf_counter() - start
    copy = await _advertised_copy(relay_b, version)
    return copy["advertised"] - wall, published, cpu_seconds(hosts) - cpu


async def torchstore_once(publisher: RelayPublisher, readers: RelayReader, key: str, version: int,
                          hosts: SimulatedHosts) -> tuple[float, float, float]:
    """(publish-to-ready, publish, CPU core-s) of one version through path (b)."""
    expected = await publisher.mark.call_one(version)
    cpu = cpu_seconds(hosts)
    start = time.perf_counter()
    await publisher.publish_torchstore.call_one(key)
    published = time.perf_counter() - start
    await readers.fetch_torchstore.call(key, None)
    seconds, cpu = time.perf_counter() - start, cpu_seconds(hosts) - cpu
    await _check(readers, expected, "torchstore")
    await delete_torchstore_prefix(key + "/")
    return seconds, published, cpu


def _median(runs: list[tuple]) -> tuple:
    """The run with the median publish-to-ready."""
    return sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]


_SENDER = """
import socket, sys, time
nbytes, address, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
data = memoryview(bytearray(min(nbytes, 64 << 20)))
with socket.create_server((address, port)) as server:
    print("listening", flush=True)
    connection, _ = server.accept()
    cpu = time.process_time()
    with connection:
        sent = 0
        while sent < nbytes:
            sent += connection.send(data[: min(len(data), nbytes - sent)])
print(time.process_time() - cpu)
"""

_RECEIVER = """
import socket, sys, time
nbytes, address, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
buffer = memoryview(bytearray(nbytes))
start, cpu = time.perf_counter(), time.process_time()
with socket.create_connection((address, port), timeout=120) as connection:
    got = 0
    while got < nbytes:
        n = connection.recv_into(buffer[got:])
        if n == 0:
            raise SystemExit(f"the sender stopped after {got} of {nbytes} bytes")
        got += n
print(time.perf_counter() - start, time.process_time() - cpu)
"""


def raw_copy(hosts: SimulatedHosts, nbytes: int) -> tuple[float, float, float]:
    """(c): one TCP stream of `nbytes` from host A to host B: (seconds, timed by the receiver, the same again as
    "publish", CPU core-s of the sender and the receiver)."""
    a, b = hosts.hosts[0], hosts.hosts[1]
    sender = subprocess.Popen(["nsenter", "-t", str(a.init_pid()), "-n", "-u", "-m", "-p", "--", sys.executable, "-c",
                               _SENDER, str(nbytes), a.address, str(RAW_PORT)], stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None and sender.stdout.readline().strip() == "listening"
        received = subprocess.run(["nsenter", "-t", str(b.init_pid()), "-n", "-u", "-m", "-p", "--", sys.executable,
                                   "-c", _RECEIVER, str(nbytes), a.address, str(RAW_PORT)],
                                  capture_output=True, text=True, timeout=300)
        if received.returncode != 0:
            raise RuntimeError(f"raw copy: {received.stderr.strip()}")
        seconds, receiver_cpu = map(float, received.stdout.split())
        sender_cpu = float(sender.stdout.readline())
        return seconds, seconds, receiver_cpu + sender_cpu
    finally:
        sender.wait(timeout=30)


async def run(args: argparse.Namespace, hosts: SimulatedHosts) -> list[dict]:
    provisioner.configure_hosts(HostsConfig(addresses=hosts.addresses, port=hosts.port,
                                            roles={"publisher": [0], "readers": [1]}))
    job = provisioner.get_provisioner()
    await start_weight_store(job)
    relay_b = next(relay for relay in relays(job) if mesh_of(relay).hosts == [1])
    publisher = await RelayPublisher.options(procs=1, mesh_name="publisher").as_actor()
    readers = await RelayReader.options(procs=2, mesh_name="readers").as_actor()
    rows, version = [], 0
    for link, dtype in [(link, dtype) for link in args.link_gbit for dtype in args.dtypes]:
        hosts.set_link_rate(link)
        print(f"\n--- link {'unshaped (loopback speed)' if link is None else f'{link:g} Gbit/s (tc tbf)'}, {dtype}",
              flush=True)
        shapes = state_dict_shapes(args.size_gb, DTYPES[dtype])
        nbytes = await publisher.build.call_one(shapes, dtype)
        await readers.allocate.call(shapes, dtype, False)  # fetched straight into the live weights: no staging
        namespace = f"bench-hosts-{dtype}"
        # Warm-up: connections, and two versions so that every timed one finds a deleted version's file on each host
        # to write into, as in a job's steady state (writing into fresh shared memory cost ~2 core-s more per GB here).
        for _ in range(2):
            version += 1
            await relay_once(publisher, readers, relay_b, namespace, version, hosts)
        relay = []
        for _ in range(args.repeats):
            version += 1
            relay.append(await relay_once(publisher, readers, relay_b, namespace, version, hosts))
        seconds, published, stages, cpu = _median(relay)
        print(f"(a) median of {len(relay)}: {seconds:.3f} s, publish returned at {published:.3f} s, {cpu:.2f} CPU "
              "core-s; stages: " +
              ", ".join(f"{stage} {at:.3f}" for stage, at in stages.items()), flush=True)
        alone = []
        for _ in range(args.repeats):
            version += 1
            alone.append(await relay_alone_once(publisher, relay_b, namespace, version, hosts))
        plain = []
        for _ in range(0 if args.no_torchstore else args.ts_repeats or args.repeats):
            version += 1
            plain.append(await torchstore_once(publisher, readers, f"bench-hosts-ts-{dtype}-{version}", version, hosts))
        raw = [raw_copy(hosts, nbytes) for _ in range(args.repeats)]
        await publisher.free.call_one()
        await readers.free.call()
        rows.append({"link": link, "dtype": dtype, "gb": nbytes / 1e9, "tensors": len(shapes), "relay": _median(relay),
                     "relay alone": _median(alone), "torchstore": _median(plain) if plain else None, "raw": _median(raw),
                     })
        print_row(rows[-1])
    return rows


def print_row(row: dict) -> None:
    gb = row["gb"]
    link = "unshaped link" if row["link"] is None else f"link {row['link']:g} Gbit/s"
    print(f"\n{row['dtype']}, {link}: {gb:.3f} GB in {row['tensors']} tensors, publisher on host A, 2 readers on host B; "
          "publish-to-ready, median")
    print(f"  {'path':<58}{'seconds':>9}{'GB/s':>8}{'publish s':>11}{'CPU core-s':>12}")
    for label, key in (("(a) forge: host B's relay, shm readers", "relay"),
                       ("(b) plain torchstore: put once, get per reader", "torchstore"),
                       ("(c) raw TCP copy A -> B, same bytes, once (the link)", "raw")):
        if row[key] is None:
            continue
        total, published, cpu = row[key][0], row[key][1], row[key][-1]
        print(f"  {label:<58}{total:>9.3f}{gb / total:>8.2f}{published:>11.3f}{cpu:>12.2f}")
    print("  (a)'s stages, s after the publish started: " + ", ".join(f"{stage} {at:.3f}" for stage, at in
                                                                      row["relay"][2].items()))
    alone, published, cpu = row["relay alone"]
    print(f"  (a) with no reader on host B: host B's copy advertised at {alone:.3f} s ({gb / alone:.2f} GB/s), publish "
          f"returned at {published:.3f} s, {cpu:.2f} CPU core-s")
    gap = row["relay"][0] / row["raw"][0]
    if row["torchstore"] is not None:
        speedup = row["torchstore"][0] / row["relay"][0]
        print(f"  (b)/(a) = {speedup:.2f}x (goal >= 10: {'met' if speedup >= 10 else 'MISSED'})")
    sent = gb * 1e9
    if row["link"] is not None:
        link_s = sent * 8 / (row["link"] * 1e9)
        print(f"  (a) / the link's time for the bytes sent ({sent / 1e9:.3f} GB at {row['link']:g} Gbit/s: "
              f"{link_s:.3f} s) = {row['relay'][0] / link_s:.2f}x (goal at 10 Gbit/s: <= 1.3)")
    print(f"  (a)/(c) = {gap:.2f}x (the raw stream of the whole version's bytes)")


async def main(args: argparse.Namespace) -> None:
    unavailable = namespaces_unavailable()
    if unavailable is not None:
        raise SystemExit(f"--hosts {args.hosts}: {unavailable}")
    relaunch_as_controller_host()  # Monarch must listen on this process's bridge address (forge.compat, 19)
    # Spawned processes import this module by name: give them the repository on their path.
    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    hosts = SimulatedHosts(count=args.hosts)
    try:
        hosts.start()
        try:
            await run(args, hosts)
        finally:
            await provisioner.shutdown()
    finally:
        hosts.close()
