"""A module that cannot be imported: its own code fails (tests/rl/tasks/test_environment.py)."""

import no_such_dependency_of_the_environment  # noqa: F401
