"""An RL loop written only against the Tinker SDK (`tinker`), as Tinker's docs write one, pointed at forge's
training service: sample -> rewards -> forward_backward (ppo or importance_sampling) -> optim_step ->
save_weights_and_get_sampling_client.

    python -m apps.server --config configs/server_tiny.yaml http.api_key=tml-local-key reverse_answer=true &
    TINKER_API_KEY=tml-local-key python -m apps.examples.tinker_rl_loop --base-url http://127.0.0.1:8000

It trains a LoRA adapter to answer 2-digit additions and prints held-out greedy accuracy before and after. The task
is forge's tiny RL task (configs/grpo_tiny.yaml): answers written least-significant digit first, the server
warm-started on that order (`reverse_answer=true`); `--reverse-answer false` is "12+34=" -> "46" against a server
started without it, an order RL learns far more slowly on this model. Each step samples 64 prompts x 16, gives each
sample its group's normalised reward ((r - mean) / std, GRPO's) as the advantage of its tokens, shuffles the step's
datums across groups and takes 4 optimizer steps on them (a quarter each, the cookbook's num_substeps) with Tinker's
`ppo` loss. After the first substep the datums are off-policy (their log-probs are the sampler's, the weights have
moved): `--loss importance_sampling` weights them by an unclipped ratio and, over 4 substeps, learns far less
(docs/serving.md, "With the Tinker SDK"); with `--substeps 1` it is exactly on-policy."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

import tinker
from tinker import types

from rl.tasks.arithmetic import ArithmeticTask, Problem


LOSSES = ("ppo", "importance_sampling")


@dataclass
class LoopConfig:
    base_url: str | None = None  # None: $TINKER_BASE_URL
    base_model: str = "tiny"
    rank: int = 16
    steps: int = 45
    prompts_per_step: int = 64
    group_size: int = 16
    learning_rate: float = 2e-3
    substeps: int = 4  # optimizer steps per sampled batch (one slice of the datums each), as the cookbook's num_substeps
    loss: str = "ppo"  # Tinker's clipped loss (ratio in [0.8, 1.2]); "importance_sampling": the unclipped one
    shuffle: bool = True  # mix every group's datums across the substeps (as TRL and forge's GRPO); false: whole groups
    grad_clip_norm: float = 0.0  # Tinker's default: 0 = no clipping
    normalize_std: bool = True  # divide each group's centred rewards by their std (GRPO's); false: the cookbook's centring
    max_tokens: int = 4
    temperature: float = 1.0
    eval_prompts: int = 200
    reverse_answer: bool = True  # answers least-significant digit first ("12+34=" -> "64"): the server's reverse_answer
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "steps", "prompts_per_step", "substeps", "max_tokens", "eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)}: must be >= 1")
        if self.group_size < 2:
            raise ValueError(f"--group-size={self.group_size}: must be >= 2 (advantages are relative to the group)")
        if self.prompts_per_step % self.substeps:
            raise ValueError(f"--prompts-per-step={self.prompts_per_step}: must be a multiple of --substeps={self.substeps}")
        if self.learning_rate <= 0 or self.temperature <= 0:
            raise ValueError("--learning-rate and --temperature must be > 0")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss={self.loss!r}: must be one of {', '.join(LOSSES)}")


def accuracy(sampler: tinker.SamplingClient, tokenizer, task: ArithmeticTask, problems: list[Problem],
             max_tokens: int) -> float:
    """Greedy held-out accuracy of the sampler's weights (every prompt submitted, then every result read)."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(tokenizer.encode(p.prompt)), 1, params) for p in problems]
    texts = [tokenizer.decode(f.result().sequences[0].tokens) for f in futures]
    return sum(task.reward(text, p.answer) for text, p in zip(texts, problems)) / len(problems)


def group_data(prompt: list[int], sequences: list, rewards: list[float], *,
               normalize_std: bool = False) -> list[types.Datum]:
    """One prompt's group as ppo / importance_sampling datums: advantage = reward - the group's mean (divided by the
    group's std with `normalize_std`) on every sampled token (0 on the prompt's); a group whose rewards all agree
    teaches nothing and gives none."""
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    data = []
    for sequence, reward in zip(sequences, rewards):
        advantage = (reward - mean) / (std + 1e-6) if normalize_std and std > 0 else reward - mean
        if advantage == 0:
            continue
        tokens = prompt + list(sequence.tokens)
        n_prompt = len(prompt) - 1  # targets that are prompt tokens: no advantage, no sampling log-prob
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),  # N inputs, N targets: the sequence shifted by one
            loss_fn_inputs={"target_tokens": tokens[1:],
                            "logprobs": [0.0] * n_prompt + list(sequence.logprobs),
                            "advantages": [0.0] * n_prompt + [advantage] * len(sequence.tokens)}))
    return data


def substep_batches(groups: list[list[types.Datum]], substeps: int, rng: random.Random | None) -> list[list]:
    """The step's datums in `substeps` slices, one optimizer step each. With `rng` the datums are shuffled across
    groups first, so every slice holds samples of (nearly) every prompt, as TRL and forge's GRPO split a batch;
    without, each slice is a run of whole groups (1/substeps of the prompts). Empty slices are left out."""
    if rng is None:
        per = -(-len(groups) // substeps)
        slices = [[d for group in groups[k * per:(k + 1) * per] for d in group] for k in range(substeps)]
    else:
        flat = [d for group in groups for d in group]
        rng.shuffle(flat)
        size = -(-len(flat) // substeps)
        slices = [flat[k * size:(k + 1) * size] for k in range(substeps)]
    return [s for s in slices if s]


def run(cfg: LoopConfig, log=print) -> dict:
    task = ArithmeticTask(seed=cfg.seed, num_digits=2, held_out=500, reverse_answer=cfg.reverse_answer)
    held_out = task.held_out()[: cfg.eval_prompts]
    rng = random.Random(f"{cfg.seed}-tinker-loop")
    shuffle_rng = random.Random(f"{cfg.seed}-tinker-loop-shuffle")
    service = tinker.ServiceClient(base_url=cfg.base_url)
    training = service.create_lora_training_client(base_model=cfg.base_model, rank=cfg.rank, seed=cfg.seed).result()
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    start_accuracy = accuracy(sampler, tokenizer, task, held_out, cfg.max_tokens)
    log(f"model {training.model_id}: held-out greedy accuracy before: {start_accuracy:.1%}")
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
    adam = types.AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    started, rewards_per_step = time.perf_counter(), []
    for step in range(1, cfg.steps + 1):
        problems = task.sample_prompts(cfg.prompts_per_step, rng)
        prompts = [tokenizer.encode(p.prompt) for p in problems]
        futures = [sampler.sample(types.ModelInput.from_ints(ids), cfg.group_size, params) for ids in prompts]
        groups, step_rewards = [], []
        for problem, prompt, future in zip(problems, prompts, futures):
            sequences = future.result().sequences
            rewards = [task.reward(tokenizer.decode(s.tokens), problem.answer) for s in sequences]
            step_rewards += rewards
            groups.append(group_data(prompt, sequences, rewards, normalize_std=cfg.normalize_std))
        pending, datums = [], 0
        for data in substep_batches(groups, cfg.substeps, shuffle_rng if cfg.shuffle else None):
            pending.append((training.forward_backward(data, cfg.loss), training.optim_step(adam)))
            datums += len(data)
        loss = float("nan") if not pending else 0.0
        for backward, optim in pending:
            loss += backward.result().metrics["loss:sum"]
            optim.result()
        sampler = training.save_weights_and_get_sampling_client().result()
        rewards_per_step.append(statistics.fmean(step_rewards))
        log(f"step {step}/{cfg.steps}: reward {rewards_per_step[-1]:.3f} datums {datums} loss:sum {loss:+.3f} "
            f"({time.perf_counter() - started:.0f}s)")
    end_accuracy = accuracy(sampler, tokenizer, task, held_out, cfg.max_tokens)
    log(f"held-out greedy accuracy: {start_accuracy:.1%} -> {end_accuracy:.1%} "
        f"({end_accuracy - start_accuracy:+.1%}) after {cfg.steps} steps, {time.perf_counter() - started:.0f}s")
    service.close("success").result()  # finishes the session: the server unloads its model
    return {"accuracy_start": start_accuracy, "accuracy_end": end_accuracy, "rewards": rewards_per_step,
            "model_id": training.model_id}


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{text!r}: give true or false")
    return text.lower() in ("true", "1")


def parse(argv: list[str]) -> LoopConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, field in LoopConfig.__dataclass_fields__.items():
        kind = (_flag if isinstance(field.default, bool) else float if isinstance(field.default, float)
                else int if isinstance(field.default, int) else str)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=field.default)
    return LoopConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
