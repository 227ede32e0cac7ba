"""Services over real Monarch processes: routing, sessions, fanout, and replicas dying mid-stream."""

import asyncio
import os
import signal
import time

import pytest

from forge.actor import ForgeActor
from forge.provisioner import get_provisioner
from forge.service import NoHealthyReplicaError
from tests.support import EchoActor

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)


@pytest.fixture(scope="module")
async def service():
    svc = await EchoActor.options(num_replicas=2, mesh_name="svc").as_service(tag="svc")
    yield svc
    await svc.stop()


async def _pid(svc, value=0) -> int:
    return (await svc.echo.route(value))[1]


async def test_round_robin_spreads_calls_over_replicas(service):
    pids = [await _pid(service, i) for i in range(4)]
    assert len(set(pids)) == 2
    assert pids[0] == pids[2] and pids[1] == pids[3]


async def test_setup_endpoint_ran_once_per_replica(service):
    infos = await service.info.fanout()
    assert [i["setup_done"] for i in infos] == [True, True]


async def test_fanout_reaches_every_replica(service):
    results = await service.echo.fanout("hello")
    assert sorted(r[1] for r in results) == sorted(r.mesh.pids[0] for r in service.replicas)
    assert all(r[2] == "hello" for r in results)


async def test_session_keeps_caller_on_one_replica(service):
    async with service.session():
        pids = {await _pid(service, i) for i in range(5)}
    assert len(pids) == 1
    # Concurrent sessions are independent: each task gets its own pinning.
    async def in_session():
        async with service.session():
            return {await _pid(service, i) for i in range(3)}

    results = await asyncio.gather(*(in_session() for _ in range(4)))
    assert all(len(r) == 1 for r in results)


async def test_user_exception_passes_through_and_replica_stays_healthy(service):
    with pytest.raises(Exception, match="bad input 42"):
        await service.fail.route("bad input 42")
    assert all(r.healthy for r in service.replicas)


async def test_a_failure_monarch_reports_on_its_own_thread_is_handled_in_the_services_context(service):
    """Monarch calls a mesh's failure callback on its thread, whose context is not the controller's; the restart
    it starts spawns on `this_host()`, which Monarch 0.7 looks up in the current context (a second restart
    failed with "'NoneType' object has no attribute 'slice'" when it ran in Monarch's)."""
    import contextvars
    import threading
    from types import SimpleNamespace

    where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="the service's context")
    seen: list[str] = []
    marked = asyncio.Event()
    loop = asyncio.get_running_loop()
    original = service._mark_unhealthy

    def mark_unhealthy(index: int, reason: str, generation: int) -> None:
        seen.append(where.get())
        loop.call_soon(marked.set)

    def monarchs_thread() -> None:
        where.set("Monarch's thread")
        service._failure_from_monitor(0, service.replicas[0].generation, SimpleNamespace(message="a test report"))

    service._mark_unhealthy = mark_unhealthy
    try:
        thread = threading.Thread(target=monarchs_thread)
        thread.start()
        thread.join()
        await asyncio.wait_for(marked.wait(), timeout=10)
    finally:
        service._mark_unhealthy = original
    assert seen == ["the service's context"]


async def test_least_loaded_routing_prefers_idle_replica():
    svc = await EchoActor.options(num_replicas=2, routing="least_loaded", mesh_name="ll").as_service()
    try:
        busy = asyncio.ensure_future(svc.echo.route("slow", delay=2.0))
        await asyncio.sleep(0.3)
        busy_pid = next(r.mesh.pids[0] for r in svc.replicas if r.in_flight)
        quick = [await _pid(svc, i) for i in range(3)]
        assert busy_pid not in quick
        await busy
    finally:
        await svc.stop()


async def test_replica_killed_mid_stream_calls_succeed_and_replica_returns():
    svc = await EchoActor.options(num_replicas=2, mesh_name="kill").as_service()
    try:
        victim = svc.replicas[0].mesh.pids[0]
        calls = [asyncio.ensure_future(svc.echo.route(i, delay=0.5)) for i in range(12)]
        await asyncio.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.gather(*calls)
        assert [r[2] for r in results] == list(range(12))  # every call answered, none lost
        deadline = time.monotonic() + 120
        while not (all(r.healthy for r in svc.replicas) and svc.replicas[0].restarts == 1):
            assert time.monotonic() < deadline, "replica was not restarted"
            await asyncio.sleep(0.5)
        assert svc.replicas[0].mesh.pids[0] != victim
        pids = {await _pid(svc, i) for i in range(4)}
        assert len(pids) == 2 and victim not in pids
        assert not get_provisioner().failures.fatal_failures
    finally:
        await svc.stop()


async def test_all_replicas_dead_gives_clear_error_without_hanging():
    svc = await EchoActor.options(num_replicas=1, mesh_name="dead").as_service()
    svc.max_restarts = 0
    try:
        os.kill(svc.replicas[0].mesh.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(NoHealthyReplicaError, match="no healthy replica left"):
            for i in range(100):
                await svc.echo.route(i)
                await asyncio.sleep(0.1)
        assert time.monotonic() - start < 30
    finally:
        await svc.stop()


def test_service_rejects_unknown_endpoint(service):
    with pytest.raises(AttributeError, match="EchoActor has no endpoint 'ecoh'"):
        service.ecoh


def test_options_validate_placement():
    with pytest.raises(ValueError, match="num_replicas=0: must be >= 1"):
        EchoActor.options(num_replicas=0)
    with pytest.raises(ValueError, match="routing='random'"):
        EchoActor.options(routing="random")
    configured = EchoActor.options(procs=2, num_replicas=3)
    assert issubclass(configured, ForgeActor) and configured.placement.procs == 2
    assert EchoActor.placement.procs == 1  # the original class is untouched
