"""`python -m apps.eval`: a model's held-out accuracy on forge tasks, with pass@k and mean@k (docs/eval.md).

    python -m apps.eval --config configs/eval_tiny.yaml run_dir=runs/grpo_tiny sampling.num_samples=8

cli.py checks the command line before anything heavy is imported; config.py is the schema; sources.py finds what
to evaluate (an HF folder, a step checkpoint, every step checkpoint of a run, an OpenAI-compatible endpoint);
weights.py turns a step checkpoint into Hugging Face weights; samplers.py asks an endpoint; the shared held-out
evaluator (apps/held_out/) asks the generator service, plays each task's held-out prompts under a concurrency bound and
scores them (pass@k and mean@k); report.py prints the table and writes the JSON and the plot; main.py runs it all.
"""
