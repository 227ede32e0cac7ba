"""bench.episode_transport: the three ways carry the same episodes, and the table has a row per length."""

from bench.episode_transport import main, make_episodes
from rl.types import TrainBatch


def test_the_ways_compared_carry_the_same_episodes():
    lists = make_episodes(8, 3, 5, as_tensors=False)
    tensors = make_episodes(8, 3, 5, as_tensors=True)
    for a, b in zip(lists, tensors):
        assert a.completion_ids == b.completion_ids.tolist() and a.prompt_ids == b.prompt_ids.tolist()
    batch = TrainBatch.from_episodes(lists, pad_id=0)
    assert batch.input_ids[:, 3:].tolist() == [e.completion_ids for e in lists]


def test_the_table_has_a_row_per_completion_length(capsys):
    main(["--episodes", "16", "--completion-tokens", "2", "7", "--repeats", "1"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if "|" in line][1:]
    assert [int(row[0]) for row in rows] == [2, 7]
    assert all(float(row[4].strip().rstrip("x")) > 0 for row in rows)
