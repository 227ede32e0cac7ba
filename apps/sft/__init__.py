"""`python -m apps.sft`: supervised fine-tuning through apps.grpo's TorchTitan trainer actor (docs/sft.md)."""
