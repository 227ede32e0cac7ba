"""Asynchronous GRPO (`python -m apps.grpo --config configs/grpo_tiny.yaml`)."""
