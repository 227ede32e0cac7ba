"""One GRPO training step of forge's default job, side by side with TRL's GRPO semantics, from the same weights
and the same sampled batch.

forge's side is the trainer the app runs (actors.titan_trainer.TitanTrainer with configs/grpo_tiny.yaml's
trainer settings) on the advantages the app computes (losses.advantages.group_advantages). The reference is a
short re-statement of TRL's GRPOTrainer (loss_type="grpo", scale_rewards="group", beta=0) written here from its
documented equations, on the Hugging Face model with torch's AdamW, so TRL itself is not needed:

    A_i = (R_i - mean_g R) / (std_g R + 1e-4)                              (std Bessel-corrected)
    L   = -1/B sum_i 1/|o_i| sum_t min(r_t A_i, clip(r_t, 1 - 0.2, 1 + 0.2) A_i)
    r_t = pi_theta(o_t) / pi_old(o_t), pi_old scored before the first of the `minibatches` optimizer steps
    log-probs at the sampling temperature; gradient norm clipped at 1; AdamW (0.9, 0.999), eps 1e-8, no decay

It prints, per minibatch, both losses and gradient norms, and after the step the size of each update and the
cosine between them, then compares the two samplers at the same weights (forge's engine and
transformers' `generate`, which TRL calls): sampled reward, length and end-of-sequence rate.

    python bench/grpo_step_vs_trl.py [--seed 0] [--samples 64]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from actors.engines.hf import HFEngine  # noqa: E402
from actors.trainer_config import TrainerConfig  # noqa: E402
from apps.app_config import load_app_config  # noqa: E402
from apps.grpo.config import GRPOConfig  # noqa: E402
from apps.grpo.launch import make_task  # noqa: E402
from apps.grpo.rollouts import warm_started_model  # noqa: E402
from losses.advantages import group_advantages  # noqa: E402
from rl.tasks.protocol import Task  # noqa: E402
from rl.types import Episode, SamplingParams, TrainBatch  # noqa: E402


def trl_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """TRL's scale_rewards="group": (R - mean) / (std + 1e-4) per group of `group_size` consecutive rewards."""
    grouped = rewards.view(-1, group_size)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + eps)).flatten()


def trl_grpo_loss(logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """TRL's loss_type="grpo": token mean per sequence, then mean over sequences."""
    ratio = torch.exp(logprobs - old)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def hf_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """[B, T-1] log-probs of input_ids[:, 1:] at `temperature` (right padding: causal attention needs no mask)."""
    logits = model(input_ids=batch.input_ids).logits[:, :-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].flatten().double() for k in sorted(state)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo_tiny.yaml")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=64, help="samples per prompt in the sampler comparison")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config (trainer.*, rollout.*)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_app_config(REPO / args.config, [f"seed={args.seed}", *args.overrides], GRPOConfig,
                          check=GRPOConfig.check)
    task = make_task(cfg)
    model_path, _ = warm_started_model(cfg, task)
    r, t = cfg.rollout, cfg.trainer
    temperature, clip_eps = r.temperature, t.loss_params.get("clip_eps", 0.2)
    rng = random.Random(f"{args.seed}-step-vs-trl")
    problems = task.sample_prompts(cfg.replay_buffer.batch_size // r.group_size, rng)

    # --- the same sampled batch -----------------------------------------------------------------------
    engine = HFEngine(model_path, seed=args.seed)
    params = SamplingParams(n=r.group_size, max_tokens=r.max_tokens, temperature=temperature,
                            stop_token_ids=list(task.stop_token_ids))
    groups = engine.generate([p.prompt for p in problems], params)
    episodes = [Episode.from_completion(c, episode_id=g * r.group_size + i, group_id=g,
                                        reward=task.reward(c.text, p.answer))
                for g, (group, p) in enumerate(zip(groups, problems)) for i, c in enumerate(group)]
    rewards = torch.tensor([e.reward for e in episodes])
    forge_adv, zero = group_advantages(rewards, torch.tensor([e.group_id for e in episodes]),
                                       normalize_std=r.normalize_advantages)
    ref_adv = trl_advantages(rewards, r.group_size)
    print(f"batch: {len(episodes)} completions, reward {rewards.mean():.3f}, zero-variance groups "
          f"{zero.float().mean():.0%}")
    print(f"advantages: max |forge - TRL| {(forge_adv - ref_adv).abs().max():.2e}, "
          f"mean |A| forge {forge_adv.abs().mean():.4f} TRL {ref_adv.abs().mean():.4f}")
    for e, a in zip(episodes, forge_adv.tolist()):
        e.advantage = a
    batch = TrainBatch.from_episodes(episodes, pad_id=engine.pad_token_id)

    # --- forge: the app's trainer ---------------------------------------------------------------------
    from actors.titan_trainer import TitanTrainer
    from transformers import AutoModelForCausalLM

    trainer_cfg = TrainerConfig(**{**{k: getattr(t, k) for k in t.__dataclass_fields__}, "model_path": model_path})
    trainer = TitanTrainer(trainer_cfg)
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    forge_old = trainer.logprobs(batch)
    mask = batch.response_mask
    print(f"behaviour vs trainer log-probs at the same weights: max |diff| "
          f"{((forge_old - batch.behaviour_logprobs) * mask).abs().max():.2e}")
    rows = batch.num_sequences // t.minibatches
    metrics = trainer.train_step(batch)
    after_forge = trainer.hf_state_dict()

    # --- the TRL-semantics reference ------------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.eps,
                                  weight_decay=t.weight_decay)
    with torch.no_grad():
        old = hf_logprobs(model, batch, temperature)
    print(f"\n{'minibatch':>9} {'loss forge':>11} {'loss TRL':>10} {'|g| TRL':>8}")
    for i, s in enumerate(range(0, batch.num_sequences, rows)):
        mb = batch.slice(s, s + rows)
        loss = trl_grpo_loss(hf_logprobs(model, mb, temperature), old[s: s + rows], ref_adv[s: s + rows],
                             mb.response_mask, clip_eps)
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        print(f"{i:>9} {'':>11} {loss.item():>10.5f} {norm.item():>8.4f}")
    print(f"forge train_step: loss (mean of minibatches) {metrics['loss']:.5f}, grad_norm (mean) "
          f"{metrics['grad_norm']:.4f}, clip_fraction {metrics.get('clip_fraction', math.nan):.4f}")
    after_ref = {k: v.detach() for k, v in model.state_dict().items() if k in before}
    d_forge, d_ref = flat(after_forge) - flat(before), flat(after_ref) - flat(before)
    print(f"update norm forge {d_forge.norm():.5f} TRL {d_ref.norm():.5f} ratio {d_forge.norm() / d_ref.norm():.4f}, "
          f"cosine {torch.nn.functional.cosine_similarity(d_forge, d_ref, dim=0):.5f}")
    print("tensors whose updates differ by more than 1% (|d_forge - d_TRL| / |d_TRL|):")
    for name in sorted(before):
        a, b = (after_forge[name] - before[name]).double(), (after_ref[name] - before[name]).double()
        rel = ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
        if rel > 0.01:
            print(f"  {name}: |d_forge| {a.norm():.3e} |d_TRL| {b.norm():.3e} rel diff {rel:.3f}")
    compare_samplers(model_path, task, problems, args.samples, r.max_tokens, temperature, args.seed)


def compare_samplers(model_path: str, task: Task, problems: list, samples: int, max_tokens: int, temperature: float,
                     seed: int) -> None:
    """forge's engine and transformers' `generate` (TRL's sampler without vLLM) at the same weights: mean reward,
    completion length and share ending in EOS, with the standard error of the reward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = HFEngine(model_path, seed=seed + 1)
    params = SamplingParams(n=samples, max_tokens=max_tokens, temperature=temperature,
                            stop_token_ids=list(task.stop_token_ids))
    forge = [(task.reward(c.text, p.answer), len(c.token_ids), c.finish_reason == "stop")
             for group, p in zip(engine.generate([p.prompt for p in problems], params), problems) for c in group]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    torch.manual_seed(seed + 1)
    encoded = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**encoded, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                             max_new_tokens=max_tokens, num_return_sequences=samples,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    completions = out[:, encoded.input_ids.shape[1]:]
    hf = []
    for row, ids in enumerate(completions.tolist()):
        problem = problems[row // samples]
        ended = tokenizer.eos_token_id in ids
        n = ids.index(tokenizer.eos_token_id) + 1 if ended else len(ids)
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        hf.append((task.reward(text, problem.answer), n, ended))
    print(f"\nsamplers at the same weights, {len(problems)} prompts x {samples}:")
    for name, rows in (("forge engine", forge), ("transformers generate", hf)):
        rewards = torch.tensor([x[0] for x in rows])
        print(f"  {name:>22}: reward {rewards.mean():.4f} +- {rewards.std() / math.sqrt(len(rows)):.4f}, "
              f"length {sum(x[1] for x in rows) / len(rows):.3f}, EOS {sum(x[2] for x in rows) / len(rows):.3f}")


if __name__ == "__main__":
    main()
