"""The sample store: put/take/ack/replay through the journal, staleness, and the fairness cap."""
import asyncio
import errno
import os
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from clawd.learning.journal import Journal
from clawd.learning.store import SampleStore, fair_pick
from clawd.samples import Sample


def sample(sid: str, principal: str = "alice", version: int = 0) -> Sample:
    return Sample(sample_id=sid, mode="rl", session_id="s", turn_index=0, principal=principal,
                  tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], rollout_logprobs=[-0.5, -1.0],
                  temperature=1.0, reward=1.0, teacher_logprobs=None, has_hint=False,
                  policy_version=version, created=1.0, scored=2.0)


async def open_store(path, **kw) -> SampleStore:
    store = SampleStore(Journal(path, segment_bytes=kw.pop("segment_bytes", 64 << 20)), **kw)
    await store.replay()
    return store


# ---- fair_pick: exact tables ----------------------------------------------------------------

A, B, C, D, E = "abcde"

FAIR_TABLE = [
    # principals oldest first,            n, share, chosen indices
    # at least 1/share principals waiting: the cap max(1, floor(share*n)) is hard, the batch may be short
    ([A, A, A, B, A, C, D, B, E, A],       8, 0.25, [0, 1, 3, 5, 6, 7, 8]),
    ([A] * 6 + [B, C, D],                  8, 0.25, [0, 1, 6, 7, 8]),
    ([A, B, C, D, E] * 3,                  10, 0.25, list(range(10))),    # n not divisible: cap 2, 5 principals
    ([A, B, C, D] * 4,                     10, 0.25, list(range(8))),     # cap 2 × 4 principals = 8 of 10
    ([A, B, C, D] * 4,                     3, 0.25, [0, 1, 2]),           # floor(0.75) = 0 -> cap 1
    ([A, A, A, B],                         4, 0.5, [0, 1, 3]),
    # fewer than 1/share principals: the cap rises one step at a time, oldest first at each step
    ([A, A, A, A, B, A, C],                4, 0.25, [0, 1, 4, 6]),
    ([A, A, A, A, B, A, C],                6, 0.25, [0, 1, 2, 3, 4, 6]),  # cap floor(1.5)=1 -> 2 -> 3 -> 4
    ([A, A, A, B, B, B, C],                5, 0.25, [0, 1, 3, 4, 6]),
    ([B, A, A, B, A, C],                   5, 0.25, [0, 1, 2, 3, 5]),
    ([A] * 4,                              4, 0.5, [0, 1, 2, 3]),
    # one principal: the batch fills oldest first
    ([A] * 5,                              3, 0.25, [0, 1, 2]),
    ([A] * 5,                              10, 0.25, [0, 1, 2, 3, 4]),
    # share 1.0: no cap at all
    ([A, A, B, A],                         3, 1.0, [0, 1, 2]),
    # nothing to take
    ([],                                   4, 0.25, []),
    ([A, B],                               0, 0.25, []),
]


@pytest.mark.parametrize("principals,n,share,expected", FAIR_TABLE)
def test_fair_pick_table(principals, n, share, expected):
    assert fair_pick(principals, n, share) == expected


def test_fair_pick_cap_is_exact_for_shares_that_floats_round_badly():
    chosen = fair_pick([A] * 100 + [B, C, D], 100, 0.29)  # 0.29 * 100 = 28.999999999999996 as a float
    assert Counter(([A] * 100 + [B, C, D])[i] for i in chosen) == {A: 29, B: 1, C: 1, D: 1}
    assert fair_pick([A] * 10 + [B, C], 10, 0.3) == [*range(8), 10, 11]  # ceil(1/0.3) = 4 > 3 principals: cap yields
    with pytest.raises(ValueError):
        fair_pick([A], 1, 0.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("abcdef"), max_size=40), st.integers(0, 20),
       st.sampled_from([0.1, 0.25, 1 / 3, 0.5, 1.0]))
def test_fair_pick_rules_hold_for_any_queue(principals, n, share):
    chosen = fair_pick(principals, n, share)
    assert chosen == sorted(set(chosen)) and len(chosen) <= n
    per = Counter(principals[i] for i in chosen)
    for p, k in per.items():  # each principal's chosen samples are its oldest ones
        assert [i for i in chosen if principals[i] == p] == [i for i, q in enumerate(principals) if q == p][:k]
    if len(set(principals)) >= round(1 / share + 0.4999):  # ceil(1/share), exact for these shares
        assert max(per.values(), default=0) <= max(1, int(share * n + 1e-9))
    else:
        assert len(chosen) == min(n, len(principals))  # the cap yields until the batch fills


# ---- the store ----------------------------------------------------------------------------------

async def test_put_take_ack_replay_cycle(tmp_path):
    store = await open_store(tmp_path)
    for i in range(5):
        await store.put(sample(f"s{i}"))
    assert (store.waiting, store.depth) == (5, 5)
    batch, dropped = store.take_batch(3, current_version=0, max_staleness=2)
    assert [s.sample_id for s in batch] == ["s0", "s1", "s2"] and dropped == []
    assert (store.waiting, store.in_flight, store.depth) == (2, 3, 5)
    assert await store.ack(["s0", "s2"]) == 2
    assert (store.in_flight, store.depth) == (1, 3)
    await store.journal.close()

    again = await open_store(tmp_path)  # s1 was taken but never acked: it is trained again
    assert [s.sample_id for s in again._waiting] == ["s1", "s3", "s4"]
    assert again._waiting[0] == sample("s1")
    batch, _ = again.take_batch(10, current_version=0, max_staleness=2)
    await again.ack([s.sample_id for s in batch])
    await again.journal.close()
    assert (await open_store(tmp_path)).waiting == 0


async def test_stale_samples_are_dropped_counted_and_acked_with_the_next_ack(tmp_path):
    store = await open_store(tmp_path)
    for i, v in enumerate([0, 3, 1, 2, 3]):
        await store.put(sample(f"s{i}", version=v))
    batch, dropped = store.take_batch(10, current_version=3, max_staleness=1)  # keeps versions 2 and 3
    assert [s.sample_id for s in batch] == ["s1", "s3", "s4"]
    assert [s.sample_id for s in dropped] == ["s0", "s2"] and store.dropped_stale == 2
    assert store.depth == 5  # the drops ride along with the next ack
    await store.ack([])
    assert store.depth == 3
    await store.journal.close()
    assert [s.sample_id for s in (await open_store(tmp_path))._waiting] == ["s1", "s3", "s4"]


async def test_take_batch_applies_fairness_and_deferred_samples_keep_their_order(tmp_path):
    store = await open_store(tmp_path)
    for i, p in enumerate([A, A, A, B, A, C, D, B, E, A]):
        await store.put(sample(f"s{i}", principal=p))
    assert store.waiting_by_principal() == {A: 5, B: 2, C: 1, D: 1, E: 1}
    batch, _ = store.take_batch(8, current_version=0, max_staleness=0)
    assert [s.sample_id for s in batch] == ["s0", "s1", "s3", "s5", "s6", "s7", "s8"]
    assert [s.sample_id for s in store._waiting] == ["s2", "s4", "s9"]
    assert store.waiting_by_principal() == {A: 3}
    batch, _ = store.take_batch(8, current_version=0, max_staleness=0)  # one principal now: the cap yields
    assert [s.sample_id for s in batch] == ["s2", "s4", "s9"]


async def test_fairness_counts_only_fresh_samples(tmp_path):
    store = await open_store(tmp_path)
    for i, (p, v) in enumerate([(A, 5), (B, 0), (C, 0), (D, 0), (A, 5), (A, 5)]):
        await store.put(sample(f"s{i}", principal=p, version=v))
    batch, dropped = store.take_batch(4, current_version=5, max_staleness=1)  # b, c, d are stale: a alone
    assert [s.sample_id for s in batch] == ["s0", "s4", "s5"] and len(dropped) == 3


async def test_wait_for_wakes_on_put_and_counts_fresh_samples(tmp_path):
    store = await open_store(tmp_path)
    waiter = asyncio.create_task(store.wait_for(2))
    fresh_waiter = asyncio.create_task(store.wait_for(2, current_version=4, max_staleness=1))
    await store.put(sample("s0", version=0))
    await asyncio.sleep(0)
    assert not waiter.done()
    await store.put(sample("s1", version=4))
    await asyncio.wait_for(waiter, 5)
    assert not fresh_waiter.done()  # s0 is stale at version 4
    await store.put(sample("s2", version=3))
    await asyncio.wait_for(fresh_waiter, 5)
    await store.wait_for(1)  # already true: returns at once


async def test_put_is_not_visible_when_the_journal_write_fails(tmp_path, monkeypatch):
    store = await open_store(tmp_path)

    def full(fd, b):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(Exception, match="No space"):
        await store.put(sample("s0"))
    assert store.waiting == 0 and store.depth == 0


async def test_ack_compacts_fully_acked_segments(tmp_path):
    store = await open_store(tmp_path, segment_bytes=1)  # a segment per journal write
    for i in range(4):
        await store.put(sample(f"s{i}"))
    assert len(list(tmp_path.glob("*.seg"))) == 4
    batch, _ = store.take_batch(2, current_version=0, max_staleness=0)
    await store.ack([s.sample_id for s in batch])  # segments 1, 2 go; 3, 4 hold s2, s3; 5 is active
    assert sorted(p.name[-7:-4] for p in tmp_path.glob("*.seg")) == ["003", "004", "005"]
    await store.journal.close()
    assert [s.sample_id for s in (await open_store(tmp_path))._waiting] == ["s2", "s3"]


async def test_replay_refuses_entries_that_are_not_samples(tmp_path):
    j = Journal(tmp_path)
    j.open()
    await j.append("x", b'{"v": 99, "sample": {}}')
    await j.close()
    with pytest.raises(ValueError, match="'x' is not a readable sample: sample format 99"):
        await open_store(tmp_path)
