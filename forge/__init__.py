"""forge: asynchronous RL post-training of language models on Monarch actors."""

from forge.native import setup as _setup_native_libraries

# On CPU-only hosts Monarch's native module needs stand-ins for the CUDA driver and verbs libraries;
# set them up before anything imports monarch (a no-op on GPU hosts).
_setup_native_libraries(strict=False)

__version__ = "0.1.0"
