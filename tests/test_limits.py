"""What one training step is given (clawd.learning.limits): the pure cut and split, exact values."""
from __future__ import annotations

from clawd.learning.limits import canonical, cut, split
from tests.trainer_handlers import make_sample


def samples(*lengths: int):
    return [make_sample(i, response_length=n - 3) for i, n in enumerate(lengths)]  # make_sample: n + 3 tokens


def ids(batch) -> list[str]:
    return [s.sample_id for s in batch]


def test_cut_drops_samples_over_the_limit_and_cuts_to_the_smallest_cap_capped_first():
    batch = samples(5, 9, 6, 7, 8)
    assert [len(s.tokens) for s in batch] == [5, 9, 6, 7, 8]
    assert tuple(map(ids, cut(batch, {}, 8))) == (["s0", "s2", "s3", "s4"], [], ["s1"])
    assert tuple(map(ids, cut(batch, {"s3": 2, "s4": 3}, 100))) == (["s3", "s4"], ["s0", "s1", "s2"], [])
    assert tuple(map(ids, cut(batch, {"s2": 1}, 6))) == (["s2"], ["s0"], ["s1", "s3", "s4"])
    assert tuple(map(ids, cut(batch, {"other": 1}, 100))) == (ids(batch), [], [])  # caps of samples not here


def test_split_halves_the_caps_never_raises_one_and_excludes_a_batch_of_one():
    batch = samples(5, 5, 5, 5, 5)
    caps, out = split(batch, {})
    assert caps == {f"s{i}": 2 for i in range(5)} and out == []
    caps, out = split(batch[:2], caps)
    assert caps == {"s0": 1, "s1": 1, "s2": 2, "s3": 2, "s4": 2} and out == []
    caps, out = split(batch[2:], {**caps, "s2": 1})  # a cap never grows back
    assert caps == {"s0": 1, "s1": 1, "s2": 1, "s3": 1, "s4": 1} and out == []
    caps, out = split(batch[:1], caps)
    assert caps == {"s1": 1, "s2": 1, "s3": 1, "s4": 1} and ids(out) == ["s0"]


def test_a_batch_that_always_runs_out_of_memory_ends_in_at_most_2n_minus_1_steps():
    """Halving down to single samples, each excluded: never a loop, whatever the size."""
    for n in range(1, 20):
        waiting, caps, steps, excluded = samples(*[5] * n), {}, 0, []
        while waiting:
            now, rest, long = cut(waiting, caps, 100)
            assert now and not long
            steps += 1
            caps, out = split(now, caps)
            excluded += out
            waiting = [s for s in now if s not in out] + rest
        assert steps <= 2 * n - 1 and len(excluded) == n and caps == {}


def test_canonical_orders_by_tokens_then_id():
    a, b, c = samples(6, 5, 5)
    assert ids(canonical([a, b, c])) == ids(canonical([c, a, b]))


async def test_a_cap_goes_with_its_sample_when_it_leaves_the_line_otherwise(tmp_path):
    """Split off an out-of-memory batch, then dropped as stale: its cap must not make every later batch go
    at once, one sample at a time."""
    from clawd.learning.journal import Journal
    from clawd.learning.limits import BatchLimits
    from clawd.learning.store import SampleStore

    journal = Journal(tmp_path / "journal")
    store = SampleStore(journal)
    await store.replay()
    try:
        for s in samples(5, 5):
            await store.put(s)
        limits = BatchLimits(store, 100)
        batch, _ = store.take_batch(2, current_version=0, max_staleness=1)
        limits.out_of_memory(batch, MemoryError("test"))
        assert limits.capped == 2 and store.waiting == 2
        _, stale = store.take_batch(2, current_version=5, max_staleness=1)  # both too old now
        assert len(stale) == 2 and limits.capped == 0
    finally:
        await journal.close()
