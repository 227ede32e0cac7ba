"""Monarch's supervision events reach the mesh forge provisioned (by the failed actor mesh's name)."""

from __future__ import annotations

from dataclasses import dataclass

from forge.provisioned_mesh import MeshFailure, ProvisionedMesh, actor_mesh_name
from forge.provisioner import Provisioner


@dataclass
class Failure:
    """What Monarch 0.7 hands the fault hook: the name of the actor mesh that failed."""

    mesh_name: str

    def __str__(self) -> str:
        return f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks=[0], event=...Killed(sig=9))"


def test_a_failure_goes_to_the_proc_mesh_of_the_failed_actor_mesh_and_monarchs_log_forwarder_is_ignored():
    provisioner = Provisioner(gpus=[])
    seen: list[MeshFailure] = []
    for name in ("gen-r0-1", "gen-r0-10"):
        provisioner.meshes[name] = ProvisionedMesh(name, None, None, [], [], on_failure=seen.append)

    provisioner.failures.on_supervision_event(Failure("logger-wzadmHpQAt"))  # Monarch's own actor on the same process
    provisioner.failures.on_supervision_event(Failure(actor_mesh_name("gen-r0-10", "echoactor") + "-FNaSvPAxDvh"))
    assert [event.mesh_name for event in seen] == ["gen-r0-10"]
    assert provisioner.failures.fatal_failures == []

    provisioner.failures.on_supervision_event(Failure("storage_volumes-Q1"))  # on no mesh of ours: the job's failure
    assert [event.mesh_name for event in provisioner.failures.fatal_failures] == ["unknown"]


def test_monarchs_report_names_the_process_of_this_host_that_is_gone():
    import subprocess
    import sys

    from forge.processes import ProcessId

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    provisioner = Provisioner(gpus=[])
    mesh = ProvisionedMesh("trainer-1", None, None, [], [ProcessId("here", gone.pid, True)])
    provisioner.meshes[mesh.name] = mesh
    provisioner.failures.on_supervision_event(Failure(actor_mesh_name("trainer-1", "proc_agent") + "-x"))
    (fatal,) = provisioner.failures.fatal_failures
    assert fatal.mesh_name == "trainer-1"
    assert fatal.message.startswith(f"process {gone.pid} of mesh 'trainer-1' exited (MeshFailure(")
