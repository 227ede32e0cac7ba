"""`make test` runs each module marked `monarch` in its own pytest process: a module that starts Monarch processes
(an actor, a service, a weight store) or an app must carry the mark, or its runtime state leaks into the modules
that run after it in the shared process."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Spawning an actor or service, starting a weight store, or running or importing an app's entry point.
STARTS_PROCESSES = re.compile(r"as_actor|as_service|start_weight_store|apps\.(grpo|examples|server|gateway)[^._a-z]"
                              r"|apps\.(grpo|examples|server|gateway)\.(main|launch|runtime|client)")
MARKED = re.compile(r"^pytestmark = \[?pytest\.mark\.monarch\b", re.MULTILINE)


def test_every_module_that_starts_monarch_processes_is_marked_monarch():
    unmarked = sorted(str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py") if path != Path(__file__)
                      if STARTS_PROCESSES.search(path.read_text()) and not MARKED.search(path.read_text()))
    assert not unmarked, f"add `pytestmark = pytest.mark.monarch` to {unmarked}"


def test_the_check_sees_a_module_that_spawns_an_actor(tmp_path):
    source = "async def test_x():\n    await EchoActor.options(procs=1).as_actor()\n"
    assert STARTS_PROCESSES.search(source) and not MARKED.search(source)
    assert MARKED.search("import pytest\n\npytestmark = pytest.mark.monarch\n" + source)
