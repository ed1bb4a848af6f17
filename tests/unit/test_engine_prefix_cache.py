"""Prefix cache: longest-prefix match, extension replaces, LRU eviction within the token budget."""

import numpy as np
import pytest
import torch

from verst.engine.prefix_cache import BLOCK, PrefixCache


def _kv(n, layers=2):
    return lambda: [(torch.full((1, n, 2), float(n)), torch.full((1, n, 2), -float(n))) for _ in range(layers)]


def test_match_finds_the_longest_shared_prefix_token_by_token():
    cache = PrefixCache(max_tokens=1000)
    seq = list(range(40))
    cache.insert(seq, _kv(40), None)
    entry, n = cache.match(seq[:37] + [999, 5])
    assert entry is not None and n == 37
    entry, n = cache.match(seq + [1, 2, 3])
    assert n == 40 and entry.kv[0][0].shape == (1, 40, 2)
    assert cache.match([7] * 40) == (None, 0)
    assert cache.match(seq[: BLOCK - 1]) == (None, 0)  # shorter than one block: not indexed


def test_a_sequence_that_extends_a_cached_one_replaces_it():
    cache = PrefixCache(max_tokens=1000)
    first = list(range(32))
    cache.insert(first, _kv(32), None)
    cache.insert(first + [100, 101, 102], _kv(35), None)
    assert len(cache) == 1 and cache.num_tokens == 35
    cache.insert(first[:20], _kv(20), None)  # already inside: not stored twice
    assert len(cache) == 1


def test_least_recently_used_is_evicted_over_budget_and_flush_empties():
    cache = PrefixCache(max_tokens=70)
    a, b, c = [list(range(k, k + 32)) for k in (0, 1000, 2000)]
    cache.insert(a, _kv(32), None)
    cache.insert(b, _kv(32), None)
    cache.match(a + [1])  # a is now more recent than b
    cache.insert(c, _kv(32), np.zeros((32, 2, 2), dtype=np.int32))
    assert cache.num_tokens == 64
    assert cache.match(b)[0] is None and cache.match(a)[0] is not None and cache.match(c)[0].experts is not None
    cache.flush()
    assert len(cache) == 0 and cache.num_tokens == 0 and cache.match(a) == (None, 0)


def test_disabled_cache_stores_nothing_and_reads_no_kv():
    cache = PrefixCache(max_tokens=0)

    def never():
        raise AssertionError("KV read although the cache is disabled")

    cache.insert(list(range(64)), never, None)
    assert len(cache) == 0
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        PrefixCache(-1)
