"""``pagedkv.SequenceSpec`` and ``pagedkv.HashScheme``: a block's cache identity besides its
tokens as one value per level. The manager and the indexer hash a spec alike, specs differing in
any field share no block, KV cache groups other than 0 get their own hashes, bad fields are typed
errors."""

from __future__ import annotations

from typing import Any

import pytest

import pagedkv
from pagedkv import HashScheme, SequenceSpec

PROMPT = list(range(40, 40 + 4 * 4 + 1))  # 4 full blocks of 4 before the last token

SPECS = [
    SequenceSpec(),
    SequenceSpec(cache_salt="tenant"),
    SequenceSpec(adapter_id="lora-sql"),
    SequenceSpec(extra_keys=[("rope", b"dynamic:40")]),
    SequenceSpec(mm_items=[(b"img", 2, 3)]),
    SequenceSpec(cache_salt="tenant", adapter_id="lora-sql", extra_keys=[("rope", b"x")], mm_items=[(b"i", 0, 1)]),
    SequenceSpec().for_group(1),
    SequenceSpec(cache_salt="tenant").for_group(2),
]


def _stored(spec: SequenceSpec) -> list[bytes]:
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(32, 4, enable_events=True))
    m.add_sequence(1, PROMPT, spec=spec)
    m.allocate_slots(1, len(PROMPT))
    return [h for ev in m.take_events() if isinstance(ev, pagedkv.BlockStored) for h in ev.block_hashes]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_the_indexer_hashes_a_spec_as_the_manager_does(spec: SequenceSpec) -> None:
    ix = HashScheme(4).indexer()
    assert ix.block_hashes(PROMPT, spec=spec) == ix.block_hashes(PROMPT, **spec.keywords()) == _stored(spec)
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(32, 4, enable_events=True))
    m.add_sequence(1, PROMPT, **spec.keywords())  # the separate keys: the same blocks
    m.allocate_slots(1, len(PROMPT))
    events = m.take_events()
    assert [h for ev in events if isinstance(ev, pagedkv.BlockStored) for h in ev.block_hashes] == _stored(spec)
    ix.add_worker(3)
    assert ix.apply(3, 0, events) == "applied"
    assert ix.overlap(PROMPT, spec=spec) == ix.overlap(PROMPT, **spec.keywords()) == {3: 4}
    other = spec.for_group(spec.kv_group + 1)
    assert ix.overlap(PROMPT, spec=other) == {3: 0}


@pytest.mark.parametrize(
    "call",
    [
        lambda spec, **kw: pagedkv.KVCacheManager(pagedkv.CacheConfig(8, 4)).add_sequence(1, PROMPT, spec=spec, **kw),
        lambda spec, **kw: HashScheme(4).indexer().block_hashes(PROMPT, spec=spec, **kw),
        lambda spec, **kw: HashScheme(4).indexer().overlap(PROMPT, spec=spec, **kw),
    ],
    ids=["add_sequence", "block_hashes", "overlap"],
)
def test_a_spec_with_separate_keys_or_a_non_spec_is_refused(call: Any) -> None:
    spec = SequenceSpec(cache_salt="t")
    for key in ({"cache_salt": "t"}, {"adapter_id": "a"}, {"extra_keys": [("k", b"v")]}, {"mm_items": []}):
        with pytest.raises(pagedkv.InvalidArgumentError, match="either spec or the separate"):
            call(spec, **key)
    with pytest.raises(pagedkv.InvalidArgumentError, match="expected a pagedkv.SequenceSpec, got dict"):
        call({"cache_salt": "t"})
    call(None, cache_salt="t")  # spec=None: the separate keys as before


def test_specs_differing_in_any_field_share_no_block() -> None:
    chains = [set(_stored(s)) for s in SPECS]
    for i, a in enumerate(chains):
        for j, b in enumerate(chains):
            if i != j:
                assert not a & b, (SPECS[i], SPECS[j])
    assert SequenceSpec().for_group(0) == SequenceSpec()  # group 0 hashes as the request itself


def test_a_spec_is_a_frozen_hashable_value() -> None:
    a = SequenceSpec(cache_salt="t", extra_keys=[("k", b"v")], mm_items=[(b"h", 0, 2)])
    b = SequenceSpec(cache_salt="t", extra_keys=(("k", b"v"),), mm_items=((b"h", 0, 2),))
    assert a == b and hash(a) == hash(b) and a.extra_keys == (("k", b"v"),)
    assert a.with_extra_keys([("rope", b"x")]).extra_keys == (("k", b"v"), ("rope", b"x"))
    assert a.for_group(3).kv_group == 3 and a.for_group(3).cache_salt == "t"
    with pytest.raises(AttributeError):
        a.cache_salt = "u"  # type: ignore[misc]
    assert {a: 1}[b] == 1


def test_a_hash_scheme_is_read_from_a_config_an_indexer_or_a_manager() -> None:
    cfg = pagedkv.CacheConfig(16, 8, hash_algo="xxh3_128", hash_seed=b"seed")
    scheme = HashScheme(8, "xxh3_128", b"seed")
    assert HashScheme.of(cfg) == HashScheme.of(pagedkv.KVCacheManager(cfg)) == scheme
    ix = scheme.indexer(max_pending=4)
    assert HashScheme.of(ix) == scheme and ix.max_pending == 4
    assert HashScheme.of(pagedkv.CacheConfig(16, 8)) == HashScheme(8)
    assert HashScheme(8) != scheme


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"cache_salt": 1}, "cache_salt"),
        ({"adapter_id": b"lora"}, "adapter_id"),
        ({"extra_keys": "rope"}, "extra_keys"),
        ({"extra_keys": [("rope", "not bytes")]}, "extra_keys"),
        ({"extra_keys": [("rope",)]}, "extra_keys"),
        ({"mm_items": [(b"h", -1, 2)]}, "mm_items"),
        ({"mm_items": [(b"h", 0, 0)]}, "mm_items"),
        ({"mm_items": [("h", 0, 1)]}, "mm_items"),
        ({"mm_items": [(b"h", True, 1)]}, "mm_items"),
        ({"kv_group": -1}, "kv_group"),
        ({"kv_group": 2**32}, "kv_group"),
        ({"kv_group": False}, "kv_group"),
    ],
)
def test_a_bad_spec_field_is_a_typed_error_naming_it(kwargs: dict[str, Any], arg: str) -> None:
    with pytest.raises(pagedkv.InvalidArgumentError, match=f"^{arg}=") as info:
        SequenceSpec(**kwargs)
    assert isinstance(info.value, ValueError) and info.value.arg == arg


@pytest.mark.parametrize(
    ("args", "arg"),
    [((0,), "block_size"), ((True,), "block_size"), ((4, 5), "hash_algo"), ((4, "sha256", "seed"), "hash_seed")],
)
def test_a_bad_hash_scheme_is_a_typed_error(args: tuple[Any, ...], arg: str) -> None:
    with pytest.raises(pagedkv.InvalidArgumentError, match=f"^{arg}="):
        HashScheme(*args)
    with pytest.raises(pagedkv.InvalidArgumentError, match="^source="):
        HashScheme.of(object())
    with pytest.raises(pagedkv.InvalidArgumentError):
        HashScheme(4, "md5").indexer()


@pytest.mark.parametrize("keys", [5, None, b"ab", [("tag", "not bytes")], [("only-a-tag",)]])
def test_with_extra_keys_of_bad_keys_is_a_typed_error(keys: Any) -> None:
    """``with_extra_keys(5)`` unpacked the int and raised a bare TypeError; bad keys are an
    ``InvalidArgumentError`` (a ValueError) naming ``extra_keys``, as the constructor's."""
    spec = SequenceSpec(cache_salt="s", extra_keys=[("a", b"1")])
    with pytest.raises(pagedkv.InvalidArgumentError, match="extra_keys") as info:
        spec.with_extra_keys(keys)
    assert isinstance(info.value, ValueError)
    assert spec.with_extra_keys([("b", b"2")]).extra_keys == (("a", b"1"), ("b", b"2"))


@pytest.mark.parametrize("kwargs", [{"extra_keys": 5}, {"extra_keys": None}, {"mm_items": 5}, {"mm_items": None}])
def test_a_spec_field_that_is_not_a_sequence_is_a_typed_error(kwargs: dict[str, Any]) -> None:
    """``SequenceSpec(extra_keys=5)`` (or None) ran ``tuple(5)``: a bare TypeError."""
    (arg,) = kwargs
    with pytest.raises(pagedkv.InvalidArgumentError, match=f"^{arg}=") as info:
        SequenceSpec(**kwargs)
    assert isinstance(info.value, ValueError) and info.value.arg == arg
