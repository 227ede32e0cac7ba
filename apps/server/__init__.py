"""The REST training service: `python -m apps.server --config configs/server_tiny.yaml` (see docs/serving.md)."""
