"""forge: asynchronous RL post-training of language models on Monarch actors."""

import os as _os

from forge.native import setup as _setup_native_libraries

# Monarch gives a process 60 s to report its state before declaring it dead; on a busy 2-core host an idle
# process (torchstore's storage volume) has missed that while alive. A process that really dies is still
# reported at once by its exit. A value set by the user wins.
_os.environ.setdefault("HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE", "300s")

# torchstore sets this (large RPC frames) on import and prints a warning each time; set it first, quietly.
# Quiet matters: see `forge.provisioner.ProcAgent` on child output.
_os.environ.setdefault("HYPERACTOR_CODEC_MAX_FRAME_LENGTH", "910737418240")

# On CPU-only hosts Monarch's native module needs stand-ins for the CUDA driver and verbs libraries;
# set them up before anything imports monarch (a no-op on GPU hosts).
_setup_native_libraries(strict=False)

__version__ = "0.1.0"
