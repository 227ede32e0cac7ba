"""Runnable forge apps (`python -m apps.grpo`, `apps.sft`, `apps.eval`, `apps.server`, `apps.gateway`) and small
examples of custom apps (apps.examples).

An app folder imports no other app. What the apps share lives here, beside them: `app_config.py`,
`config_reference.py`, `run_checkpoints.py`, `held_out/` (the held-out evaluator), `http/` (what the HTTP apps share)
and `warm_start/`; tests/test_layers.py names these and refuses any other import between app folders, and any loop.
"""
