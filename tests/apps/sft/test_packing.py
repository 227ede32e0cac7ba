"""SFT's packed batches (apps.sft.data.train_batch with pack_to, pack_rows) and the `packing` config section. That a
packed batch trains as the unpacked one is tests/actors/test_packing.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apps.sft.cli import load_sft_config
from apps.sft.data import Example, pack_rows, train_batch
from forge.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs/sft_tiny.yaml")
PAD = 0


def example(length: int, prompt: int, first: int) -> Example:
    return Example(tuple(range(first, first + length)), (False,) * prompt + (True,) * (length - prompt))


def rows_as_examples(batch) -> list[list[tuple[tuple[int, ...], tuple[float, ...]]]]:
    """Each row's documents again: (ids, learned flags of tokens 1..) per document, from the batch's tensors."""
    rows = []
    for ids, mask, docs in zip(batch.input_ids.tolist(), batch.response_mask.tolist(), batch.document_ids.tolist()):
        row = []
        for d in sorted(set(docs)):
            positions = [t for t, doc in enumerate(docs) if doc == d]
            row.append((tuple(ids[t] for t in positions), tuple(mask[t] for t in positions[:-1])))
        rows.append(row)
    return rows


def test_first_fit_longest_first_within_the_length_and_a_too_long_example_alone():
    examples = [example(n, 1, 10 * i) for i, n in enumerate([5, 9, 3, 7, 12, 2])]
    rows = pack_rows(examples, 10)
    assert [[len(e) for e in row] for row in rows] == [[12], [9], [7, 3], [5, 2]]
    assert sorted(e.ids for row in rows for e in row) == sorted(e.ids for e in examples)


def test_a_packed_row_holds_each_example_with_its_own_learned_tokens_and_document_id():
    examples = [example(4, 2, 10), example(5, 1, 20), example(3, 1, 30), example(6, 3, 40)]
    batch = train_batch(examples, PAD, pack_to=10)
    assert batch.input_ids.shape == (2, 10) and batch.document_ids.shape == (2, 10)
    # rows [6, 4] and [5, 3]; the second is 8 tokens then 2 of padding, its own document (2)
    assert batch.document_ids.tolist() == [[0] * 6 + [1] * 4, [0] * 5 + [1] * 3 + [2] * 2]
    assert batch.input_ids[1, 8:].tolist() == [PAD, PAD]
    documents = [doc for row in rows_as_examples(batch) for doc in row]
    for e in examples:  # the learned flags of tokens 1.. as unpacked; nothing across the boundary is learned
        assert (e.ids, tuple(map(float, e.learned[1:]))) in documents
    assert batch.response_mask[0, 5] == 0 and batch.response_mask[1, 4] == 0  # last token predicts the next example
    assert batch.response_mask.sum() == train_batch(examples, PAD).response_mask.sum()


def test_unpacked_batches_are_as_before_without_document_ids():
    examples = [example(4, 2, 10), example(6, 3, 40)]
    batch = train_batch(examples, PAD)
    assert batch.document_ids is None
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, PAD, PAD], [40, 41, 42, 43, 44, 45]]
    assert batch.response_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]


def test_each_minibatch_packs_its_own_examples_and_rows_split_evenly_over_ranks():
    examples = [example(3, 1, 10 * i + 1) for i in range(8)]
    batch = train_batch(examples, PAD, pack_to=9, minibatches=2, ranks=2)
    # 4 examples per minibatch -> 2 rows each (3 + 1 examples), filled to 2 rows: a multiple of 2 ranks
    assert batch.num_sequences == 4
    first, second = rows_as_examples(batch.slice(0, 2)), rows_as_examples(batch.slice(2, 4))
    ids = lambda rows: {doc[0] for row in rows for doc in row if doc[0][0] != PAD}  # noqa: E731
    assert ids(first) == {e.ids for e in examples[:4]} and ids(second) == {e.ids for e in examples[4:]}
    odd = train_batch(examples[:3], PAD, pack_to=3, ranks=2)  # 3 rows, one empty row added
    assert odd.num_sequences == 4 and odd.input_ids[3].eq(PAD).all() and odd.response_mask[3].eq(0).all()
    with pytest.raises(ValueError, match=r"^7 examples: must split evenly into 2 minibatches"):
        train_batch(examples[:7], PAD, pack_to=9, minibatches=2)


def test_packing_is_off_by_default_and_its_length_is_checked_against_the_model():
    cfg, _ = load_sft_config(["--config", TINY])
    assert not cfg.packing.enabled and cfg.packing.max_length is None
    assert load_sft_config(["--config", TINY, "packing.enabled=true", "packing.max_length=64"])[0].packing.enabled
    with pytest.raises(ConfigError, match=r"^packing.max_length=1: must be >= 2"):
        load_sft_config(["--config", TINY, "packing.max_length=1"])
    with pytest.raises(ConfigError, match=r"^packing.max_length=300: must be <= the model's max_position_embeddings="
                                          r"256"):
        load_sft_config(["--config", TINY, "packing.enabled=true", "packing.max_length=300"])
    with pytest.raises(ConfigError, match=r"^packing.enabled='maybe': expected bool"):
        load_sft_config(["--config", TINY, "packing.enabled=maybe"])
