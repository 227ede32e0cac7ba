"""Small custom apps built from forge's building blocks, each runnable with `python -m apps.examples.<name>`."""
