"""The OpenAI-compatible online-RL gateway: `python -m apps.gateway --config configs/gateway_tiny.yaml`
(see docs/serving.md)."""
