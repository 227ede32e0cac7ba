"""The Tinker-style RL loop (apps/examples/tinker_rl_loop.py) in one process, to screen its settings fast: the
server's own parts (`SharedBaseLoRATrainer` and `AdapterSampler` for a LoRA model; for a full-weight model, which
the SDK cannot drive here, `ServerTrainer` and an `HFEngine` loaded with its weights after every step), the SDK's own
types and wire encoders between them (samples through `encode_sample_response` / `deserialize_sample_response`,
datums through `forward_backward_request_to_proto` / `decode_forward_backward` / `tinker_batch`), the example's
`group_data`, and the server's warm start (configs/server_tiny.yaml's, or configs/grpo_tiny.yaml's with
`--warm-start grpo`). No server, no HTTP, no Monarch: a step's 64 prompts go to the sampler in one call, so its
random draws differ from the server's, and figures here are screens; bench/tinker_rl_learning.py measures the SDK.

    cd <repo> && .venv/bin/python -m bench.tinker_rl_screen --seed 0 --warm-start grpo     # the example's defaults
    cd <repo> && .venv/bin/python -m bench.tinker_rl_screen --seed 0 --warm-start grpo --loss importance_sampling \\
        --no-shuffle                                                      # the loop before issue 58's fourth round
    cd <repo> && .venv/bin/python -m bench.tinker_rl_screen --seed 0 --full --learning-rate 3e-4 \\
        --beta2 0.999 --eps 1e-8 --grad-clip-norm 1                       # forge's GRPO optimizer on full weights

Each step also prints max|lp_train-lp_sample|: on the first substep's datums, before any update, the trainer's
log-probs against the sampler's (they agree to ~1e-5 when both are at the same temperature).

Prints one line per step and, every `--eval-every` steps, greedy accuracy on 200 held-out prompts; the last line
is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

WARM_STARTS = {"server": dict(target_accuracy=0.2, lr=1e-3, batch_size=64, eval_every=10),  # configs/server_tiny.yaml
               "grpo": dict(target_accuracy=0.15, lr=3e-3, batch_size=64, eval_every=5)}   # configs/grpo_tiny.yaml


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=45)
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--substeps", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--cosine", action="store_true", help="learning rate decayed to 0 at the last step (cosine)")
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)  # Tinker's AdamParams defaults
    p.add_argument("--eps", type=float, default=1e-12)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip-norm", type=float, default=0.0, help="0: no clipping (Tinker's default)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--full", action="store_true", help="train the full weights, not a LoRA adapter")
    p.add_argument("--normalize-std", action=argparse.BooleanOptionalAction, default=True,
                   help="advantages divided by the group's std (GRPO's; the example's default)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--train-temperature", type=float, default=1.0,
                   help="the trainer's log-prob temperature (a Tinker datum cannot carry one: the server scores at 1)")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                   help="shuffle the step's datums across groups before splitting them into substeps (the example's "
                        "substep_batches; --no-shuffle: runs of whole groups)")
    p.add_argument("--loss", default="ppo", choices=["ppo", "importance_sampling", "cispo"])
    p.add_argument("--warm-start", default="server", choices=sorted(WARM_STARTS))
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--model-cache", default=".cache/forge")
    args = p.parse_args(argv)
    for name in ("steps", "prompts_per_step", "substeps", "rank", "eval_every", "eval_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.group_size < 2:
        p.error(f"--group-size={args.group_size}: must be >= 2")
    if args.prompts_per_step % args.substeps:
        p.error(f"--prompts-per-step={args.prompts_per_step}: must be a multiple of --substeps={args.substeps}")
    if args.learning_rate <= 0 or args.temperature <= 0 or args.train_temperature <= 0:
        p.error("--learning-rate and --temperature must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_sample_response
    from transformers import AutoTokenizer

    from actors.engines.hf import HFEngine
    from actors.lora_config import LORA_TARGETS, LoRAConfig
    from actors.trainer_config import TrainerConfig
    from apps.examples.tinker_rl_loop import group_data, substep_batches
    from apps.http.model import model_to_serve
    from apps.server.lora_trainer import AdapterSampler, SharedBaseLoRATrainer
    from apps.server.tinker.batches import tinker_batch
    from apps.server.tinker.wire import WireSequence, decode_forward_backward, encode_sample_response
    from apps.server.trainer import ServerTrainer
    from apps.warm_start.config import WarmStartConfig
    from rl.tasks.arithmetic import ArithmeticTask
    from rl.tiny_model import TINY_CHECKPOINT_DIR
    from rl.types import SamplingParams

    torch.set_num_threads(1)
    path, _ = model_to_serve(str(Path(args.model_cache) / TINY_CHECKPOINT_DIR), args.model_cache,
                             WarmStartConfig(enabled=True, **WARM_STARTS[args.warm_start]), seed=0,
                             reverse_answer=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    folder = Path(tempfile.mkdtemp(prefix="tinker-rl-screen-"))
    config = TrainerConfig(model_path=path, family="qwen3", micro_batch_size=256, temperature=1.0)
    model_id = "screen:train:0"
    if args.full:
        trainer = ServerTrainer(config)
        engine = HFEngine(path, seed=args.seed, kv_reuse_tokens=0)

        def call(method: str, *a):
            return getattr(trainer, method)(*a)

        def save() -> int:  # the engine gets the trained weights (one version per step)
            engine.load_weights(trainer.hf_state_dict(), engine.policy_version + 1)
            return engine.policy_version

        def generate(_, prompts, params):
            return engine.generate(prompts, params)
    else:
        trainer = SharedBaseLoRATrainer(config)
        trainer.add_session(model_id, LoRAConfig(rank=args.rank, target_modules=list(LORA_TARGETS["qwen3"])),
                            args.seed)  # create_lora_training_client's targets: the 7 block modules and lm_head
        sampler = AdapterSampler(trainer.base_hf_state(), path, seed=args.seed)
        saves = iter(range(1, 10**9))

        def call(method: str, *a):
            return trainer.run(model_id, method, *a)

        def save() -> str:  # save_weights_for_sampler: a fresh peft folder
            return trainer.run(model_id, "export_hf", str(folder / f"sampler-{next(saves)}"))

        def generate(adapter, prompts, params):
            return sampler.generate(adapter, prompts, params)

    def sample(weights, prompts: list[list[int]], n: int, temperature: float) -> list[list]:
        out = generate(weights, prompts, SamplingParams(n=n, max_tokens=4, temperature=temperature))
        return [deserialize_sample_response(encode_sample_response(
            [WireSequence(c.token_ids, c.logprobs, c.finish_reason == "stop") for c in completions], None)).sequences
            for completions in out]

    def batch(data: list):
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=args.loss), model_id=model_id, seq_id=1)
        wire = decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString(), None)
        return tinker_batch(wire.data, args.loss, pad_id=tokenizer.pad_token_id, vocab_size=len(tokenizer), max_len=64)

    task = ArithmeticTask(seed=args.seed, num_digits=2, held_out=500, reverse_answer=True)
    held_out = task.held_out()[: args.eval_prompts]

    def accuracy(weights) -> float:
        out = sample(weights, [tokenizer.encode(p.prompt) for p in held_out], 1, 0.0)
        return sum(task.reward(tokenizer.decode(s[0].tokens), p.answer) for s, p in zip(out, held_out)) / len(held_out)

    rng = random.Random(f"{args.seed}-tinker-loop")  # the example's prompt stream
    shuffle_rng = random.Random(f"{args.seed}-tinker-loop-shuffle")  # and its substeps' shuffle
    weights = save()
    before = accuracy(weights)
    print(f"held-out greedy accuracy before: {before:.1%}", flush=True)
    started, curve, rewards = time.perf_counter(), [], []
    for step in range(1, args.steps + 1):
        problems = task.sample_prompts(args.prompts_per_step, rng)
        prompts = [tokenizer.encode(p.prompt) for p in problems]
        groups, step_rewards = [], []
        for problem, prompt, sequences in zip(problems, prompts, sample(weights, prompts, args.group_size,
                                                                         args.temperature)):
            r = [task.reward(tokenizer.decode(s.tokens), problem.answer) for s in sequences]
            step_rewards += r
            groups.append(group_data(prompt, sequences, r, normalize_std=args.normalize_std))
        lr = args.learning_rate * (0.5 * (1 + math.cos(math.pi * (step - 1) / args.steps)) if args.cosine else 1.0)
        clip = math.inf if args.grad_clip_norm <= 0 else args.grad_clip_norm
        norms, mismatch = [], float("nan")
        for k, data in enumerate(substep_batches(groups, args.substeps, shuffle_rng if args.shuffle else None)):
            b = batch(data)
            out = call("forward_backward", b, f"losses.tinker:{args.loss}", {}, args.train_temperature)
            if k == 0:  # before any update this step: the trainer's log-probs should be the sampler's
                sampled = b.token_advantages != 0
                mismatch = float((out["logprobs"] - b.behaviour_logprobs).abs()[sampled].max())
            out = call("optim_step", lr, (args.beta1, args.beta2), args.eps, args.weight_decay, clip)
            norms.append(out["grad_norm"])
        weights = save()
        rewards.append(statistics.fmean(step_rewards))
        line = (f"step {step}: reward {rewards[-1]:.3f} grad_norm {statistics.fmean(norms) if norms else 0:.2f} "
                f"max|lp_train-lp_sample| {mismatch:.1e} "
                f"({time.perf_counter() - started:.0f}s)")
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, accuracy(weights)))
            line += f" held-out {curve[-1][1]:.1%}"
        print(line, flush=True)
    print("RESULT " + json.dumps({"args": vars(args), "accuracy_start": before, "curve": curve, "rewards": rewards,
                                  "seconds": time.perf_counter() - started}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
