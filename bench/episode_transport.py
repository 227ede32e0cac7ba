"""What moving a training batch between actors costs, by how the episodes are carried.

    python -m bench.episode_transport [--episodes 1024] [--prompt-tokens 8] [--completion-tokens 4 64 512]

Every actor call pickles its arguments and its answer with Monarch's own pickler (`flatten` on the sender,
`unflatten` on the receiver). This times that round trip, in CPU seconds of this process, for one batch of
episodes carried three ways, side by side:
- as `Episode`s holding Python lists (how rollouts reached the replay buffer before `EpisodeBatch`);
- as `Episode`s holding one small tensor per field (what "a tensor per episode" would cost);
- as one `EpisodeBatch`, a flat tensor per field (how rollouts reach the replay buffer), and the CPU of packing the
  lists into it and unpacking them again (what the sender and the buffer pay besides the message);
- as one `TrainBatch` of padded tensors (how the replay buffer hands a batch to the controller and the trainer).
Best of `--repeats` runs; ratios against the lists.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any, Callable

import torch

from rl.types import Episode, EpisodeBatch, TrainBatch
from monarch._src.actor.pickle import flatten, unflatten


def make_episodes(count: int, prompt_tokens: int, completion_tokens: int, *, as_tensors: bool,
                  seed: int = 0) -> list[Episode]:
    rng = random.Random(seed)
    carry: Callable[[list], Any] = torch.tensor if as_tensors else list
    return [Episode(episode_id=i, group_id=i // 16,
                    prompt_ids=carry([rng.randrange(1000) for _ in range(prompt_tokens)]),
                    completion_ids=carry([rng.randrange(1000) for _ in range(completion_tokens)]),
                    behaviour_logprobs=carry([-rng.random() for _ in range(completion_tokens)]),
                    policy_versions=carry([3] * completion_tokens), reward=float(i % 2))
            for i in range(count)]


def best_cpu_s(work: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best


def round_trip(value: Any) -> Any:
    """`value` pickled as an actor message is (Monarch's buffer, frozen as it is sent) and unpickled again."""
    values, buffer = flatten(value, lambda _: False)
    return unflatten(buffer.freeze(), values)


def round_trip_cpu_s(value: Any, repeats: int) -> float:
    """The best CPU time of pickling `value` for an actor message and unpickling it again."""
    return best_cpu_s(lambda: round_trip(value), repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[4, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{args.episodes} episodes, {args.prompt_tokens} prompt tokens each; pickle + unpickle, CPU ms "
          f"(best of {args.repeats})")
    print(f"{'completion tokens':>18} | {'lists':>8} | {'tensor per episode':>18} | {'one EpisodeBatch':>16} | "
          f"{'+ pack, unpack':>14} | {'one TrainBatch':>14} | {'lists / EpisodeBatch':>20} | "
          f"{'lists / (EpisodeBatch + pack, unpack)':>37}")
    for tokens in args.completion_tokens:
        lists = make_episodes(args.episodes, args.prompt_tokens, tokens, as_tensors=False)
        tensors = make_episodes(args.episodes, args.prompt_tokens, tokens, as_tensors=True)
        packed, batch = EpisodeBatch.pack(lists), TrainBatch.from_episodes(lists, pad_id=0)
        times = [round_trip_cpu_s(value, args.repeats) * 1e3 for value in (lists, tensors, packed, batch)]
        packing = best_cpu_s(lambda: EpisodeBatch.pack(lists).unpack(), args.repeats) * 1e3
        print(f"{tokens:>18} | {times[0]:>8.1f} | {times[1]:>18.1f} | {times[2]:>16.1f} | {packing:>14.1f} | "
              f"{times[3]:>14.1f} | {times[0] / times[2]:>19.1f}x | {times[0] / (times[2] + packing):>36.1f}x")


if __name__ == "__main__":
    main()
