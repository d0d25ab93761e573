"""pagedkv.HostBlockPool: the host tier on its own, as an offloading connector drives it
(lookup, loads pinned until completed, stores prepared then completed or rolled back), and its
refusals of bad input (typed errors, state unchanged)."""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv import HostBlockPool


def key(i: int, group: int = 0) -> bytes:
    """A vLLM-style offload key: 32-byte block hash + 4-byte big-endian group."""
    return bytes([i]) * 32 + group.to_bytes(4, "big")


def snapshot(p: HostBlockPool, keys: list[bytes]) -> tuple[object, ...]:
    return (p.num_used, p.num_held, tuple(p.state(k) for k in keys), tuple(sorted(p.counters().items())))


def stored(p: HostBlockPool, keys: list[bytes]) -> None:
    out = p.prepare_store(keys)
    assert out is not None
    p.complete_store(out[0])


def test_store_lookup_load_and_tail_first_eviction() -> None:
    p = HostBlockPool(4)
    chain = [key(i) for i in range(4)]
    out = p.prepare_store(chain)
    assert out is not None
    to_store, ids, evicted = out
    assert to_store == chain and sorted(ids.tolist()) == [0, 1, 2, 3] and evicted == []
    assert p.lookup(chain) == 0 and [p.state(k) for k in chain] == [1] * 4  # storing
    p.complete_store(chain)
    assert p.lookup(chain) == 4 and p.lookup([chain[0], key(9), chain[1]]) == 1
    assert p.prepare_load(chain[:2]).tolist() == ids.tolist()[:2]
    # Full: the unpinned tail goes first, the pinned head stays.
    out = p.prepare_store([key(10), key(11)])
    assert out is not None and out[2] == [chain[3], chain[2]]
    p.complete_store(out[0])
    p.complete_load(chain[:2])
    assert p.lookup(chain) == 2
    p.check_invariants()
    assert p.counters() == {
        "stores_prepared": 6,
        "stores_completed": 6,
        "stores_failed": 0,
        "stores_refused": 0,
        "loads": 2,
        "evictions": 2,
    }


def test_failed_store_is_rolled_back_and_keys_of_any_length_round_trip() -> None:
    p = HostBlockPool(2)
    odd = [b"a", b"a much longer key than thirty-six bytes, hashed by SHA-256", key(1, group=0xFFFFFFFF)]
    out = p.prepare_store(odd[:2])
    assert out is not None and out[0] == odd[:2]
    p.complete_store(odd[:1], success=False)
    assert p.state(odd[0]) == 0 and p.state(odd[1]) == 1 and p.num_used == 1
    p.complete_store(odd[1:2])
    stored(p, [odd[2]])
    # Evicted keys come back as the bytes they were stored under.
    out = p.prepare_store([key(5)])
    assert out is not None and out[2] == [odd[1]]
    p.check_invariants()
    assert p.counters()["stores_failed"] == 1


def test_prepare_store_is_all_or_nothing_and_never_evicts_held_or_offered_blocks() -> None:
    p = HostBlockPool(3)
    stored(p, [key(0)])
    p.prepare_load([key(0)])
    pending = p.prepare_store([key(1)])
    assert pending is not None
    before = snapshot(p, [key(i) for i in range(5)])
    # One free block, two candidates: refused, nothing changed but the offer counts.
    assert p.prepare_store([key(3), key(4)]) is None
    after = snapshot(p, [key(i) for i in range(5)])
    assert before[:3] == after[:3] and p.counters()["stores_refused"] == 2
    stored(p, [key(2)])
    # key(2) is offered again with a new key: it is not evicted by its own offer, and the
    # pinned key(0) and storing key(1) are not either: no room.
    assert p.prepare_store([key(2), key(3)]) is None
    p.check_invariants()


def test_admission_after_two_offers() -> None:
    p = HostBlockPool(4, admission_min_seen=2)
    out = p.prepare_store([key(0)])
    assert out is not None and out[0] == []
    out = p.prepare_store([key(0)])
    assert out is not None and out[0] == [key(0)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_blocks": 0}, "num_host_blocks"),
        ({"num_blocks": -1}, "num_host_blocks"),
        ({"num_blocks": 2**28 + 1}, "num_host_blocks"),
        ({"num_blocks": "4"}, "num_host_blocks"),
        ({"num_blocks": 4, "admission_min_seen": 0}, "host_admission_min_seen"),
        ({"num_blocks": 4, "eviction": "fifo"}, "host_eviction"),
        ({"num_blocks": 4, "eviction": 3}, "host_eviction"),
    ],
)
def test_bad_config(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(pagedkv.InvalidConfigError) as e:
        HostBlockPool(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field
    assert isinstance(e.value, ValueError)


def test_every_policy_name_of_the_core_is_accepted() -> None:
    for name in ("lru", "arc"):
        assert HostBlockPool(2, eviction=name).eviction == name


def test_bad_calls_raise_and_change_nothing() -> None:
    p = HostBlockPool(3)
    stored(p, [key(0)])
    pending = p.prepare_store([key(1)])
    assert pending is not None
    p.prepare_load([key(0)])
    keys = [key(i) for i in range(4)]
    before = snapshot(p, keys)
    bad = [
        (p.prepare_load, ([key(0), key(9)],), "not readable"),  # unknown key after a good one
        (p.prepare_load, ([key(1)],), "not readable"),  # still storing
        (p.complete_load, ([key(0), key(0)],), "no load"),  # one pin, two completes
        (p.complete_load, ([key(9)],), "no load"),
        (p.complete_store, ([key(0)],), "no store"),  # readable already
        (p.complete_store, ([key(1), key(1)],), "no store"),  # double complete
        (p.complete_store, ([key(9)],), "no store"),
        (p.lookup, ([b"ok", "str"],), "bytes"),
        (p.prepare_store, (b"one key, not a list",), "one value"),
        (p.prepare_store, (7,), "iterable"),
        (p.state, ("str",), "bytes"),
    ]
    for fn, args, match in bad:
        with pytest.raises(pagedkv.InvalidArgumentError, match=match):
            fn(*args)
        assert snapshot(p, keys) == before, fn
    p.check_invariants()
    # Release, then the double complete is refused too.
    p.complete_load([key(0)])
    with pytest.raises(pagedkv.InvalidArgumentError):
        p.complete_load([key(0)])
    p.complete_store([key(1)])
    with pytest.raises(pagedkv.InvalidArgumentError):
        p.complete_store([key(1)])


def test_reset_drops_everything_in_flight() -> None:
    p = HostBlockPool(2)
    stored(p, [key(0)])
    p.prepare_load([key(0)])
    assert p.prepare_store([key(1)]) is not None
    p.reset()
    assert (p.num_used, p.num_held, p.lookup([key(0)])) == (0, 0, 0)
    with pytest.raises(pagedkv.InvalidArgumentError):
        p.complete_load([key(0)])
    with pytest.raises(pagedkv.InvalidArgumentError):
        p.complete_store([key(1)])
    stored(p, [key(2), key(3)])
    p.check_invariants()


def test_every_admitted_key_is_stored_while_the_seen_counts_age() -> None:
    """Regression: the seen table (64,000+ keys) ages by halving every count; when that
    happened between the admission decision and the placement of a key, prepare_store
    panicked (the tier refused a key the pool had admitted)."""
    p = HostBlockPool(2)
    stored_keys = 0
    for i in range(36_000):  # 72,000 distinct keys: the table ages more than once
        chain = [i.to_bytes(32, "big") + b"\0\0\0\0", i.to_bytes(32, "big") + b"\0\0\0\1"]
        out = p.prepare_store(chain)
        assert out is not None
        p.complete_store(out[0])
        stored_keys += len(out[0])
    assert stored_keys == 72_000
    p.check_invariants()
