"""GRPO in one plain PyTorch loop (no actors, no weight store), on the reasoning-gym task apps.sft and apps.grpo train
in docs/sft.md: a cross-check that what apps.grpo does to that SFT export is GRPO's doing, not forge's.

    python -m bench.plain_grpo_check --model runs/sft_reasoning_gym/seed0/hf_model [--lr 1e-4] [--temperature 1.0]
        [--steps 40] [--prompts 16] [--group-size 8] [--eval-every 20] [--train-on train|unseen] [--reward task|exact]
        [--size 20000] [--held-out 200]

Each step samples `--group-size` completions for `--prompts` training prompts (transformers' generate), scores them
with the task's reward (or 1 for the exact word only, `--reward exact`), takes group-relative advantages
(`losses.advantages.group_advantages`) and one AdamW step on the on-policy policy-gradient loss (per-sequence token
mean, as apps.grpo's). Every `--eval-every` steps it prints the held-out mean reward and exact accuracy, greedy
and sampled at the training temperature.
`--train-on unseen` trains on words SFT never saw (half of a larger held-out draw) and evaluates on the other half.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from losses.advantages import group_advantages
from rl.tasks.reasoning_gym import ReasoningGymTask

OPTIONS = {"min_word_len": 3, "max_word_len": 5}  # configs/sft_reasoning_gym.yaml's task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--train-on", choices=["train", "unseen"], default="train")
    parser.add_argument("--reward", choices=["task", "exact"], default="task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=20000, help="training problems (the configs' task.size)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out problems (the configs' task.held_out)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    task = ReasoningGymTask("spell_backward", options=OPTIONS, seed=args.seed, size=args.size,
                            held_out=15 * args.held_out if args.train_on == "unseen" else args.held_out,
                            tokenizer=tokenizer)  # 15x: about 1.9k of 3k drawn are words SFT never saw
    rng = random.Random(args.seed)
    held_out = task.held_out()
    sample = lambda: task.sample_prompts(args.prompts, rng)  # noqa: E731
    if args.train_on == "unseen":
        unseen = task.held_out()
        held_out = unseen[1::2][: args.held_out]
        sample = lambda: [rng.choice(unseen[::2]) for _ in range(args.prompts)]  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"eval 0: {evaluate(model, tokenizer, task, held_out, args.temperature)}", flush=True)
    for step in range(1, args.steps + 1):
        start = time.monotonic()
        problems = sample()
        prompts = [p.prompt for p in problems for _ in range(args.group_size)]
        prompt_ids, prompt_mask, completions = generate(model, tokenizer, prompts, args.temperature)
        texts, completion_mask = decode(tokenizer, completions)
        rewards = torch.tensor([task.reward(text, problems[i // args.group_size].answer) for i, text in enumerate(texts)])
        if args.reward == "exact":
            rewards = (rewards == 1.0).float()
        advantages, _ = group_advantages(rewards, torch.arange(len(prompts)) // args.group_size)
        ids = torch.cat([prompt_ids, completions], 1)
        logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask, completion_mask.long()], 1)).logits
        logprobs = torch.log_softmax(logits[:, prompt_ids.shape[1] - 1 : -1] / args.temperature, -1)
        logprobs = logprobs.gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        per_sequence = (logprobs * completion_mask).sum(1) / completion_mask.sum(1).clamp(min=1)
        loss = -(advantages * per_sequence).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        print(f"step {step}: sampled reward {rewards.mean():.3f}, exact {(rewards == 1).float().mean():.3f}, "
              f"{time.monotonic() - start:.1f} s", flush=True)
        if step % args.eval_every == 0:
            print(f"eval {step}: {evaluate(model, tokenizer, task, held_out, args.temperature)}", flush=True)


def generate(model, tokenizer, prompts: list[str], temperature: float | None):
    """Left-padded prompt ids and mask, and the sampled (or greedy: temperature None) completion ids."""
    encoded = [tokenizer(p).input_ids for p in prompts]
    width = max(map(len, encoded))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else \
        {"do_sample": False}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, pad_token_id=pad,
                             eos_token_id=tokenizer.eos_token_id, **sampling)
    return ids, mask, out[:, width:]


def decode(tokenizer, completions: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """Each completion's text up to its EOS, and a mask of its tokens through the EOS."""
    texts, mask = [], torch.zeros(completions.shape)
    for i, row in enumerate(completions.tolist()):
        end = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
        texts.append(tokenizer.decode(row[:end]))
        mask[i, : end + 1] = 1
    return texts, mask


def evaluate(model, tokenizer, task: ReasoningGymTask, problems: list, temperature: float) -> str:
    """The held-out mean reward and exact share, greedy and sampled at the training temperature (4 samples each)."""
    model.eval()
    greedy, sampled = held_out_rewards(model, tokenizer, task, problems, None), []
    for _ in range(4):
        sampled += held_out_rewards(model, tokenizer, task, problems, temperature)
    model.train()
    return (f"held-out greedy mean reward {mean(greedy):.3f}, exact {exact_share(greedy):.1%}; sampled at "
            f"{temperature} {mean(sampled):.3f}, exact {exact_share(sampled):.1%} ({len(greedy)} prompts)")


def held_out_rewards(model, tokenizer, task: ReasoningGymTask, problems: list, temperature: float | None
                     ) -> list[float]:
    rewards = []
    for i in range(0, len(problems), 64):
        batch = problems[i : i + 64]
        texts, _ = decode(tokenizer, generate(model, tokenizer, [p.prompt for p in batch], temperature)[2])
        rewards += [task.reward(text, p.answer) for text, p in zip(texts, batch)]
    return rewards


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def exact_share(rewards: list[float]) -> float:
    return sum(r == 1.0 for r in rewards) / len(rewards)

if __name__ == "__main__":
    main()
