"""bench/tinker_rl_screen.py's arguments (a run trains: measured by hand, figures in docs/serving.md)."""

from __future__ import annotations

import pytest
from tinker import types

from apps.examples.tinker_rl_loop import LoopConfig
from bench.tinker_rl_screen import parse


def test_the_defaults_are_the_examples_loop_with_tinkers_adam_params():
    args, loop, adam = parse([]), LoopConfig(), types.AdamParams()
    assert (args.steps, args.prompts_per_step, args.group_size, args.substeps, args.learning_rate, args.rank,
            args.temperature, args.normalize_std, args.grad_clip_norm, args.loss, args.shuffle) == (
        loop.steps, loop.prompts_per_step, loop.group_size, loop.substeps, loop.learning_rate, loop.rank,
        loop.temperature, loop.normalize_std, loop.grad_clip_norm, loop.loss, loop.shuffle)
    assert args.train_temperature == 1.0  # the server scores a Tinker datum at temperature 1
    assert (args.beta1, args.beta2, args.eps, args.weight_decay) == (adam.beta1, adam.beta2, adam.eps,
                                                                      adam.weight_decay)
    assert not args.full and args.warm_start == "server"


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps=0: must be >= 1"),
    (["--group-size", "1"], "--group-size=1: must be >= 2"),
    (["--prompts-per-step", "10"], "--prompts-per-step=10: must be a multiple of --substeps=4"),
    (["--warm-start", "sft"], "invalid choice: 'sft'"),
])
def test_a_bad_argument_names_itself(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err
