"""vLLM's side of ``host_tier.py``'s CPU cost per block op: its CPU offloading manager
(``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``, the scheduler side of vLLM's
``OffloadingConnector``) and pagedkv's manager behind the same interface
(``pagedkv.integrations.vllm.offloading.PagedKVOffloadingManager``, a ``pagedkv.HostBlockPool``),
driven on block hashes pagedkv computed, the same calls on the same keys.

Run by ``host_tier.py`` with an interpreter that has vLLM (no GPU, no model):
``VLLM_PY host_tier_vllm.py HASHES.json OUT.json [--repeats N]``. ``HASHES.json`` is a list of
requests, each a list of hex block hashes. The manager has one chunk per block of the stream
(LRU, ``store_threshold`` 0: every offered block is stored), keys ``make_offload_key(hash, 0)``
(KV cache group 0), one ``ReqContext`` per request; ``on_new_request`` / ``on_request_finished``
are called as the connector calls them but not timed. Timed with ``time.thread_time_ns``:

- store: ``prepare_store(keys)`` + ``complete_store(keys)`` for each request in turn;
- lookup: ``lookup(key)`` for each key of each request (again, under a new context) until the
  first result that is not a HIT, as the connector's scheduler looks up a prefix;
- load: ``prepare_load(keys)`` + ``touch(keys)`` + ``complete_load(keys)`` per request.

Writes ``{"version", "ns_per_block": {store, lookup, load}, "blocks": {...},
"pagedkv_ns_per_block": {...}}`` (``ns_per_block``: vLLM's manager; ``pagedkv_ns_per_block``:
pagedkv's), best of the repeats, and prints both.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def make_manager(which: str, num_chunks: int) -> object:
    """A fresh manager of ``num_chunks`` chunks, LRU, storing every offered block."""
    if which == "pagedkv":
        from pagedkv.integrations.vllm.offloading import PagedKVOffloadingManager  # noqa: PLC0415

        return PagedKVOffloadingManager(num_chunks, admission_min_seen=1, eviction="lru")
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: PLC0415

    return CPUOffloadingManager(num_chunks=num_chunks, cache_policy="lru", store_threshold=0)


def run(hashes: list[list[bytes]], which: str = "vllm") -> tuple[dict[str, float], dict[str, int]]:
    """One run on a fresh manager (``which``: ``"vllm"`` or ``"pagedkv"``); returns (ns per
    block, blocks) per op."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: PLC0415

    keys = [[make_offload_key(h, 0) for h in req] for req in hashes]
    total = sum(len(k) for k in keys)
    m: Any = make_manager(which, total)
    tick = time.thread_time_ns
    store_ns = 0
    for r, ks in enumerate(keys):
        ctx = ReqContext(f"s{r}")
        m.on_new_request(ctx)
        c = tick()
        out = m.prepare_store(ks, ctx)
        assert out is not None and len(out.keys_to_store) == len(ks)
        m.complete_store(ks, ctx)
        store_ns += tick() - c
        m.on_request_finished(ctx)
    contexts = [ReqContext(f"l{r}") for r in range(len(keys))]
    for ctx in contexts:
        m.on_new_request(ctx)
    hit = LookupResult.HIT
    found = 0
    c = tick()
    for ks, ctx in zip(keys, contexts):
        for k in ks:
            if m.lookup(k, ctx) is not hit:
                break
            found += 1
    lookup_ns = tick() - c
    load_ns = 0
    for ks, ctx in zip(keys, contexts):
        c = tick()
        m.prepare_load(ks, ctx)
        m.touch(ks, ctx)
        m.complete_load(ks, ctx)
        load_ns += tick() - c
        m.on_request_finished(ctx)
    assert found == total, (found, total)
    return {"store": store_ns / total, "lookup": lookup_ns / found, "load": load_ns / total}, {
        "store": total,
        "lookup": found,
        "load": total,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hashes")
    ap.add_argument("out")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    hashes = [[bytes.fromhex(h) for h in req] for req in json.loads(Path(a.hashes).read_text())]
    best: dict[str, dict[str, float]] = {"vllm": {}, "pagedkv": {}}
    blocks: dict[str, int] = {}
    for _ in range(a.repeats):
        for which, b in best.items():
            ns, blocks = run(hashes, which)
            for k, v in ns.items():
                b[k] = min(b.get(k, float("inf")), v)
    import vllm  # noqa: PLC0415

    for which, b in best.items():
        print(f"{which:8s} " + "  ".join(f"{k} {v:7.0f} ns/block" for k, v in b.items()))
    Path(a.out).write_text(
        json.dumps(
            {
                "version": f"vllm {vllm.__version__}",
                "ns_per_block": best["vllm"],
                "blocks": blocks,
                "pagedkv_ns_per_block": best["pagedkv"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
