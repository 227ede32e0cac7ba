"""TRL's GRPOTrainer on forge's default job (configs/grpo_tiny.yaml), for bench/trl_side_by_side.py.

Runs in TRL's own environment (made by bench/trl_side_by_side.py; TRL is never a forge dependency) and imports
from forge only `rl.tasks.arithmetic` (plain Python): the same prompts' distribution, reward and held-out set.
The mapping of forge's settings to TRL's (one forge step = one generation batch of 64 prompts x 16 samples =
`steps_per_generation` TRL optimizer steps):

    rollout.group_size 16            num_generations=16
    64 prompts x 16 a step           per_device_train_batch_size=256, steps_per_generation=4,
    trainer.minibatches 4              gradient_accumulation_steps=1 (4 optimizer steps per generation)
    rollout.temperature 0.7          temperature=0.7, top_k=0, top_p=1 (sampling and the loss's log-probs)
    rollout.max_tokens 4             max_completion_length=4
    loss grpo, clip_eps 0.2          loss_type="grpo", epsilon=0.2, beta=0, scale_rewards="group"
    trainer.lr 3e-4 constant         learning_rate=3e-4, lr_scheduler_type="constant", warmup_steps=0
    AdamW (0.9, 0.999), eps 1e-8     adam_beta1/2, adam_epsilon, weight_decay=0, optim="adamw_torch"
    trainer.max_grad_norm 1          max_grad_norm=1

Held-out accuracy: greedy, 500 prompts, 4 tokens, exact match up to EOS, every `--eval-every` forge steps, with
the training clock stopped. Prints one JSON object: the evaluations, with each one's training seconds.

    python bench/trl_grpo_run.py --model PATH --seed 0 --steps 150 --eval-every 25 [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rl.tasks.arithmetic import ArithmeticTask  # noqa: E402

GROUP, PROMPTS, MINIBATCHES = 16, 64, 4


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task: ArithmeticTask, max_tokens: int) -> float:
    problems = task.held_out()
    training = model.training
    model.eval()
    encoded = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False)
    out = model.generate(**encoded, do_sample=False, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model.train(training)
    hits = 0.0
    for ids, problem in zip(out[:, encoded.input_ids.shape[1]:].tolist(), problems):
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id)]
        hits += task.reward(tokenizer.decode(ids, skip_special_tokens=True), problem.answer)
    return hits / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150, help="forge steps (generation batches)")
    parser.add_argument("--eval-every", type=int, default=25, help="forge steps between held-out evaluations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()

    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    task = ArithmeticTask(seed=args.seed, num_digits=2, held_out=500, reverse_answer=True)
    problems = task.sample_prompts(args.steps * PROMPTS, random.Random(f"{args.seed}-trl"))
    dataset = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                          "answer": [p.answer for p in problems]})

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [task.reward(c, a) for c, a in zip(completions, answer)]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    updates_per_step = MINIBATCHES
    evals: list[dict[str, float]] = []

    class Clock(TrainerCallback):
        """Training seconds (evaluations excluded) and greedy held-out accuracy every `eval_every` forge steps."""

        def __init__(self) -> None:
            self.start, self.paused, self.reward = 0.0, 0.0, float("nan")

        def on_log(self, _args, state, control, logs=None, **kw: object) -> None:
            if logs and "reward" in logs:
                self.reward = float(logs["reward"])

        def on_train_begin(self, *_: object, **kw: object) -> None:
            evals.append({"step": 0, "train_s": 0.0, "accuracy": greedy_accuracy(model, tokenizer, task,
                                                                                 args.max_tokens)})
            print(json.dumps(evals[-1]), file=sys.stderr, flush=True)
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, *_: object, **kw: object) -> None:
            if state.global_step % (args.eval_every * updates_per_step):
                return
            train_s = time.perf_counter() - self.start - self.paused
            tick = time.perf_counter()
            evals.append({"step": state.global_step // updates_per_step, "train_s": train_s,
                          "accuracy": greedy_accuracy(model, tokenizer, task, args.max_tokens),
                          "reward": self.reward})
            print(json.dumps(evals[-1]), file=sys.stderr, flush=True)
            self.paused += time.perf_counter() - tick

    with tempfile.TemporaryDirectory(prefix="forge-trl-") as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, fp16=False, seed=args.seed, data_seed=args.seed,
            per_device_train_batch_size=PROMPTS * GROUP // MINIBATCHES, gradient_accumulation_steps=1,
            steps_per_generation=MINIBATCHES, num_generations=GROUP, num_iterations=1,
            max_completion_length=args.max_tokens, temperature=args.temperature, top_k=0, top_p=1.0,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
            loss_type="grpo", epsilon=0.2, beta=0.0, scale_rewards="group",
            max_steps=args.steps * updates_per_step, logging_steps=updates_per_step, report_to="none",
            save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Clock()])
        trainer.train()
    print(json.dumps({"versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                   "torch": torch.__version__}, "threads": args.threads, "evals": evals}))


if __name__ == "__main__":
    main()
