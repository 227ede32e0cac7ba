"""forge's log records read as written, whatever Monarch 0.7 does to them (forge.compat, 28)."""

import logging
from types import SimpleNamespace

from forge import compat
from monarch._src.actor import actor_mesh


def test_a_record_seen_by_two_handlers_keeps_its_message():
    token = actor_mesh._context.set(SimpleNamespace(actor_instance="<root>"))  # as in the controller
    try:
        compat.plain_log_messages()
        record = logging.LogRecord("forge", logging.INFO, __file__, 1, "step %d done", (3,), None)
        for _ in range(2):  # two handlers, each with Monarch's filter
            actor_mesh._ActorFilter().filter(record)
    finally:
        actor_mesh._context.reset(token)
    assert record.getMessage() == "step 3 done"
