"""kvdepot.server.index: prefix-aware LRU eviction, readers, flush and checked transitions."""

from __future__ import annotations

import random

import pytest

from kvdepot.server.index import ChunkIndex, Entry, EntryState

SIZE = 4096


class Freed:
    """The index's free_fn: records what was freed, and refuses to free one entry twice."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.evicted: list[bytes] = []  # keys freed by LRU eviction (a lower tier may keep them)
        self._entries: list[Entry] = []

    def __call__(self, e: Entry, evicted: bool) -> None:
        assert all(x is not e for x in self._entries), f"{e.key!r} freed twice"
        assert e.state is None, "freed while still in a state"
        self._entries.append(e)
        self.keys.append(e.key)
        if evicted:
            self.evicted.append(e.key)


@pytest.fixture
def freed() -> Freed:
    return Freed()


@pytest.fixture
def index(freed) -> ChunkIndex:
    return ChunkIndex(freed)


def k(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def put(index: ChunkIndex, name: str, parent: str = "", model: str = "m", salt: str = "") -> Entry:
    e = index.begin_write(k(name), k(parent) if parent else b"", len(index) * SIZE, SIZE, model, salt)
    index.commit(e)
    return e


def chain(index: ChunkIndex, *names: str, **kw) -> list[Entry]:
    out, parent = [], ""
    for n in names:
        out.append(put(index, n, parent, **kw))
        parent = n
    return out


def evict_all(index: ChunkIndex) -> list[bytes]:
    order = []
    while (e := index.evict_one()) is not None:
        order.append(e.key)
    return order


# --------------------------------------------------------------------------- eviction order


def test_leaves_first_then_lru_among_leaves(index, freed):
    chain(index, "a0", "a1", "a2")  # a0 is the least recently used entry but has a child
    put(index, "b0")
    assert evict_all(index) == [k("a2"), k("a1"), k("a0"), k("b0")]
    assert freed.keys == [k("a2"), k("a1"), k("a0"), k("b0")]
    assert len(index) == 0 and index.evictions == 4


def test_branching_chain(index):
    #   r -> x1 -> x2
    #     \-> y1
    chain(index, "r", "x1", "x2")
    put(index, "y1", "r")
    assert index.get(k("r")).children == 2
    assert index.evict_one().key == k("x2")
    assert index.evict_one().key == k("x1")  # older leaf than y1
    assert index.evict_one().key == k("y1")
    assert index.evict_one().key == k("r")


def test_touch_chain_makes_parents_newer_than_children(index):
    chain(index, "a0", "a1", "a2")
    chain(index, "b0", "b1")
    index.touch_chain([k("a0"), k("a1"), k("a2")])  # a hit: a is now most recent
    assert list(e.key for e in index.entries()) == [k("b0"), k("b1"), k("a2"), k("a1"), k("a0")]
    assert evict_all(index) == [k("b1"), k("b0"), k("a2"), k("a1"), k("a0")]


def test_touch_chain_ignores_missing_keys(index):
    chain(index, "a0", "a1")
    put(index, "c")
    index.touch_chain([k("a0"), k("zz"), k("a1")])
    assert [e.key for e in index.entries()] == [k("c"), k("a1"), k("a0")]


def test_prefix_eviction_keeps_chains_whole(index, seed):
    """Random chains and hits: an evicted entry never leaves a cached child behind, so every
    cached entry's whole prefix stays cached."""
    rng = random.Random(seed)
    names = []
    for c in range(12):
        chain(index, *[f"c{c}.{i}" for i in range(rng.randrange(1, 6))])
        names.append([f"c{c}.{i}" for i in range(6)])
    for _ in range(30):
        c = rng.choice(names)
        present = [k(n) for n in c if index.get(k(n)) is not None]
        index.touch_chain(present[: rng.randrange(len(present) + 1)])
        if rng.random() < 0.6:
            victim = index.evict_one()
            assert victim is not None and victim.children == 0
        for e in index.entries():
            if e.parent:
                assert index.get(e.parent) is not None, "an entry outlived its parent"
            assert e.children == sum(1 for x in index.entries() if x.parent == e.key)


# --------------------------------------------------------------------------- never evicted


def test_entry_with_readers_is_never_evicted(index, freed):
    a = put(index, "a")
    b = put(index, "b")
    index.acquire(a)
    index.acquire(a)
    assert index.evict_one() is b
    assert index.evict_one() is None
    index.release(a)
    assert index.evict_one() is None  # one reader left
    index.release(a)
    assert index.evict_one() is a
    assert freed.keys == [k("b"), k("a")]


def test_writing_entry_is_never_evicted_nor_visible(index, freed):
    w = index.begin_write(k("w"), b"", 0, SIZE, "m", "")
    assert w.state is EntryState.WRITING
    assert index.get(k("w")) is w and index.ready(k("w")) is None
    assert index.evict_one() is None
    index.commit(w)
    assert index.ready(k("w")) is w
    assert index.evict_one() is w and freed.keys == [k("w")]


def test_entry_with_children_is_never_evicted(index):
    a = put(index, "a")
    child = index.begin_write(k("a1"), k("a"), SIZE, SIZE, "m", "")  # a child still being written
    assert a.children == 1
    assert index.evict_one() is None
    index.commit(child)
    index.acquire(child)
    assert index.evict_one() is None  # the only leaf has a reader
    index.release(child)
    assert index.evict_one() is child
    assert a.children == 0 and index.evict_one() is a


# --------------------------------------------------------------------------- flush


def test_flush_in_use_hides_at_once_and_frees_on_last_release(index, freed):
    a = put(index, "a", salt="t1")
    b = put(index, "b", salt="t2")
    index.acquire(a)
    index.acquire(a)
    assert index.drop_where(lambda e: e.cache_salt == "t1") == (1, SIZE)
    assert index.get(k("a")) is None and index.ready(k("a")) is None and len(index) == 1
    assert a.state is EntryState.DOOMED
    assert freed.keys == []
    with pytest.raises(AssertionError):
        index.acquire(a)  # a doomed entry takes no new readers
    index.release(a)
    assert freed.keys == []
    index.release(a)
    assert freed.keys == [k("a")]
    assert a.state is None
    assert index.ready(k("b")) is b


def test_flush_frees_idle_entries_now(index, freed):
    chain(index, "a0", "a1", model="m1")
    chain(index, "b0", "b1", model="m2")
    assert index.drop_where(lambda e: e.model == "m1") == (2, 2 * SIZE)
    assert sorted(freed.keys) == sorted([k("a0"), k("a1")])
    assert [e.key for e in index.entries()] == [k("b0"), k("b1")]
    assert index.drop_where(lambda e: True) == (2, 2 * SIZE)
    assert len(index) == 0 and index.evictions == 0  # flushes are not evictions


def test_flush_drops_descendants_of_dropped_entries(index, freed):
    """A partial flush (here: one tenant's chunk that another request chained onto) takes the
    chunks that depend on it too; re-storing the prefix later leaves a consistent index."""
    chain(index, "a0", salt="t1")
    put(index, "a1", "a0", salt="t2")
    put(index, "a2", "a1", salt="t2")
    put(index, "b", salt="t2")
    index.touch_chain([k("a0"), k("a1"), k("a2")])  # LRU order now b, a2, a1, a0: children first
    assert index.drop_where(lambda e: e.cache_salt == "t1") == (3, 3 * SIZE)
    assert sorted(freed.keys) == sorted([k("a0"), k("a1"), k("a2")])
    assert [e.key for e in index.entries()] == [k("b")]
    a0 = put(index, "a0", salt="t1")
    a1 = put(index, "a1", "a0", salt="t2")
    assert a0.children == 1
    assert evict_all(index) == [k("b"), k("a1"), k("a0")]
    assert a1.state is None and len(index) == 0


def test_flushed_key_can_be_stored_again_while_old_entry_is_read(index, freed):
    old = put(index, "a")
    index.acquire(old)
    index.drop_where(lambda e: True)
    new = put(index, "a")
    assert index.ready(k("a")) is new
    index.release(old)
    assert freed.keys == [k("a")] and index.ready(k("a")) is new


def test_commit_after_flush_while_writing_frees_and_does_not_publish(index, freed):
    parent = put(index, "p")
    w = index.begin_write(k("w"), k("p"), SIZE, SIZE, "m", "")
    assert index.drop_where(lambda e: e.key == k("w")) == (1, SIZE)
    assert freed.keys == []  # the copy still writes into its memory
    assert parent.children == 0
    index.commit(w)
    assert freed.keys == [k("w")]
    assert index.get(k("w")) is None and index.ready(k("w")) is None
    assert w.state is None


def test_commit_after_flush_does_not_hide_a_new_entry_of_the_same_key(index, freed):
    w = index.begin_write(k("w"), b"", 0, SIZE, "m", "")
    index.drop_where(lambda e: True)
    again = put(index, "w")
    index.commit(w)
    assert freed.keys == [k("w")] and index.ready(k("w")) is again


def test_abort_frees(index, freed):
    p = put(index, "p")
    c = index.begin_write(k("c"), k("p"), SIZE, SIZE, "m", "")
    index.abort(c)
    assert freed.keys == [k("c")] and index.get(k("c")) is None and p.children == 0
    assert c.state is None
    assert index.evict_one() is p


def test_abort_after_flush_frees_once(index, freed):
    w = index.begin_write(k("w"), b"", 0, SIZE, "m", "")
    index.drop_where(lambda e: True)
    index.abort(w)
    assert freed.keys == [k("w")]


def test_abort_tail_first(index, freed):
    ws = []
    parent = b""
    for n in ("a", "b", "c"):
        ws.append(index.begin_write(k(n), parent, 0, SIZE, "m", ""))
        parent = k(n)
    for w in reversed(ws):
        index.abort(w)
    assert freed.keys == [k("c"), k("b"), k("a")] and len(index) == 0


def test_children_of_a_writing_parent_are_dropped_when_it_aborts(index, freed):
    """A store in flight: the next chunks (another store) chain onto a WRITING parent. They
    are never visible before it is READY, and go with it if its copy fails."""
    a = put(index, "a")
    b = index.begin_write(k("b"), k("a"), SIZE, SIZE, "m", "")  # store 1, copy in flight
    c = index.begin_write(k("c"), k("b"), 2 * SIZE, SIZE, "m", "")  # store 2 chains onto it
    d = index.begin_write(k("d"), k("c"), 3 * SIZE, SIZE, "m", "")
    index.commit(c)  # store 2's first copy ended before store 1's
    assert index.ready(k("c")) is c and index.ready(k("b")) is None
    assert index.evict_one() is None  # a READY entry whose parent is WRITING is still a parent
    index.abort(b)
    assert index.get(k("b")) is None and index.get(k("c")) is None and index.get(k("d")) is None
    assert freed.keys == [k("c"), k("b")]  # d's memory is its writer's to free
    index.commit(d)  # store 2's last copy ends after the abort: freed, never published
    assert freed.keys == [k("c"), k("b"), k("d")] and index.get(k("d")) is None
    assert a.children == 0 and index.evict_one() is a and len(index) == 0


def test_children_of_a_writing_parent_survive_its_commit(index, freed):
    put(index, "a")
    b = index.begin_write(k("b"), k("a"), SIZE, SIZE, "m", "")
    c = index.begin_write(k("c"), k("b"), 2 * SIZE, SIZE, "m", "")
    index.commit(c)
    index.commit(b)
    assert index.ready(k("b")) is b and index.ready(k("c")) is c and b.children == 1
    assert evict_all(index) == [k("c"), k("b"), k("a")]


# --------------------------------------------------------------------------- checked transitions


def test_checked_transitions(index):
    w = index.begin_write(k("w"), b"", 0, SIZE, "m", "")
    with pytest.raises(AssertionError, match="acquire from"):
        index.acquire(w)  # not readable while WRITING
    with pytest.raises(AssertionError, match="present key"):
        index.begin_write(k("w"), b"", 0, SIZE, "m", "")
    index.commit(w)
    with pytest.raises(AssertionError, match="commit from"):
        index.commit(w)
    with pytest.raises(AssertionError, match="abort from"):
        index.abort(w)
    with pytest.raises(AssertionError, match="release without acquire"):
        index.release(w)
    index.acquire(w)
    index.release(w)
    assert w.readers == 0 and w.state is EntryState.READY


def test_no_transitions_after_free(index):
    a = put(index, "a")
    assert index.evict_one() is a and a.state is None
    for op in (index.commit, index.abort, index.acquire, index.release):
        with pytest.raises(AssertionError):
            op(a)


# --------------------------------------------------------------------------- parents in a lower tier


def test_parent_in_a_lower_tier_is_not_linked(index, freed):
    """A chunk whose parent is only in L2 (not in this index) is cached unlinked: evictable as
    a leaf, and a later copy of the parent in L1 never has its children count touched by it."""
    c = index.begin_write(k("c"), k("p"), SIZE, SIZE, "m", "")  # p lives in L2 only
    index.commit(c)
    assert not c.linked
    p = put(index, "p")  # p promoted to L1 after its child came
    assert p.children == 0
    assert index.evict_one() is c  # c is LRU and a leaf
    assert p.children == 0 and freed.evicted == [k("c")]
    d = put(index, "d", "p")
    assert d.linked and p.children == 1
    assert index.evict_one() is d  # p is not a leaf while d is cached
    assert p.children == 0


def test_free_fn_tells_eviction_from_flush(index, freed):
    put(index, "a")
    put(index, "b")
    assert index.evict_one().key == k("a")
    index.drop_where(lambda e: True)
    assert freed.keys == [k("a"), k("b")] and freed.evicted == [k("a")]


def test_index_entries_are_never_tracked_by_the_garbage_collector():
    """One entry per cached chunk in L1 and in L2: tracked, a daemon with a million chunks spent
    ~0.28 s per full collection on its event loop."""
    import gc

    from kvdepot.server.disk import DiskEntry

    idx = ChunkIndex(lambda e, evicted: None)
    e = idx.begin_write(b"k" * 16, b"", 0, 4096, "m", "salt", "fp")
    idx.commit(e)
    e.readers += 1  # mutable as before
    d = DiskEntry(b"k" * 16, b"", "m", "salt", "fp", 4096, "/x")
    assert not gc.is_tracked(e) and not gc.is_tracked(d)
    assert e.state is EntryState.READY and d.file_bytes >= 4096 and e != Entry(e.key, b"", 0, 4096, "m", "salt")
