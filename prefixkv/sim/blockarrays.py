"""A trace's block references as flat arrays, for the compiled replay (``prefixkv.sim.fastreplay``).

Request ``i`` references the dense block ids ``ids[offsets[i]:offsets[i + 1]]`` (every distinct
hash gets one id, 0, 1, 2, ... in order of first reference), holds ``total_blocks[i]`` blocks while
it is admitted (a token request's partly filled last block is held but names no hash) and counts
``accesses[i]`` block accesses. These are exactly the prompts ``replay`` builds request by request
(``replay._prompt_for``), converted once: a compiled loop then reads integers only.

numpy only (no numba): the general replay never needs this module, and it imports without numba.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..hashing import as_hash_list


@dataclass(frozen=True, eq=False)
class BlockArrays:
    """One trace's block references in arrays; see the module doc. No request names an id twice
    (the loaders refuse such requests, and ``block_arrays`` checks the others as the manager does)."""

    offsets: np.ndarray             # int64, len(requests) + 1
    ids: np.ndarray                 # int32 (int64 past 2**31 distinct hashes), the dense ids
    num_ids: int                    # distinct hashes
    total_blocks: np.ndarray        # int64 per request: blocks held while admitted
    accesses: np.ndarray            # int64 per request: block accesses counted
    input_length: np.ndarray        # int64 per request: prompt tokens
    last_block_tokens: np.ndarray   # int64 per request: tokens of its last accessed block, -1 for a token request

    @property
    def num_requests(self) -> int:
        return self.offsets.shape[0] - 1


def _dense(chains: list, total: int) -> tuple[np.ndarray, int]:
    """Dense ids (first reference first) of every hash in ``chains``, concatenated."""
    try:        # integer ids (every loaded hashed trace): numpy sorts them in C
        raw = np.fromiter(chain.from_iterable(chains), np.int64, total)
    except (TypeError, ValueError, OverflowError):     # other hashables (tuples, bytes, big ints)
        raw = None
    if raw is not None:
        uniques, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
        # renumber by first reference, as the dict below numbers them (ids then grow along the trace)
        rank = np.empty(uniques.shape[0], np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(uniques.shape[0])
        dense = rank[inverse]
        n = uniques.shape[0]
    else:
        numbering: dict = {}
        setdefault = numbering.setdefault
        dense = np.fromiter((setdefault(h, len(numbering)) for h in chain.from_iterable(chains)), np.int64, total)
        n = len(numbering)
    return dense.astype(np.int32 if n < 2**31 - 1 else np.int64), n


def block_arrays(trace, hash_seed: int | None = 0) -> BlockArrays:
    """``trace``'s block references as arrays, the prompts ``replay`` would build (token requests
    hashed as its manager hashes them, with ``hash_seed``). A trace no loader checked has each
    request's ids checked as the manager checks them (``as_hash_list``: the same error for None,
    an unhashable id or an id named twice in a request)."""
    size = trace.block_size
    requests = trace.requests
    n = len(requests)
    chains: list = [None] * n
    total_blocks = np.empty(n, np.int64)
    accesses = np.empty(n, np.int64)
    input_length = np.fromiter((r.input_length for r in requests), np.int64, n)
    last_tokens = np.empty(n, np.int64)
    mgr = None
    checked = getattr(trace, "checked_hashes", False)
    for i, r in enumerate(requests):
        if r.tokens is not None:
            if mgr is None:
                from ..manager import KVCacheManager
                mgr = KVCacheManager(1, size, hash_seed=hash_seed, index="dict")
            hashes = mgr.prompt(r.tokens, salt=getattr(r, "salt", None)).block_hashes()
            chains[i] = hashes
            accesses[i] = len(hashes)
            total_blocks[i] = -(-len(r.tokens) // size)
            last_tokens[i] = -1
        else:
            hashes = r.block_hashes if checked else as_hash_list(r.block_hashes)
            k = len(hashes)
            chains[i] = hashes
            accesses[i] = total_blocks[i] = k
            # replay._prompt_for: the last id's block holds the rest of the prompt, at most a block
            last_tokens[i] = min(size, r.input_length - (k - 1) * size) if k else 0
    counts = np.fromiter((len(c) for c in chains), np.int64, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    ids, num_ids = _dense(chains, int(offsets[-1]))
    return BlockArrays(offsets, ids, num_ids, total_blocks, accesses, input_length, last_tokens)
