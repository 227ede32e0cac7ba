"""forge: asynchronous RL post-training of language models on Monarch actors.

Importing forge (or `apps.server.client`, `rl.types`, `losses`) changes nothing in your process: Monarch is
set up by the modules that use it (`forge.compat`), and a job's environment when it starts.
"""

__version__ = "0.1.0"
