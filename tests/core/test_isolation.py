"""Cache isolation: KV computed for one tenant, adapter, model or multimodal input is never
served to another.

- Requests that differ only in cache salt, adapter id, model identity (a tagged extra key) or
  multimodal item hash never share a physical block and get no prefix hit from each other, both
  while the first request is running and after it finished (its blocks cached and free). The
  same key on both sides does share (the positive control, so these tests can fail).
- Extra keys of different kinds never collide whatever their values (hypothesis over all four
  kinds the Python API exposes: cache salt, adapter id, tagged key, multimodal item).
- SHA-256 is the default prefix hash.
- The same chain seed gives the same block hashes in two processes (a subprocess replays the
  same requests and prints its BlockStored hashes); a different seed gives different ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pagedkv

BS = 4
PROMPT = list(range(500, 540))  # 40 tokens = 10 full blocks


def manager(**cfg: Any) -> pagedkv.KVCacheManager:
    return pagedkv.KVCacheManager(pagedkv.CacheConfig(64, BS, enable_events=True, **cfg))


def run_pair(first: dict[str, Any], second: dict[str, Any], *, free_first: bool) -> tuple[int, set[int], set[int]]:
    """Prefill PROMPT under spec `first`, then under `second`; returns (cached tokens of the
    second, first's blocks, second's blocks)."""
    m = manager()
    m.add_sequence(1, PROMPT, **first)
    m.allocate_slots(1, len(PROMPT))
    a = set(m.block_table(1).tolist())
    if free_first:
        m.free(1)
    m.add_sequence(2, PROMPT, **second)
    looked_up = m.lookup_prefix(2)
    alloc = m.allocate_slots(2, len(PROMPT))
    assert alloc.num_cached_tokens == looked_up
    b = set(m.block_table(2).tolist())
    m.check_invariants()
    return alloc.num_cached_tokens, a, b


SPECS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("cache salt", dict(cache_salt="tenant-a"), dict(cache_salt="tenant-b")),
    ("salt vs none", dict(cache_salt="tenant-a"), dict()),
    ("adapter id", dict(adapter_id="lora-sql"), dict(adapter_id="lora-chat")),
    ("adapter vs base model", dict(adapter_id="lora-sql"), dict()),
    ("model identity", dict(extra_keys=[("model", b"llama-3-8b")]), dict(extra_keys=[("model", b"mistral-7b")])),
    ("image hash", dict(mm_items=[(b"cat.png", 0, 8)]), dict(mm_items=[(b"dog.png", 0, 8)])),
    ("image position", dict(mm_items=[(b"cat.png", 0, 8)]), dict(mm_items=[(b"cat.png", 1, 8)])),
    ("adapter 'x' vs salt 'x'", dict(adapter_id="x"), dict(cache_salt="x")),
    ("salt 'x' vs tagged ('x', b'')", dict(cache_salt="x"), dict(extra_keys=[("x", b"")])),
    (
        "salt+adapter vs adapter+salt swapped",
        dict(cache_salt="a", adapter_id="b"),
        dict(cache_salt="b", adapter_id="a"),
    ),
]


@pytest.mark.parametrize("free_first", [False, True], ids=["first-running", "first-finished"])
@pytest.mark.parametrize("name,first,second", SPECS, ids=[s[0] for s in SPECS])
def test_different_keys_never_share(name: str, first: dict[str, Any], second: dict[str, Any], free_first: bool) -> None:
    cached, a, b = run_pair(first, second, free_first=free_first)
    assert cached == 0, f"{name}: prefix hit across isolation keys"
    if not free_first:
        assert a.isdisjoint(b), f"{name}: physical blocks shared: {a & b}"


def test_image_only_isolates_the_blocks_it_covers() -> None:
    """Blocks before a multimodal item still share; the ones it overlaps do not."""
    cached, _, _ = run_pair(dict(mm_items=[(b"cat.png", 8, 8)]), dict(mm_items=[(b"dog.png", 8, 8)]), free_first=False)
    assert cached == 8  # blocks 0-1 (tokens 0..7) precede the image


@pytest.mark.parametrize("free_first", [False, True], ids=["first-running", "first-finished"])
@pytest.mark.parametrize(
    "spec",
    [
        dict(),
        dict(cache_salt="t"),
        dict(adapter_id="lora"),
        dict(extra_keys=[("model", b"m")]),
        dict(mm_items=[(b"img", 4, 8)]),
    ],
    ids=["none", "salt", "adapter", "model", "image"],
)
def test_same_keys_do_share(spec: dict[str, Any], free_first: bool) -> None:
    cached, a, b = run_pair(spec, spec, free_first=free_first)
    # Every full block but the last token's is served from the cache (40 tokens -> 36 cached).
    assert cached == 36
    if not free_first:
        assert len(a & b) == 9


# One extra key of each kind the Python API exposes, with arbitrary values.
KEYS = st.one_of(
    st.tuples(st.just("salt"), st.text(max_size=6)),
    st.tuples(st.just("adapter"), st.text(max_size=6)),
    st.tuples(st.just("tagged"), st.text(max_size=4), st.binary(max_size=4)),
    st.tuples(st.just("mm"), st.binary(max_size=4), st.integers(0, 7), st.integers(1, 12)),
)


def spec_of(key: tuple[Any, ...]) -> dict[str, Any]:
    kind = key[0]
    if kind == "salt":
        return dict(cache_salt=key[1])
    if kind == "adapter":
        return dict(adapter_id=key[1])
    if kind == "tagged":
        return dict(extra_keys=[(key[1], key[2])])
    return dict(mm_items=[(key[1], key[2], key[3])])


def block_key(key: tuple[Any, ...], j: int) -> tuple[Any, ...] | None:
    """What one extra key contributes to block j (the oracle of the key encoding): the kind and
    value for per-request keys; for a multimodal item, its hash and its offset relative to the
    block when it overlaps the block, else nothing."""
    if key[0] != "mm":
        return key
    _, item, start, length = key
    lo, hi = j * BS, (j + 1) * BS
    return ("mm", item, start - lo) if start < hi and start + length > lo else None


@given(k1=KEYS, k2=KEYS)
def test_extra_keys_never_collide(k1: tuple[Any, ...], k2: tuple[Any, ...]) -> None:
    """Two requests with the same 16 tokens and one extra key each: the second gets prefix hits
    for exactly the leading blocks whose keys agree (same kind and value), and the first-block
    hashes are equal iff that block's keys are."""
    prompt = list(range(16))
    m = manager()
    m.add_sequence(1, prompt, **spec_of(k1))
    m.allocate_slots(1, 16)
    m.add_sequence(2, prompt, **spec_of(k2))
    hit = m.allocate_slots(2, 16).num_cached_tokens
    agree = 0
    while agree < (len(prompt) - 1) // BS and block_key(k1, agree) == block_key(k2, agree):
        agree += 1
    assert hit == agree * BS, (k1, k2, hit)
    if k1 == k2:
        assert hit == 12
    m.check_invariants()

    def first_hash(key: tuple[Any, ...]) -> bytes:
        mm = manager()
        mm.add_sequence(1, prompt[:4] + [0], **spec_of(key))
        mm.allocate_slots(1, 8)
        (ev,) = mm.take_events()
        assert isinstance(ev, pagedkv.BlockStored)
        return bytes(ev.block_hashes[0])

    assert (first_hash(k1) == first_hash(k2)) == (block_key(k1, 0) == block_key(k2, 0))


def block_hashes(m: pagedkv.KVCacheManager) -> list[bytes]:
    return [bytes(h) for ev in m.take_events() if isinstance(ev, pagedkv.BlockStored) for h in ev.block_hashes]


def test_sha256_is_the_default() -> None:
    cfg = pagedkv.CacheConfig(8, 4)
    assert cfg.hash_algo == "sha256"

    def hashes(**kw: Any) -> list[bytes]:
        m = manager(**kw)
        m.add_sequence(1, PROMPT)
        m.allocate_slots(1, len(PROMPT))
        return block_hashes(m)

    default, sha, xxh = hashes(), hashes(hash_algo="sha256"), hashes(hash_algo="xxh3_128")
    assert default == sha and len(default) == 10
    assert all(len(h) == 32 for h in default)
    # xxh3-128 fills 16 of the 32 bytes; SHA-256 fills all of them.
    assert all(h[16:] == bytes(16) for h in xxh)
    assert all(h[16:] != bytes(16) for h in default)
    assert set(default).isdisjoint(xxh)


_CHILD = textwrap.dedent(
    """
    import json, sys
    import pagedkv
    algo, seed = sys.argv[1], bytes.fromhex(sys.argv[2])
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, 4, hash_algo=algo, hash_seed=seed, enable_events=True))
    m.add_sequence(1, list(range(500, 540)), cache_salt="tenant-a")
    m.allocate_slots(1, 40)
    m.add_sequence(2, list(range(500, 520)) + [7] * 9, adapter_id="lora")
    m.allocate_slots(2, 29)
    stored = [ev for ev in m.take_events() if isinstance(ev, pagedkv.BlockStored)]
    print(json.dumps([bytes(h).hex() for ev in stored for h in ev.block_hashes]))
    """
)


def hashes_in_this_process(algo: str, seed: bytes) -> list[str]:
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, 4, hash_algo=algo, hash_seed=seed, enable_events=True))
    m.add_sequence(1, list(range(500, 540)), cache_salt="tenant-a")
    m.allocate_slots(1, 40)
    m.add_sequence(2, list(range(500, 520)) + [7] * 9, adapter_id="lora")
    m.allocate_slots(2, 29)
    return [h.hex() for h in block_hashes(m)]


def hashes_in_child(algo: str, seed: bytes) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, algo, seed.hex()],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result: list[str] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_same_seed_same_hashes_across_processes(algo: str) -> None:
    here = hashes_in_this_process(algo, b"deployment-7")
    there = hashes_in_child(algo, b"deployment-7")
    assert len(here) == 10 + 7  # 10 salted blocks, 7 full blocks of the adapter request
    assert here == there
    # A different seed: an unrelated hash family (no hash in common).
    other = hashes_in_child(algo, b"deployment-8")
    assert set(other).isdisjoint(here)
