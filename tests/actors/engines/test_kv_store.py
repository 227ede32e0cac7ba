"""The hf engine's store of past key values: lookup by block hash, verified by ids; bounded least recently used."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from actors.engines import kv_store
from actors.engines.kv_store import BLOCK, KVStore


def kv_of(ids: list[int]) -> torch.Tensor:
    """A stand-in KV tensor [layers=2, 2, heads=1, len, dim=1] whose every entry is the token id it belongs to."""
    return torch.tensor(ids, dtype=torch.float32)[None, None, None, :, None].expand(2, 2, 1, -1, 1).clone()


def test_match_finds_the_longest_shared_prefix_and_leaves_one_prompt_token_to_feed():
    store = KVStore(max_tokens=1000)
    a, b = list(range(100, 140)), list(range(100, 120)) + list(range(200, 230))
    store.add(a, kv_of(a))
    store.add(b, kv_of(b))
    kept, n = store.match(a[:37] + [1, 2, 3])  # a's first 37 tokens, past the last full block (32)
    assert kept.ids == a and n == 37
    kept, n = store.match(b + [5])
    assert kept.ids == b and n == len(b)
    kept, n = store.match(a)  # the whole kept sequence asked again: its last token is fed, not reused
    assert kept.ids == a and n == len(a) - 1
    assert store.match(a[: BLOCK - 1] + [7] * 30) == (None, 0)  # less than a block shared: not found
    assert store.match(list(range(500, 560))) == (None, 0)


def test_a_hash_collision_serves_nothing(monkeypatch):
    monkeypatch.setattr(kv_store, "block_hashes", lambda ids: [0] * (len(ids) // BLOCK))  # every block collides
    store = KVStore(max_tokens=1000)
    kept = list(range(100, 140))
    store.add(kept, kv_of(kept))
    assert store.match(list(range(300, 340))) == (None, 0)
    assert store.match(kept + [1])[1] == len(kept)


def test_least_recently_used_out_and_too_long_never_in():
    store = KVStore(max_tokens=100)
    a, b, c = (list(range(start, start + 40)) for start in (100, 200, 300))
    store.add(a, kv_of(a))
    store.add(b, kv_of(b))
    store.match(a + [1])  # a is used: b is now the least recently used
    store.add(c, kv_of(c))
    assert store.tokens == 80 and store.match(b + [1]) == (None, 0) and store.match(a + [1])[1] == 40
    for ids in (a, c):  # c went into b's pages: each reads back its own KV
        assert torch.equal(store.kv(store.match(ids + [1])[0], 40), kv_of(ids))
    store.add(list(range(101)), kv_of(list(range(101))))
    assert store.tokens == 80 and len(store) == 2
    store.clear()
    assert store.tokens == 0 and store.match(a + [1]) == (None, 0)


def test_a_batch_keeps_each_rows_unmasked_columns_and_drops_what_a_row_extended():
    store = KVStore(max_tokens=1000)
    first = list(range(100, 120))
    store.add(first, kv_of(first))
    hit, n = store.match(first + [7])
    assert n == len(first)
    # Row 0 extended `first` (its KV in columns 2.., after a gap of 2 masked columns at 22, 23); row 1 is new.
    extended, other = first + [7, 8, 9], list(range(300, 320))
    row0 = [0, 0] + first + [-1, -1] + [7, 8, 9]
    row1 = [0] * 7 + other
    keys = torch.tensor([row0, row1], dtype=torch.float32)[:, None, :, None]  # [batch, heads, columns, dim]
    cache = DynamicCache(ddp_cache_data=[(keys, keys.clone()), (keys.clone(), keys.clone())])
    mask = torch.tensor([[0, 0] + [1] * 20 + [0, 0] + [1] * 3, [0] * 7 + [1] * 20])
    store.keep_batch(cache, mask, [extended, other], [hit, None])
    assert sorted(len(ids) for ids in store._sequences) == [20, 23]  # `first` was dropped: `extended` serves it
    for ids in (extended, other):
        kept, n = store.match(ids + [1])
        assert n == len(ids) and torch.equal(store.kv(kept, n), kv_of(ids))

    # Assembled back into a batch: right-aligned, zeros before (masked by the engine).
    cache = store.assemble([(store.match(extended + [1])[0], 21), (None, 0)], width=25)
    assert cache.layers[1].values[0, 0, :, 0].tolist() == [0] * 4 + extended[:21]
    assert cache.layers[0].keys[1].abs().sum() == 0
