"""The hf engine's prefix cache: lookup by block hash, verified by ids; bounded least recently used."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from actors.engines import prefix_cache
from actors.engines.prefix_cache import BLOCK, PrefixCache


def kv_of(ids: list[int]) -> torch.Tensor:
    """A stand-in KV tensor [layers=2, 2, heads=1, len, dim=1] whose every entry is the token id it belongs to."""
    return torch.tensor(ids, dtype=torch.float32)[None, None, None, :, None].expand(2, 2, 1, -1, 1).clone()


def test_match_finds_the_longest_shared_prefix_and_leaves_one_prompt_token_to_feed():
    cache = PrefixCache(max_tokens=1000)
    a, b = list(range(100, 140)), list(range(100, 120)) + list(range(200, 230))
    cache.add(a, kv_of(a))
    cache.add(b, kv_of(b))
    kept, n = cache.match(a[:37] + [1, 2, 3])  # a's first 37 tokens, past the last full block (32)
    assert kept.ids == a and n == 37
    kept, n = cache.match(b + [5])
    assert kept.ids == b and n == len(b)
    kept, n = cache.match(a)  # the whole kept sequence asked again: its last token is fed, not reused
    assert kept.ids == a and n == len(a) - 1
    assert cache.match(a[: BLOCK - 1] + [7] * 30) == (None, 0)  # less than a block shared: not found
    assert cache.match(list(range(500, 560))) == (None, 0)


def test_a_hash_collision_serves_nothing(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hashes", lambda ids: [0] * (len(ids) // BLOCK))  # every block collides
    cache = PrefixCache(max_tokens=1000)
    kept = list(range(100, 140))
    cache.add(kept, kv_of(kept))
    assert cache.match(list(range(300, 340))) == (None, 0)
    assert cache.match(kept + [1])[1] == len(kept)


def test_least_recently_used_out_and_too_long_never_in():
    cache = PrefixCache(max_tokens=100)
    a, b, c = (list(range(start, start + 40)) for start in (100, 200, 300))
    cache.add(a, kv_of(a))
    cache.add(b, kv_of(b))
    cache.match(a + [1])  # a is used: b is now the least recently used
    cache.add(c, kv_of(c))
    assert cache.tokens == 80 and cache.match(b + [1]) == (None, 0) and cache.match(a + [1])[1] == 40
    for ids in (a, c):  # c went into b's pages: each reads back its own KV
        assert torch.equal(cache.kv(cache.match(ids + [1])[0], 40), kv_of(ids))
    cache.add(list(range(101)), kv_of(list(range(101))))
    assert cache.tokens == 80 and len(cache) == 2
    cache.clear()
    assert cache.tokens == 0 and cache.match(a + [1]) == (None, 0)


def test_a_batch_keeps_each_rows_unmasked_columns_and_drops_what_a_row_extended():
    cache = PrefixCache(max_tokens=1000)
    first = list(range(100, 120))
    cache.add(first, kv_of(first))
    hit, n = cache.match(first + [7])
    assert n == len(first)
    # Row 0 extended `first` (its KV in columns 2.., after a gap of 2 masked columns at 22, 23); row 1 is new.
    extended, other = first + [7, 8, 9], list(range(300, 320))
    row0 = [0, 0] + first + [-1, -1] + [7, 8, 9]
    row1 = [0] * 7 + other
    keys = torch.tensor([row0, row1], dtype=torch.float32)[:, None, :, None]  # [batch, heads, columns, dim]
    batch_cache = DynamicCache(ddp_cache_data=[(keys, keys.clone()), (keys.clone(), keys.clone())])
    mask = torch.tensor([[0, 0] + [1] * 20 + [0, 0] + [1] * 3, [0] * 7 + [1] * 20])
    cache.keep_batch(batch_cache, mask, [extended, other], [hit, None])
    assert sorted(len(ids) for ids in cache._sequences) == [20, 23]  # `first` was dropped: `extended` serves it
    for ids in (extended, other):
        kept, n = cache.match(ids + [1])
        assert n == len(ids) and torch.equal(cache.kv(kept, n), kv_of(ids))

    # Assembled back into a batch: right-aligned, zeros before (masked by the engine).
    assembled = cache.assemble([(cache.match(extended + [1])[0], 21), (None, 0)], width=25)
    assert assembled.layers[1].values[0, 0, :, 0].tolist() == [0] * 4 + extended[:21]
    assert assembled.layers[0].keys[1].abs().sum() == 0
