"""The hf engine's prefix cache: the past key values it keeps between `generate` calls (KV reuse across turns).

A multi-turn episode's next prompt is its previous prompt, the model's tokens and the observation, by token id, and
a group's turns reach the same replica; so the KV the engine computed for the previous turn is the KV of the next
prompt's prefix. The cache keeps, per finished sequence, the KV of every token whose KV was computed (the prompt and
the generated tokens, except a last token that was never fed back), and finds for a new prompt the kept sequence
sharing its longest prefix. It is bounded in tokens (least recently used first out) and is cleared whenever the
engine's weights change: KV that old weights computed must not serve new ones.

Lookup is by block: every `BLOCK` tokens of a kept sequence are one link of a hash chain (as vLLM's prefix cache
hashes its blocks), so a prompt finds the sequence holding its longest block-aligned prefix in one dictionary probe
per block, then extends the match token by token. Hashes only point; the ids are compared before any KV is used.

Memory is paged, also by block: one pool tensor of pages ([pages, layers, 2, kv_heads, BLOCK, head_dim], grown by
doubling up to the bound) and a free list. Kept sequences as tensors of their own would be thousands of long-lived
allocations between the batch's short-lived ones; on CPU that fragments the heap so much that every decode step's
temporaries fault in fresh pages, and decode steps slow down several times over.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

BLOCK = 16  # tokens per hashed block: a prompt sharing fewer than BLOCK tokens with every kept sequence reuses none


@dataclass
class KeptSequence:
    ids: list[int]  # the tokens whose KV the pages hold, in order
    pages: list[int]  # the pool's pages holding ids[k * BLOCK : (k + 1) * BLOCK], for every k
    block_hashes: list[int]  # chain hash of ids[: (k + 1) * BLOCK] for every full block k


def block_hashes(ids: list[int]) -> list[int]:
    """The chain hash of every full block of `ids`: hash k covers ids[: (k + 1) * BLOCK]."""
    hashes, previous = [], 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        previous = hash((previous, tuple(ids[start : start + BLOCK])))
        hashes.append(previous)
    return hashes


class PrefixCache:
    """Kept sequences' KV, least recently used first out once they hold more than `max_tokens` tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.max_pages = max_tokens // BLOCK
        self.tokens = 0
        self._pool: torch.Tensor | None = None  # [pages, layers, 2, kv_heads, BLOCK, head_dim]
        self._free: list[int] = []
        self._sequences: OrderedDict[tuple[int, ...], KeptSequence] = OrderedDict()  # least recently used first
        self._by_hash: dict[int, tuple[int, ...]] = {}  # block hash -> the kept sequence added last that has it

    def __len__(self) -> int:
        return len(self._sequences)

    def clear(self) -> None:
        self._sequences.clear()
        self._by_hash.clear()
        self.tokens = 0
        self._free = list(range(len(self._pool))) if self._pool is not None else []

    def kv(self, kept: KeptSequence, n: int) -> torch.Tensor:
        """The KV of kept.ids[:n]: [layers, 2, kv_heads, n, head_dim]."""
        pages = self._pool[kept.pages[: -(-n // BLOCK)]]  # [pages, layers, 2, heads, BLOCK, dim]
        return pages.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)[:, :, :, :n]

    def match(self, prompt: list[int]) -> tuple[KeptSequence | None, int]:
        """The kept sequence sharing the longest prefix with `prompt` (found by its blocks) and how many of the
        prompt's first tokens it holds, at most len(prompt) - 1: the last prompt token is always fed, its logits
        sample the first new token."""
        limit = len(prompt) - 1
        hashes = block_hashes(prompt[:limit])
        for blocks in range(len(hashes), 0, -1):
            key = self._by_hash.get(hashes[blocks - 1])
            kept = self._sequences.get(key) if key is not None else None
            matched = blocks * BLOCK
            if kept is None or kept.ids[:matched] != prompt[:matched]:  # a stale pointer or a hash collision
                continue
            end = min(len(kept.ids), limit)
            while matched < end and kept.ids[matched] == prompt[matched]:
                matched += 1
            self._sequences.move_to_end(key)
            return kept, matched
        return None, 0

    def add(self, ids: list[int], kv: torch.Tensor) -> None:
        """Keep `kv` ([layers, 2, kv_heads, len(ids), head_dim]) as the KV of `ids`, evicting the least recently used
        sequences for room. A sequence too short to be found, or longer than the bound, is not kept."""
        key = tuple(ids)
        if key in self._sequences:
            self._sequences.move_to_end(key)
            return
        needed = -(-len(ids) // BLOCK)
        if len(ids) < BLOCK or needed > self.max_pages:
            return
        while len(self._free) < needed and not self._grow(kv, needed):
            self.discard(next(iter(self._sequences.values())))
        pages = [self._free.pop() for _ in range(needed)]
        padded = torch.nn.functional.pad(kv, (0, 0, 0, needed * BLOCK - len(ids)))
        self._pool[pages] = padded.unflatten(3, (needed, BLOCK)).permute(3, 0, 1, 2, 4, 5)
        kept = KeptSequence(list(ids), pages, block_hashes(ids))
        self._sequences[key] = kept
        for h in kept.block_hashes:
            self._by_hash[h] = key
        self.tokens += len(ids)

    def _grow(self, kv: torch.Tensor, needed: int) -> bool:
        """Double the pool (at most to the bound) until `needed` pages are free; False if the bound is reached."""
        have = 0 if self._pool is None else len(self._pool)
        if have == self.max_pages:
            return False
        size = min(self.max_pages, max(2 * have, have + needed - len(self._free), 64))
        layers, _, heads, _, dim = kv.shape
        pool = kv.new_empty(size, layers, 2, heads, BLOCK, dim)
        if self._pool is not None:
            pool[:have] = self._pool
        self._pool = pool
        self._free.extend(range(have, size))
        return len(self._free) >= needed

    def discard(self, kept: KeptSequence) -> None:
        key = tuple(kept.ids)
        if self._sequences.pop(key, None) is None:
            return
        self.tokens -= len(kept.ids)
        self._free.extend(kept.pages)
        for h in kept.block_hashes:
            if self._by_hash.get(h) == key:
                del self._by_hash[h]

    def keep_batch(self, cache: DynamicCache, attention_mask: torch.Tensor, sequences: list[list[int]],
                   hits: list[KeptSequence | None]) -> None:
        """Keep every row of a finished batch: `sequences[row]` are the ids whose KV the row's unmasked cache columns
        hold, in order (further columns hold tokens past the row's end). A kept sequence that a row extended is
        dropped: the new one serves every prompt the old one served."""
        for row, ids in enumerate(sequences):
            if len(ids) < BLOCK or -(-len(ids) // BLOCK) > self.max_pages:
                continue
            columns = attention_mask[row].nonzero().squeeze(-1)[: len(ids)]
            self.add(ids, torch.stack([torch.stack((layer.keys[row][:, columns], layer.values[row][:, columns]))
                                       for layer in cache.layers]))
        for hit, ids in zip(hits, sequences):
            extended = hit is not None and len(hit.ids) < len(ids) and ids[: len(hit.ids)] == hit.ids
            if extended and tuple(ids) in self._sequences:
                self.discard(hit)


    def assemble(self, hits: list[tuple[KeptSequence | None, int]], width: int) -> DynamicCache:
        """A batch's cache of `width` columns: row r holds the KV of its kept sequence's first n tokens right-aligned
        (hits[r] = (kept, n)), zeros before them (the caller masks them); rows without a hit are all zeros."""
        _, layers, _, heads, _, dim = self._pool.shape
        past = self._pool.new_zeros(layers, 2, len(hits), heads, width, dim)
        for row, (kept, n) in enumerate(hits):
            if n:
                past[:, :, row, :, width - n :] = self.kv(kept, n)
        return DynamicCache(ddp_cache_data=[(past[layer, 0], past[layer, 1]) for layer in range(layers)])
