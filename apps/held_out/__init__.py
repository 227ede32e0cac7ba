"""The held-out evaluator the apps share: a task's held-out problems through a sampler, each sample scored or counted
as failed, and the task's scores (pass@k, mean@k).

- evaluate.py: `evaluate_task`, at most `concurrency` problems in flight, a progress line now and then; the reward on
  a thread under its timeout; `evaluate_greedy`, the greedy figure (n=1) the training apps report.
- samplers.py: forge's generator service, a prompt's completions or a multi-turn task's episodes played against its
  environments; `BatchingSampler`, a sampler's concurrent calls as one batch.
- scores.py: pass@k (unbiased) and mean@k over a task's problems, failed samples left out and counted.

apps.eval reports with it (and adds an OpenAI-compatible endpoint's sampler); apps.sft and apps.grpo measure their
held-out figures with it, the warm start its accuracy (a sampler over its in-process model), and the REST client's
example its held-out accuracy (a sampler over the server's sampling; no torch here).
"""
