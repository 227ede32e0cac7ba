"""forge: asynchronous RL post-training of language models on Monarch actors."""

import os as _os

from forge.native import setup as _setup_native_libraries

# Monarch gives a process 60 s to report its state before declaring it dead; on a busy 2-core host an idle
# process (torchstore's storage volume) has missed that while alive. A process that really dies is still
# reported at once by its exit. A value set by the user wins.
_os.environ.setdefault("HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE", "300s")

# With a stderr tail configured, Monarch 0.1.2's host process pipes every child's stdout/stderr and forwards
# the lines through its log sender, whose first use can deadlock the host's runtime (a re-entrant lock in
# hyperactor's type-name cache, `Named::typename` for nested generic types; seen in about 1 of 3 starts on a
# 2-core host, the whole job then hangs). With no tail the children inherit the controller's stdio instead:
# their output still reaches the console, and forge reports process deaths itself.
_os.environ.setdefault("HYPERACTOR_MESH_TAIL_LOG_LINES", "0")

# On CPU-only hosts Monarch's native module needs stand-ins for the CUDA driver and verbs libraries;
# set them up before anything imports monarch (a no-op on GPU hosts).
_setup_native_libraries(strict=False)

__version__ = "0.1.0"
