"""Sampling-mask replay: how many tokens leave the importance-ratio band with and without it.

    python -m bench.sampling_mask [--model DIR] [--top-p 0.8] [--top-k 0] [--temperature 1.0] [--prompts 64]

The hf engine samples `--prompts` arithmetic prompts x 8 completions with top-p / top-k; the trainer's log-prob
function (actors.logprobs.token_logprobs) then scores them teacher-forced at the same weights, once over the full
vocabulary (no replay) and once over each token's recorded kept set (replay). Printed per variant: the fraction
of generated tokens whose ratio pi_train / pi_behaviour lies outside [0.5, 2], and the mean |log-ratio|. At the
same weights any ratio other than 1 is the sampling mask alone: without replay the ratio is the kept set's mass
under the full distribution, at least top_p for top-p alone (unless MAX_KEPT_TOKENS capped the set), so top-p
0.8 stays inside the band while top-k or a lower top_p leave it. `--model` is a Hugging Face checkpoint folder
(e.g. a warm-started one under .cache/forge/warm_start); by default a fresh tiny model is built.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from actors.engines.hf import HFEngine
from actors.logprobs import token_logprobs
from rl.tiny_model import build_tiny_checkpoint
from rl.types import Episode, SamplingParams, TrainBatch

BAND = (0.5, 2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: a fresh tiny model)")
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)

    engine = HFEngine(model, seed=0)
    params = SamplingParams(n=8, max_tokens=8, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=0)
    prompts = [f"{a}+{b}=" for a, b in zip(range(11, 11 + 7 * args.prompts, 7), range(3, 3 + 13 * args.prompts, 13))]
    completions = [c for group in engine.generate(prompts, params) for c in group]
    batch = TrainBatch.from_episodes(
        [Episode.from_completion(c, episode_id=i, group_id=0, reward=0.0) for i, c in enumerate(completions)],
        pad_id=engine.pad_token_id)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model)(batch.input_ids).logits[:, :-1]
    targets, on_response = batch.input_ids[:, 1:], batch.response_mask.bool()
    behaviour = batch.behaviour_logprobs[on_response]
    kept = (batch.kept_token_ids[on_response] >= 0).sum(-1).float() if batch.kept_token_ids is not None else None

    print(f"model {model}; temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}; "
          f"{int(on_response.sum())} generated tokens" + ("" if kept is None else
          f", kept set size mean {kept.mean():.1f} (min {int(kept.min())}, max {int(kept.max())})"))
    print(f"{'trainer log-probs':<22} {'outside ' + str(list(BAND)):>16} {'mean |log ratio|':>18}")
    for name, kept_ids in (("full vocabulary", None), ("kept-set replay", batch.kept_token_ids)):
        log_ratio = token_logprobs(logits, targets, args.temperature, kept_ids)[on_response] - behaviour
        ratio = log_ratio.exp()
        outside = ((ratio < BAND[0]) | (ratio > BAND[1])).float().mean()
        print(f"{name:<22} {outside:>16.1%} {log_ratio.abs().mean():>18.2e}")


if __name__ == "__main__":
    main()
