"""forge.compat: importing forge changes nothing in the user's process; a job's start sets up Monarch."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap

import pytest

from forge import compat

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process

PROBE = """
import json, os, sys
before = dict(os.environ)
import {modules}
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(json.dumps({{"changed": changed, "monarch": sorted(m for m in sys.modules if m.split('.')[0] in ("monarch", "torchstore"))}}))
"""


def probe(modules: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(modules=modules)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_importing_forge_libraries_changes_no_environment_and_loads_no_monarch():
    modules = "forge, apps.server.client, rl.types, rl.sampling, losses, losses.grpo"
    result = probe(modules)
    assert result["changed"] == [], f"import {modules} changed {result['changed']}"
    assert result["monarch"] == [], f"import {modules} loaded {result['monarch'][:5]}"


def test_a_job_start_sets_the_job_environment_without_overriding_the_users():
    script = textwrap.dedent("""
        import json, os
        os.environ["HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE"] = "123s"
        from forge import compat
        compat.configure_job_environment()
        print(json.dumps({k: os.environ.get(k) for k in compat.JOB_ENVIRONMENT}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    values = json.loads(out.stdout.strip().splitlines()[-1])
    assert values["HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE"] == "123s"  # the user's value wins
    assert values["HYPERACTOR_CODEC_MAX_FRAME_LENGTH"] == compat.JOB_ENVIRONMENT["HYPERACTOR_CODEC_MAX_FRAME_LENGTH"]



def test_the_spawn_deadline_forge_raises_is_the_one_monarch_reads():
    # compat 32: HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE bounds a proc mesh's spawn. Set tiny (the user's value wins),
    # a spawn must fail on it; with forge's value a mesh has 120 s to come up.
    assert compat.JOB_ENVIRONMENT["HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE"] == "120s"
    script = textwrap.dedent("""
        import asyncio, os
        os.environ["HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE"] = "1ms"
        from forge import compat
        compat.configure_job_environment()
        from monarch.actor import this_host

        async def main():
            try:
                await this_host().spawn_procs(per_host={"procs": 1}, name="late").initialized
                print("spawned")
            except Exception as e:
                print("refused:", e)
        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "refused: error spawning proc mesh: statuses: Timeout(" in out.stdout, out.stdout + out.stderr[-2000:]


async def test_keys_with_prefix_filters_what_torchstore_returns():
    class FakeStore:
        async def keys(self, prefix: str | None = None) -> list[str]:
            return ["policy/v1/w", "policy/v2/w", "ref/v1/w"]

    assert await compat.keys_with_prefix(FakeStore(), "policy/") == ["policy/v1/w", "policy/v2/w"]


async def test_a_reported_endpoint_error_of_a_sync_method_is_raised_again_in_the_caller():
    def broken(self, x):
        raise ValueError(f"bad x={x}")

    wrapped = compat.report_endpoint_errors("Thing", "broken", broken)
    assert inspect.iscoroutinefunction(wrapped)  # Monarch 0.7 refuses an actor mixing sync and async endpoints
    reported = await wrapped(None, 3)
    with pytest.raises(compat.EndpointError, match=r"Thing.broken raised ValueError: bad x=3"):
        compat.raise_if_failed(reported)
    assert compat.raise_if_failed(5) == 5
