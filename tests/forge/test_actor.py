"""Actors on provisioned meshes: placement, environment, setup, metrics, and clean shutdown."""

import os

import psutil
import pytest

from forge.actor import EndpointError, ForgeActor
from forge.metrics import drain_local, merge_partials
from forge.provisioner import Provisioner, get_provisioner
from tests.support import EchoActor, SyncEndpointActor

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)


async def test_two_process_actor_gets_distributed_environment_and_setup():
    actor = await EchoActor.options(procs=2, mesh_name="env").as_actor(tag="env")
    try:
        infos = list((await actor.info.call()).values())
        assert [i["setup_done"] for i in infos] == [True, True]
        envs = [i["env"] for i in infos]
        assert sorted(e["RANK"] for e in envs) == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert len({e["MASTER_PORT"] for e in envs}) == 1  # one rendezvous for the mesh
        assert {e["LOCAL_RANK"] for e in envs} == {"0", "1"}
        assert all(e["CUDA_VISIBLE_DEVICES"] == "" for e in envs)  # no GPU asked for: none visible
        assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}
    finally:
        await ForgeActor.shutdown(actor)


async def test_an_endpoint_may_return_a_bare_tensor():
    """A reply is checked for reported failures; a tensor's own `.values` must not be taken for a mesh's."""
    import torch

    actor = await EchoActor.options(mesh_name="tensor").as_actor()
    try:
        assert torch.equal(await actor.identity.call_one(torch.arange(3.0)), torch.arange(3.0))
        (only,) = (await actor.identity.call(torch.ones(2))).values()
        assert torch.equal(only, torch.ones(2))
    finally:
        await ForgeActor.shutdown(actor)


async def test_a_call_that_awaits_does_not_hold_up_the_next_one():
    """Monarch 0.7 serves a plain endpoint's calls one after another; a ForgeActor serves them concurrently (an
    environment host's blocked step must not hold up the other episodes' calls)."""
    import asyncio

    actor = await EchoActor.options(mesh_name="gate").as_actor()
    try:
        waiting = asyncio.ensure_future(actor.wait_until_opened.call_one())
        await asyncio.sleep(0.5)
        await asyncio.wait_for(actor.open.call_one(), timeout=30)
        assert await asyncio.wait_for(waiting, timeout=30) == "opened"
    finally:
        await ForgeActor.shutdown(actor)


async def test_an_actor_with_sync_endpoints_serves_them_and_reports_their_errors():
    """Monarch 0.7 refuses an actor mixing sync and async endpoints; a ForgeActor's run as async ones."""
    actor = await SyncEndpointActor.options(mesh_name="sync").as_actor()
    try:
        assert await actor.half.call_one(42) == 21
        with pytest.raises(EndpointError, match=r"SyncEndpointActor.half raised ValueError: 3 is odd"):
            await actor.half.call_one(3)
    finally:
        await ForgeActor.shutdown(actor)


async def test_metrics_recorded_in_actors_are_reduced_by_the_controller():
    actor = await EchoActor.options(procs=2, mesh_name="metrics").as_actor()
    try:
        drain_local()
        await actor.record.call("loss", 2.0, "mean")
        await actor.record.call("tokens", 5.0, "sum")
        await actor.slice(procs=0).record.call_one("loss", 5.0, "mean")
        merged = merge_partials(await get_provisioner().collect_metrics())
        assert merged["loss"] == pytest.approx(3.0)  # (2 + 2 + 5) / 3 across both processes
        assert merged["tokens"] == 10.0
        assert merge_partials(await get_provisioner().collect_metrics()) == {}  # drained: each step starts empty
    finally:
        await ForgeActor.shutdown(actor)


async def test_shutdown_leaves_no_child_processes():
    actor = await EchoActor.options(procs=2, mesh_name="bye").as_actor()
    pids = [i["pid"] for i in (await actor.info.call()).values()]
    await ForgeActor.shutdown(actor)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_asking_for_more_gpus_than_exist_fails_before_spawning():
    provisioner = Provisioner(gpus=[0, 1])
    before = set(p.pid for p in psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match=r"asks for 3 GPUs .* only 2 of 2 GPUs on this host are free: \[0, 1\]"):
        await provisioner.get_proc_mesh(3, with_gpus=True, mesh_name="greedy")
    assert set(p.pid for p in psutil.Process().children(recursive=True)) <= before


async def test_each_process_sees_its_own_set_of_gpus():
    """What a tensor-parallel vLLM replica needs: one process, several GPUs (ids set up, not used, on CPU)."""
    provisioner = Provisioner(gpus=[0, 1, 2, 3, 4])
    try:
        mesh = await provisioner.get_proc_mesh(2, with_gpus=True, gpus_per_proc=2, mesh_name="tp")
        echo = mesh.procs.spawn("echo", EchoActor)
        envs = sorted((i["env"] for i in (await echo.info.call()).values()), key=lambda e: e["RANK"])
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
        assert mesh.gpus == [0, 1, 2, 3] and provisioner._free_gpus == [4]
        with pytest.raises(ValueError, match=r"asks for 2 GPUs \(with_gpus=True, procs=1, gpus_per_proc=2\) but only 1"):
            await provisioner.get_proc_mesh(1, with_gpus=True, gpus_per_proc=2, mesh_name="tp2")
    finally:
        await provisioner.shutdown()
    assert provisioner._free_gpus == [0, 1, 2, 3, 4]  # given back


async def test_multi_host_request_without_host_mesh_is_refused():
    with pytest.raises(ValueError, match=r"hosts=2: more than one host needs a Monarch host mesh"):
        await Provisioner(gpus=[]).get_proc_mesh(1, hosts=2)
