"""Runnable forge apps: `python -m apps.grpo` and small examples of custom apps (apps.examples)."""
