"""GRPO in one plain PyTorch loop (no actors, no weight store), on the reasoning-gym task apps.sft and apps.grpo
train in docs/sft.md (its runs: docs/benchmarks.md, "Supervised fine-tuning"): a cross-check that what apps.grpo
does to that SFT export is GRPO's doing, not forge's.

    python -m bench.plain_grpo_check --model runs/sft_reasoning_gym/seed0/hf_model [--lr 1e-4] [--temperature 1.0]
        [--steps 40] [--prompts 16] [--group-size 8] [--eval-every 20] [--train-on train|unseen] [--reward task|exact]
        [--credit sequence|letters|positions] [--size 20000] [--held-out 200]

Each step samples `--group-size` completions for `--prompts` training prompts (transformers' generate), scores them
with the task's reward (or 1 for the exact word only, `--reward exact`), takes group-relative advantages
(`losses.advantages.group_advantages`) and one AdamW step on the on-policy policy-gradient loss (per-sequence token
mean, as apps.grpo's). Every `--eval-every` steps it prints the held-out mean reward and exact accuracy, greedy
and sampled at the training temperature.
`--train-on unseen` trains on words SFT never saw (half of a larger held-out draw) and evaluates on the other half.
`--credit` gives each token its own advantage instead of its sequence's (`process_advantages`): one step per letter of
the word, rewarded 1 when the completion has the right letter there, then the exact word at the end.
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
    parser.add_argument("--credit", choices=["sequence", "letters", "positions"], default="sequence",
                        help="sequence: the sequence's advantage on every token (GRPO's outcome supervision); letters: "
                             "GRPO's process supervision over letter steps; positions: each letter against the "
                             "group's same letter, plus the exact word's advantage on every token")
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
        lengths = completion_mask.sum(1).clamp(min=1)
        if args.credit == "sequence":
            loss = -(advantages * ((logprobs * completion_mask).sum(1) / lengths)).mean()
        else:  # each token its own advantage
            words = [task.reference_answer(problems[i // args.group_size].answer) for i in range(len(prompts))]
            token_advantages = process_advantages(texts, words, args.group_size, logprobs.shape[1], args.credit)
            loss = -((token_advantages * logprobs * completion_mask).sum(1) / lengths).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        print(f"step {step}: sampled reward {rewards.mean():.3f}, exact {(rewards == 1).float().mean():.3f}, "
              f"{time.monotonic() - start:.1f} s", flush=True)
        if step % args.eval_every == 0:
            print(f"eval {step}: {evaluate(model, tokenizer, task, held_out, args.temperature)}", flush=True)


def letter_steps(text: str, word: str) -> list[tuple[int, float]]:
    """(the character, so the token, of the char-level tokenizer where the step ends; its reward) for each letter of
    `word` (1 when the completion's tagged answer has that letter there; a missing letter ends at the EOS, index
    len(text)), then the exact word, ending at the EOS."""
    start = text.find("<answer>")
    answer = "" if start < 0 else text[start + len("<answer>"):].partition("</answer>")[0].lower()
    steps = [(start + len("<answer>") + k if k < len(answer) else len(text), float(answer[k : k + 1] == letter))
             for k, letter in enumerate(word.lower())]
    return steps + [(len(text), float(answer.strip() == word.lower()))]


def process_advantages(texts: list[str], words: list[str], group_size: int, width: int, credit: str) -> torch.Tensor:
    """[len(texts), width] per-token advantages of groups of `group_size` consecutive completions.

    letters: GRPO's process supervision (arXiv:2402.03300, 4.1.3): every step reward of the group normalized by the
    mean and std of all of them, r~ = (r - mean) / std; token t's advantage is the sum of r~ over the steps ending at
    or after t. positions: the letter at position k against the group's letters at k, (r_k - mean_k) / std_k, on its
    own token, plus the exact word's group-normalized reward on every token up to the EOS."""
    advantages = torch.zeros(len(texts), width)
    for first in range(0, len(texts), group_size):
        group = [letter_steps(texts[i], words[i]) for i in range(first, first + group_size)]
        if credit == "letters":  # one group: every step of every completion
            rewards = torch.tensor([r for steps in group for _, r in steps])
            normalized = iter(group_advantages(rewards, torch.zeros(len(rewards), dtype=torch.long))[0].tolist())
            for row, steps in enumerate(group, first):
                for end, _ in steps:
                    advantages[row, : min(end, width - 1) + 1] += next(normalized)
            continue
        for k in range(len(group[0])):  # one group per step k: the group's k-th letters (the last: the word)
            rewards = torch.tensor([steps[k][1] for steps in group])
            normalized = group_advantages(rewards, torch.zeros(group_size, dtype=torch.long))[0]
            outcome = k == len(group[0]) - 1
            for row, steps in enumerate(group, first):
                end = min(steps[k][0], width - 1)
                advantages[row, slice(0, end + 1) if outcome else slice(end, end + 1)] += normalized[row - first]
    return advantages


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
