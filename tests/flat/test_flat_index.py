"""The flat hash index (``prefixkv.flat``) against a dict model.

A hypothesis state machine drives one ``FlatIndex`` (width 8, 16 or 32) and a reference model
(``model``: key -> block, the table; ``held``: block -> key, the blocks whose flag is set; ``rows``:
block -> the key last written in its row) through batches of ``setdefault_many`` (keys already
present, keys repeated inside a batch), ``assign`` (new keys, re-pointing), ``remove`` (present and
absent keys), ``remove_blocks`` (check on and off; failing batches change nothing), the pool's
eviction order (``set_held(block, None)`` then ``remove(key)``), ``clear`` and ``ensure_blocks``.
A block holds at most one key of the table at a time, as in ``BlockPool``.

The keys are chosen to make long probe runs: besides random digests there are small integers laid
out as bytes, digests that differ only in their top bits, and a pool of keys whose home slot lies in
the last two or first two slots of a 1024-, 2048- and 4096-slot table (found by brute force with the
kernel's own mix), so the runs wrap around the table's end before and after a growth, and pairs of
keys with the same 32-bit tag (the slot's copy of the hash: one home, so a probe must compare the keys
themselves). Batches of up to 300 keys and a rule that fills the table past half push it past 512
entries, so ``_reserve`` grows and rehashes it mid-run.

Besides the model, the direct tests build runs of keys sharing one home slot (and runs mixing
neighbouring homes) and delete from their middle: the backward-shift deletion case.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("numba", reason="the flat index compiles its loops with numba (not installed)")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from prefixkv.flat.index import FlatIndex  # noqa: E402

WIDTHS = (8, 16, 32)

# -- the kernel's hash, in numpy (checked against the table in test_home_matches_the_table) ---------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def home_hash(words: np.ndarray) -> np.ndarray:
    """The 64-bit mix of ``kernels._tag`` for each row of ``words`` ([n, w] uint64): its low 32 bits
    are the key's tag, ``tag & mask`` its home slot."""
    with np.errstate(over="ignore"):
        h = words[:, 0].copy()
        for j in range(1, words.shape[1]):
            h ^= words[:, j] * _GOLDEN
        h ^= h >> np.uint64(30)
        h *= _MIX1
        h ^= h >> np.uint64(27)
        h *= _MIX2
        h ^= h >> np.uint64(31)
    return h


def small_key(i: int, width: int) -> bytes:
    """``i`` laid out as bytes: the keys differ in their low word only."""
    return i.to_bytes(width, "little")


def high_key(i: int, width: int) -> bytes:
    """Keys that differ only in the top bits of their last word."""
    return (i << (8 * width - 16)).to_bytes(width, "little")


def _candidates(width: int, n: int, high: bool) -> np.ndarray:
    words = np.zeros((n, width // 8), np.uint64)
    if high:
        words[:, -1] = np.arange(n, dtype=np.uint64) << np.uint64(48)
        words[:, 0] |= np.uint64(0x5A5A)   # not the small-int keys
    else:
        words[:, 0] = np.arange(n, dtype=np.uint64)
    return words


def keys_with_home(width: int, pred, want: int) -> list[bytes]:
    """``want`` keys (small ints laid out as bytes, then top-bits-only keys) whose mix satisfies
    ``pred`` (a function of the uint64 mix array -> bool array)."""
    out: list[bytes] = []
    n = 1 << 16
    for high in (False, True):
        words = _candidates(width, n, high)
        hit = np.flatnonzero(pred(home_hash(words)))
        out += [words[i].tobytes() for i in hit[: (want + 1) // 2 if not high else want - len(out)]]
    assert len(out) == want, (width, len(out))
    return out


def _wraps(h: np.ndarray) -> np.ndarray:
    low = h & np.uint64(4095)
    return (low >= np.uint64(4094)) | (low <= np.uint64(1))


def tag_twins(width: int, pairs: int = 8) -> list[bytes]:
    """``2 * pairs`` pairs of distinct keys with the same 32-bit tag (the low half of the mix): one
    home in every table, and a probe that compares tags must still compare the keys. Half are
    small ints (they differ in the first word); half differ only in the top bits of the last word
    (for widths over 8 their first words are equal, so a comparison of the first word alone fails)."""
    n = 1 << 19
    small = _candidates(width, n, False)
    high = np.zeros((n, width // 8), np.uint64)
    high[:, 0] = np.uint64(0x5A5A)
    high[:, -1] |= np.arange(n, dtype=np.uint64) << np.uint64(40)
    out = []
    for words in (small, high):
        tags = home_hash(words) & np.uint64(0xFFFFFFFF)
        order = np.argsort(tags, kind="stable")
        same = np.flatnonzero(tags[order][1:] == tags[order][:-1])[:pairs]
        assert len(same) == pairs
        out += [words[order[i + d]].tobytes() for i in same for d in (0, 1)]
    return out


# keys whose probe runs cross the table's end in tables of 1024, 2048 and 4096 slots
HOT = {w: keys_with_home(w, _wraps, 96) for w in WIDTHS}
TWINS = {w: tag_twins(w) for w in WIDTHS}     # TWINS[w][2i], TWINS[w][2i + 1] share a tag

KEY_SPECS = st.one_of(
    st.tuples(st.just("hot"), st.integers(0, 95)),
    st.tuples(st.just("twin"), st.integers(0, 31)),
    st.tuples(st.just("small"), st.integers(0, 40)),
    st.tuples(st.just("high"), st.integers(1, 40)),
    st.tuples(st.just("rand"), st.binary(min_size=32, max_size=32)),
    st.tuples(st.just("live"), st.integers(0, 10_000)),
)
BAD_KEYS = st.one_of(
    st.binary(max_size=40),                     # wrong widths (and by chance a right one)
    st.text(max_size=8), st.integers(), st.none(), st.tuples(st.integers()),
)


class FlatIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index: FlatIndex | None = None

    @initialize(width=st.sampled_from(WIDTHS), nblocks=st.sampled_from([0, 8, 64, 700]),
                prefill=st.sampled_from([0, 0, 490]), seed=st.integers(0, 2**32 - 1))
    def start(self, width, nblocks, prefill, seed):
        self.width = width
        self.index = FlatIndex(width)
        self.index.ensure_blocks(nblocks)
        self.nblocks = nblocks
        self.model: dict[bytes, int] = {}       # key -> block (the table)
        self.held: dict[int, bytes] = {}        # block -> key, for blocks whose flag is set
        self.rows: dict[int, bytes] = {}        # block -> the key last written in its row
        self.steps = 0
        if prefill:                             # close to half full: the next batches grow it
            self.setdefault_bulk(prefill, seed, fresh=0.8)

    # -- helpers ---------------------------------------------------------------
    def key(self, spec) -> bytes:
        kind, x = spec
        w = self.width
        if kind == "hot":
            return HOT[w][x]
        if kind == "twin":
            return TWINS[w][x]
        if kind == "small":
            return small_key(x, w)
        if kind == "high":
            return high_key(x, w)
        if kind == "rand":
            return x[:w]
        live = list(self.model)                 # "live": a key in the table, if any
        return live[x % len(live)] if live else small_key(x, w)

    def q(self, keys) -> np.ndarray:
        return self.index.column(keys)

    def free_blocks(self, want: int) -> list[int]:
        """Blocks not in the table, at least ``want`` of them (growing the rows if need be)."""
        used = set(self.model.values())
        free = [b for b in range(self.nblocks) if b not in used]
        if len(free) < want:
            n = self.nblocks + want - len(free) + 3
            self.index.ensure_blocks(n)
            free += range(self.nblocks, n)
            self.nblocks = n
        return free

    def table_held(self) -> list[int]:
        """Blocks in the table whose flag is set: what ``remove_blocks`` may take."""
        return [b for b in self.model.values() if b in self.held]

    def snapshot(self):
        ix = self.index
        return ix.slots.copy(), ix.keys.copy(), ix.has.copy(), ix.count

    def model_setdefault(self, keys, blocks) -> list[int]:
        got = []
        for k, b in zip(keys, blocks):
            if k not in self.model:
                self.model[k] = b
                self.held[b] = k
                self.rows[b] = k
            got.append(self.model[k])
        return got

    def model_remove_block(self, b: int) -> None:
        k = self.held.pop(b)
        assert self.model.pop(k) == b

    def expected_bad(self, blocks) -> int:
        ok = set(self.table_held())
        seen = set()
        for i, b in enumerate(blocks):
            if b not in ok or b in seen:
                return i
            seen.add(b)
        return -1

    # -- rules -----------------------------------------------------------------
    @rule(specs=st.lists(KEY_SPECS, max_size=8), picks=st.randoms(use_true_random=False))
    def setdefault_small(self, specs, picks):
        keys = [self.key(s) for s in specs]
        if keys and picks.random() < 0.5:
            keys.append(keys[picks.randrange(len(keys))])   # a repeat inside the batch
        blocks = picks.sample(self.free_blocks(len(keys)), len(keys))
        got = self.index.setdefault_many(self.q(keys), blocks)
        assert got == self.model_setdefault(keys, blocks)

    @rule(n=st.one_of(st.integers(0, 40), st.integers(100, 300)), seed=st.integers(0, 2**32 - 1))
    def setdefault_many(self, n, seed):
        self.setdefault_bulk(n, seed)

    def setdefault_bulk(self, n, seed, fresh=0.45):
        """``n`` keys: live ones, repeats, hot ones, small ints and (a ``fresh`` share) random."""
        rng = random.Random(seed)
        w = self.width
        live = list(self.model)
        keys: list[bytes] = []
        for _ in range(n):
            r = rng.random()
            if r < fresh:
                keys.append(rng.randbytes(w))
            elif r < fresh + 0.1 and live:
                keys.append(rng.choice(live))
            elif r < fresh + 0.2 and keys:
                keys.append(rng.choice(keys))
            elif r < 0.8:
                keys.append(rng.choice(HOT[w]))
            elif r < 0.9:
                keys.append(rng.choice(TWINS[w]))
            else:
                keys.append((small_key if rng.random() < 0.5 else high_key)(rng.randrange(1, 600), w))
        blocks = rng.sample(self.free_blocks(n), n)
        got = self.index.setdefault_many(self.q(keys), blocks)
        assert got == self.model_setdefault(keys, blocks)

    @precondition(lambda self: self.index.slots.shape[0] <= 2048)
    @rule(extra=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
    def grow_table(self, extra, seed):
        """A batch that takes the table past half full: ``_reserve`` doubles it and rehashes."""
        size = self.index.slots.shape[0]
        self.setdefault_bulk(size // 2 - len(self.index) + extra, seed, fresh=0.7)
        assert self.index.slots.shape[0] == 2 * size

    @rule(spec=KEY_SPECS, same=st.booleans(), pick=st.integers(0, 10_000))
    def assign(self, spec, same, pick):
        k = self.key(spec)
        old = self.model.get(k)
        if same and old is not None:
            b = old
        else:
            free = self.free_blocks(1)
            b = free[pick % len(free)]
        assert self.index.assign(k, b) is None
        if old is not None and old != b:
            self.held.pop(old, None)
        self.model[k] = b
        self.held[b] = k
        self.rows[b] = k

    @rule(spec=KEY_SPECS)
    def remove(self, spec):
        k = self.key(spec)
        if k in self.model:
            b = self.model.pop(k)
            self.held.pop(b, None)
            assert self.index.remove(k) == b
        else:
            with pytest.raises(KeyError):
                self.index.remove(k)

    @rule(bad=BAD_KEYS)
    def remove_not_a_key(self, bad):
        if isinstance(bad, bytes) and len(bad) == self.width:
            return
        with pytest.raises(KeyError):
            self.index.remove(bad)

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 10_000))
    def evict(self, pick):
        """BlockPool's order: ``block_hash[b] = None`` then ``del cached[h]``."""
        live = list(self.model)
        k = live[pick % len(live)]
        b = self.model[k]
        self.index.set_held(b, None)
        self.held.pop(b, None)
        assert self.index.get(k) == b           # found while the flag is already clear
        assert self.index.hash_of(b) is None
        assert self.index.remove(k) == b
        del self.model[k]

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 10_000))
    def unflag(self, pick):
        """The first half of an eviction alone: the entry stays, its block no longer holds it."""
        live = list(self.model)
        b = self.model[live[pick % len(live)]]
        self.index.set_held(b, None)
        self.held.pop(b, None)

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 10_000))
    def reflag(self, pick):
        """``block_hash[b] = h`` for the key the block has in the table."""
        live = list(self.model)
        k = live[pick % len(live)]
        b = self.model[k]
        self.index.set_held(b, k)
        self.held[b] = k
        self.rows[b] = k

    @rule(spec=KEY_SPECS, pick=st.integers(0, 10_000))
    def flag_free_block(self, spec, pick):
        """A block outside the table says it holds a key (not in the table under it)."""
        k = self.key(spec)
        free = self.free_blocks(1)
        b = free[pick % len(free)]
        self.index.set_held(b, k)
        self.held[b] = k
        self.rows[b] = k

    @rule(picks=st.randoms(use_true_random=False), frac=st.floats(0, 1), check=st.booleans())
    def remove_blocks_valid(self, picks, frac, check):
        cand = self.table_held()
        blocks = picks.sample(cand, int(len(cand) * frac))
        assert self.index.remove_blocks(blocks, check=check) == -1
        for b in blocks:
            self.model_remove_block(b)

    @rule(picks=st.randoms(use_true_random=False), frac=st.floats(0, 1),
          kind=st.sampled_from(["free", "flagged_free", "unflagged", "twice", "out_of_range", "negative"]))
    def remove_blocks_invalid(self, picks, frac, kind):
        cand = self.table_held()
        blocks = picks.sample(cand, int(len(cand) * frac))
        at = picks.randrange(len(blocks) + 1)
        if kind == "free":                      # no key in the table (its flag may be set)
            free = self.free_blocks(1)
            bad = picks.choice(free)
        elif kind == "flagged_free":            # its flag set, but no entry of the table names it
            used = set(self.model.values())
            flagged = [b for b in self.held if b not in used]
            if not flagged:
                return
            bad = picks.choice(flagged)
        elif kind == "unflagged":               # in the table, flag clear
            unflagged = [b for b in self.model.values() if b not in self.held]
            if not unflagged:
                return
            bad = picks.choice(unflagged)
        elif kind == "twice":
            if not blocks:
                return
            at = picks.randrange(1, len(blocks) + 1)
            bad = blocks[picks.randrange(at)]
        elif kind == "out_of_range":
            bad = self.nblocks + picks.randrange(3)
        else:
            bad = -1 - picks.randrange(3)
        blocks.insert(at, bad)
        want = self.expected_bad(blocks)
        assert 0 <= want <= at
        before = self.snapshot()
        assert self.index.remove_blocks(blocks, check=True) == want
        after = self.snapshot()
        for x, y in zip(before, after):
            assert np.array_equal(x, y)

    @rule()
    def clear(self):
        self.index.clear()
        self.model.clear()
        self.held.clear()

    @rule(extra=st.integers(-5, 300))
    def ensure_blocks(self, extra):
        self.index.ensure_blocks(self.nblocks + extra)
        self.nblocks = max(self.nblocks, self.nblocks + extra)

    # -- invariants ------------------------------------------------------------
    @invariant()
    def matches_model(self):
        if self.index is None:
            return
        self.steps += 1
        ix, model = self.index, self.model
        rng = random.Random(f"invariant {self.steps}")   # not a stream the rules' seeds draw
        w = self.width
        assert len(ix) == len(model)
        size = ix.slots.shape[0]
        assert size >= 1024 and size & (size - 1) == 0 and 2 * len(ix) <= size
        assert ix.has.shape[0] == ix.keys.shape[0] == self.nblocks
        # the map, one key at a time and in one batch
        for k, b in model.items():
            assert ix.get(k) == b
        keys = list(model)
        if keys:
            assert ix.lookup_many(self.q(keys)).tolist() == list(model.values())
        assert sorted(ix.blocks()) == sorted(model.values())
        # block -> key
        for b in range(self.nblocks):
            assert ix.hash_of(b) == self.held.get(b)
            assert ix.held(b) == (b in self.held)
        for b in (-1, self.nblocks):
            with pytest.raises(IndexError):
                ix.hash_of(b)
        rows = list(self.rows)
        rng.shuffle(rows)
        assert ix.hashes_of(rows) == [self.rows[b] for b in rows]
        probe_blocks = [rng.randrange(self.nblocks) for _ in range(40)] if self.nblocks else []
        assert ix.count_held(probe_blocks) == sum(b in self.held for b in probe_blocks)
        assert ix.count_held(list(range(self.nblocks))) == len(self.held)
        # a mix of present and absent keys
        absent = [k for k in HOT[w][:48] + TWINS[w] if k not in model]
        absent += [k for k in (rng.randbytes(w) for _ in range(8)) if k not in model]
        absent += [small_key(i, w) for i in range(8) if small_key(i, w) not in model]
        mix = rng.sample(keys, min(len(keys), 40)) + absent
        rng.shuffle(mix)
        assert ix.lookup_many(self.q(mix)).tolist() == [model.get(k, -1) for k in mix]
        for k in absent:
            assert ix.get(k) is None and k not in ix
        # leading runs: present keys, then (maybe) an absent one, then anything
        run = rng.sample(keys, min(len(keys), rng.randrange(0, 12)))
        tail = ([rng.choice(absent)] if rng.random() < 0.7 else []) + rng.sample(mix, min(len(mix), 5))
        q = run + tail
        want = []
        for k in q:
            if k not in model:
                break
            want.append(model[k])
        assert ix.lookup_run(self.q(q)) == want
        assert ix.lookup_run(self.q([])) == []
        # not keys of this index: not in it
        some = keys[0] if keys else HOT[w][0]
        for bad in (some[:-1], some + b"\0" * 8, some[: w // 2], some.hex(), int.from_bytes(some, "little"),
                    None, (some,), bytes(w + 1)):
            assert ix.get(bad) is None
            assert ix.get(bad, "dflt") == "dflt"
            assert bad not in ix


TestFlatIndexMachine = FlatIndexMachine.TestCase
TestFlatIndexMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


# -- direct tests -------------------------------------------------------------
def test_width_must_be_a_multiple_of_8():
    for width in (12, 0, -8, 7):
        with pytest.raises(ValueError, match="multiple of 8"):
            FlatIndex(width)
    assert FlatIndex(24).words == 3


@pytest.mark.parametrize("width", WIDTHS)
def test_column_rejects_other_keys(width):
    ix = FlatIndex(width)
    ok = bytes(range(width))
    assert ix.column([ok, ok]).shape == (2, width // 8)
    assert ix.column([]).shape == (0, width // 8)
    assert ix.column([bytearray(ok)]).tobytes() == ok
    for bad in (ok[:-1], ok + b"x", b""):
        with pytest.raises(ValueError, match=f"{width}-byte"):
            ix.column([bad])
        with pytest.raises(ValueError, match=f"{width}-byte"):
            ix.column([ok, bad])
        with pytest.raises(ValueError, match=f"{width}-byte"):
            ix.key(bad)
    for bad in ("a" * width, width, None, 1.5):
        with pytest.raises(TypeError, match=f"{width}-byte"):
            ix.column([bad])
        with pytest.raises(TypeError, match=f"{width}-byte"):
            ix.column([ok, bad])
        assert ix.get(bad) is None
        with pytest.raises(KeyError):
            ix.remove(bad)
    with pytest.raises(ValueError, match=f"{width}-byte"):
        ix.set_held(0, ok[:-1])


@pytest.mark.parametrize("width", WIDTHS)
def test_home_matches_the_table(width):
    """The test's copy of the mix puts a lone key where the kernel does (so the colliding keys
    below really collide)."""
    keys = HOT[width][:4] + [small_key(i, width) for i in range(4)] + [bytes(range(width))]
    for k in keys:
        ix = FlatIndex(width)
        ix.ensure_blocks(1)
        ix.setdefault_many(ix.column([k]), [0])
        want = int(home_hash(np.frombuffer(k, np.uint64).reshape(1, -1))[0]) & 1023
        assert np.flatnonzero(ix.slots).tolist() == [want]


def _run_keys(width: int, homes: tuple[int, ...], want: int) -> list[bytes]:
    hs = np.array(homes, np.uint64)
    return keys_with_home(width, lambda h: np.isin(h & np.uint64(1023), hs), want)


def _check_all(ix: FlatIndex, model: dict[bytes, int]) -> None:
    for k, b in model.items():
        assert ix.get(k) == b, (k, b)
    if model:
        assert ix.lookup_many(ix.column(list(model))).tolist() == list(model.values())
    assert sorted(ix.blocks()) == sorted(model.values())
    assert len(ix) == len(model)


# one home (the brief's case), a run mixing neighbouring homes (entries that must not move back
# past their home), each in the table's middle and across its end
RUNS = [(500,), (1022,), (1023,), (300, 301, 303), (1021, 1022, 0, 2)]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("homes", RUNS)
@pytest.mark.parametrize("how", ["remove", "evict", "remove_blocks"])
def test_delete_from_a_long_probe_run(width, homes, how):
    keys = _run_keys(width, homes, 40)
    rng = random.Random(f"{width} {homes} {how}")
    ix = FlatIndex(width)
    ix.ensure_blocks(64)
    blocks = rng.sample(range(64), len(keys))
    assert ix.setdefault_many(ix.column(keys), blocks) == blocks
    model = dict(zip(keys, blocks))
    assert ix.slots.shape[0] == 1024 and np.count_nonzero(ix.slots) == 40
    # delete from the middle of the run first, then the rest in a random order
    order = keys[15:25] + keys[:15] + keys[25:]
    order[10:] = rng.sample(order[10:], len(order) - 10)
    for k in order:
        b = model.pop(k)
        if how == "remove":
            assert ix.remove(k) == b
        elif how == "evict":
            ix.set_held(b, None)
            assert ix.remove(k) == b
        else:
            assert ix.remove_blocks([b], check=True) == -1
        assert ix.hash_of(b) is None
        assert ix.get(k) is None
        _check_all(ix, model)
    assert not ix.slots.any()                   # no tombstones left behind


@pytest.mark.parametrize("width", WIDTHS)
def test_keys_sharing_a_tag(width):
    """Keys with one tag (so one home): each is found as itself, before and after its twin leaves,
    whichever way it leaves, and through a growth."""
    twins = TWINS[width]
    tag = home_hash(np.frombuffer(b"".join(twins), np.uint64).reshape(len(twins), -1)) & np.uint64(0xFFFFFFFF)
    assert (tag[0::2] == tag[1::2]).all() and len(set(twins)) == len(twins)
    ix = FlatIndex(width)
    ix.ensure_blocks(2 * len(twins))
    ix.setdefault_many(ix.column(twins[0::2]), list(range(0, len(twins), 2)))
    model = {k: b for b, k in enumerate(twins) if b % 2 == 0}
    for b in range(1, len(twins), 2):               # the second of each pair: absent, then present
        assert ix.get(twins[b]) is None and ix.hash_of(b) is None
        assert ix.lookup_run(ix.column([twins[b - 1], twins[b]])) == [b - 1]
        ix.assign(twins[b], b)
        model[twins[b]] = b
    _check_all(ix, model)
    for i, b in enumerate(range(0, len(twins), 2)):  # the first of each pair leaves
        if i % 3 == 0:
            assert ix.remove(twins[b]) == b
        elif i % 3 == 1:
            assert ix.remove_blocks([b], check=True) == -1
        else:
            ix.assign(twins[b], len(twins) + b)      # re-pointed: the old block lets go
            assert ix.hash_of(b) is None and ix.hash_of(len(twins) + b) == twins[b]
            assert ix.remove(twins[b]) == len(twins) + b
        del model[twins[b]]
        assert ix.get(twins[b]) is None and ix.get(twins[b + 1]) == b + 1
        _check_all(ix, model)
    more = [random.Random(width).randbytes(width) for _ in range(600)]
    ix.ensure_blocks(64 + len(more))
    ix.setdefault_many(ix.column(more), list(range(64, 64 + len(more))))
    assert ix.slots.shape[0] == 2048
    for b in range(1, len(twins), 2):
        assert ix.get(twins[b]) == b and ix.get(twins[b - 1]) is None


@pytest.mark.parametrize("width", WIDTHS)
def test_remove_blocks_batch_from_a_run(width):
    """Deleting many blocks of one wrapping run in one call (each deletion shifts the others)."""
    keys = _run_keys(width, (1020, 1022, 1023, 1), 60)
    ix = FlatIndex(width)
    ix.ensure_blocks(60)
    ix.setdefault_many(ix.column(keys), list(range(60)))
    model = dict(zip(keys, range(60)))
    rng = random.Random(width)
    gone = rng.sample(range(60), 30)
    before = ix.slots.copy()
    assert ix.remove_blocks(gone + [gone[3]], check=True) == 30       # listed twice: no change
    assert np.array_equal(ix.slots, before) and len(ix) == 60
    assert ix.count_held(list(range(60))) == 60
    free = 60 + width                           # flagged with a key of the table, not in it
    ix.ensure_blocks(free + 1)
    ix.set_held(free, keys[gone[0]])
    assert ix.hash_of(free) == keys[gone[0]]
    before = ix.slots.copy(), ix.has.copy(), ix.keys.copy()
    assert ix.remove_blocks(gone[:5] + [free] + gone[5:], check=True) == 5
    assert all(np.array_equal(x, y) for x, y in zip(before, (ix.slots, ix.has, ix.keys))) and len(ix) == 60
    assert ix.remove_blocks([-1], check=True) == 0 and ix.remove_blocks(gone[:2] + [free + 1], check=True) == 2
    assert all(np.array_equal(x, y) for x, y in zip(before, (ix.slots, ix.has, ix.keys))) and len(ix) == 60
    assert ix.remove_blocks(gone, check=False) == -1
    for b in gone:
        del model[keys[b]]
    _check_all(ix, model)
    assert ix.count_held(list(range(60))) == 30


@pytest.mark.parametrize("width", WIDTHS)
def test_growth_keeps_every_key(width):
    """Past 512 entries the table doubles (and again), rehashing wrapping runs into new homes."""
    rng = random.Random(width)
    ix = FlatIndex(width)
    model: dict[bytes, int] = {}
    sizes = set()
    nxt = 0
    for _ in range(12):
        keys = HOT[width] + [rng.randbytes(width) for _ in range(200)] + \
            [small_key(rng.randrange(5000), width) for _ in range(50)]
        ix.ensure_blocks(nxt + len(keys))
        blocks = list(range(nxt, nxt + len(keys)))
        nxt += len(keys)
        got = ix.setdefault_many(ix.column(keys), blocks)
        assert got == [model.setdefault(k, b) for k, b in zip(keys, blocks)]
        sizes.add(ix.slots.shape[0])
        drop = rng.sample(list(model), len(model) // 4)
        assert ix.remove_blocks([model[k] for k in drop], check=True) == -1
        for k in drop:
            del model[k]
        _check_all(ix, model)
    assert {1024, 2048, 4096} <= sizes
    ix.clear()
    assert len(ix) == 0 and ix.slots.shape[0] == 1024 and not ix.has.any()
    assert ix.get(HOT[width][0]) is None
