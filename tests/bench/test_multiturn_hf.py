"""bench.multiturn --engine hf at its smallest: the two hf engines differ in exactly the kept KV, and the figures say
so (a later turn is served from kept KV with reuse on, never with it off; the first turn never is)."""

from __future__ import annotations

from bench.multiturn import main


def test_later_turns_reuse_kept_kv_only_with_it_on(capsys) -> None:
    prompt, generated, observation = 40, 8, 8
    figures = main(["--engine", "hf", "--models", "tiny", "--conversations", "3", "--turns", "3", "--prompt-tokens",
                    str(prompt), "--max-tokens", str(generated), "--observation-tokens", str(observation),
                    "--repeats", "1", "--threads", "1"])["tiny"]
    on, off = figures["on"], figures["off"]
    assert on[0]["cached_share"] == 0 and all(turn["cached_share"] == 0 for turn in off)
    # Turn 2 reuses at least turn 1's prompt (every conversation's, even one that stopped at its first token).
    assert on[1]["cached_share"] >= prompt / (prompt + generated + observation)
    assert on[2]["cached_share"] >= (prompt + 1 + observation) / (prompt + 2 * (generated + observation))
    for turn in on + off:
        assert 0 < turn["prefill_s"] == turn["last_first_token_s"] < turn["wall_s"]
        assert turn["tokens_per_s"] > 0 and turn["cpu_s"] >= 0  # one tiny turn can take under a 10 ms CPU tick
    assert sum(turn["cpu_s"] for turn in on + off) > 0
    out = capsys.readouterr().out
    assert "tiny: hf engine, KV reuse on vs off" in out and "all turns:" in out
