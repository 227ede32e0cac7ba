"""The held-out evaluator the apps share: a task's held-out problems through a sampler, each sample scored or counted
as failed, and the task's scores (pass@k, mean@k).

- evaluate.py: `evaluate_task`, at most `concurrency` problems in flight, a progress line now and then; the reward on
  a thread under its timeout.
- samplers.py: forge's generator service, a prompt's completions or a multi-turn task's episodes played against its
  environments.
- scores.py: pass@k (unbiased) and mean@k over a task's problems, failed samples left out and counted.

apps.eval reports with it (and adds an OpenAI-compatible endpoint's sampler); apps.sft measures its held-out accuracy
with it.
"""
