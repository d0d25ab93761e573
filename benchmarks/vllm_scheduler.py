"""vLLM's V1 Scheduler CPU time per step: stock vs ``PagedKVScheduler``, in one run.

Needs an environment with vLLM and pagedkv (``make vllm-venv``, then
``target/vllm-venv/bin/python benchmarks/vllm_scheduler.py``). No GPU, no model: the scheduler
is vLLM's real one (``pagedkv.testing.vllm_scheduler`` builds it from a tiny local model
config), and a fake model samples one token per request per step.

Workloads (each scheduler gets the same request stream):

- ``decode256``: 256 requests with distinct 512-token prompts, measured once all are decoding
  (steady state: every step schedules 256 single-token decodes).
- ``azure_conv``: the Azure LLM inference conversation trace (prompt / output lengths, distinct
  token ids), closed loop: new requests are admitted whenever fewer than 256 are unfinished.
- ``mooncake``: the Mooncake conversation trace, prompts built from its ``hash_ids`` (equal ids
  give equal 512-token blocks, so requests share prefixes), same closed loop.
- ``gemma3_decode128``: a hybrid model, Gemma 3's KV cache groups (one full-attention and five
  sliding-window groups, window 512; six groups of one ``PagedKVCacheManager`` in the plug-in): 128
  requests with distinct 600-token prompts (past the window), measured once all are decoding.
- ``offload_conv`` (a KV connector): ``OffloadingConnector`` with vLLM's CPU spec (a host tier),
  multi-turn conversations whose history overflows the device pool, so later turns load their
  history back from the host: 256 conversations of 5 turns (a 512-token first prompt, then 64
  new tokens and the previous 32-token answer per turn), 64 running, 4000 device blocks. The
  plug-in runs with vLLM's CPU spec and with pagedkv's ``PagedKVCPUOffloadingSpec`` (variant
  ``pagedkv + pagedkv host tier``).
- ``nixl_prefill`` (a KV connector): ``NixlConnector`` as consumer (the decode node of
  prefill/decode disaggregation): 4000 requests whose 512-token prompts are loaded from a remote
  prefill node, 64 output tokens each, 256 running.

The connector workloads' worker side is a fake (:class:`FakeConnectorWorker`): every transfer a
step's connector metadata starts completes at the end of that step (the scheduler sees it in
that step's ``update_from_output``), so the figures are the scheduler-side cost of the
connector's bookkeeping (its metadata, loads, stores, host-tier lookups) on top of scheduling.
Synchronous scheduling only.

Reported per step (mean over the measured steps, CPU time of this thread): ``schedule()``,
``update_from_output()`` and their sum. The KV-manager share counts the same kinds of work in
both schedulers: every call on ``scheduler.kv_cache_manager`` (pagedkv's deferred-decode flush,
run from ``PagedKVScheduler.schedule``, is one of them), the ``KVCacheBlocks`` results the
scheduler reads (``get_block_ids`` for every scheduled request) and the per-request block-hash
hook ``Request.update_block_hashes`` that ``update_from_output`` runs for every new token
(vLLM's Python hashing; a no-op check once the plug-in drops the hasher). It is sampled on CPU
time in separate runs (``SIGPROF`` at the kernel's timer tick, 4 ms of CPU on a 250 Hz
kernel): the share is the fraction of the samples inside ``schedule()`` /
``update_from_output()`` whose stack holds one of those KV frames. Sampling adds one stack walk
per tick and no per-call cost; wrapping each call in a timer (an earlier version of this
benchmark) cost more than pagedkv's sub-microsecond decode call itself.

Request objects (and the engine core's prompt hashing inside them) are built before the clock
starts. The runs go round-robin over the variants (timed, then sampled, per round), so a change
in a shared machine's load hits every variant alike; the best timed run of each is reported.

Async scheduling (``--async-scheduling``, vLLM's default on a GPU): the same workloads with
``scheduler_config.async_scheduling`` on, stock ``AsyncScheduler`` against ``PagedKVScheduler``
(which then builds ``PagedKVAsyncScheduler``), driven as the engine core's batch queue drives
them: each step schedules the next batch while the previous one is in flight, then consumes the
oldest batch's output (``fake_async_model_output``, taken when its batch was scheduled), so a
running request is scheduled while its previous token is still a placeholder. Results go to
``benchmarks/results/vllm_scheduler_async.json``.

Printed first (and in the JSON): the block hashing cost per block (``hashing_cost``) and the
plug-in's prefill allocation per new request (``prefill_allocation_cost``: ``get_computed_blocks``
then ``allocate_slots`` of a whole 64- or 1024-token prompt on ``PagedKVCacheManager`` alone, one
group and Gemma 3's six groups); ``--prefill-only`` prints only those.

Variants: pagedkv with the batched decode path off, with vLLM's Python block hashes kept (the
"hash twice" alternative), and, at 256 decodes only, a bound that is no scheduler: pagedkv
whose ``allocate_slots`` answers every decode with the empty result and does nothing else (KV
state is not kept), i.e. what vLLM's own code costs per step around a free KV manager.
Results: a table on stdout and ``benchmarks/results/vllm_scheduler.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    expand_hash_ids,
    load_workload,
    machine_info,
    print_table,
    unique_tokens,
    write_json,
)

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    GEMMA3_GROUPS,
    build_scheduler,
    fake_async_model_output,
    fake_model_output,
    fake_token,
    make_hybrid_kv_cache_config,
    make_request,
    make_vllm_config,
)

BS = 16
#: Host-tier bytes of the offloading workload (far more than its history needs).
HOST_BYTES = 1 << 28
HOST_TIER = "pagedkv + pagedkv host tier"


class PagedKVPerRequest(PagedKVScheduler):
    """pagedkv without the batched decode path (one call into Rust per request)."""

    batch_decode = False


class PagedKVHashTwice(PagedKVScheduler):
    """pagedkv that also keeps vLLM's Python block hashes growing (hashing twice)."""

    keep_vllm_block_hashes = True


class FreeDecodesBound(PagedKVScheduler):
    """Not a scheduler: every 1-token ``allocate_slots`` returns the empty result and does
    nothing else (pagedkv's state is not kept). Run at 256 steady decodes only, where nothing
    reads the state, to measure vLLM's own per-step cost around a KV manager whose decode calls
    cost one Python call each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        manager = self.kv_cache_manager
        real = manager.allocate_slots
        empty = manager.empty_kv_cache_blocks

        def allocate_slots(request: Any, num_new_tokens: int, *rest: Any, **kw: Any) -> Any:
            if num_new_tokens == 1:
                return empty
            return real(request, num_new_tokens, *rest, **kw)

        manager.allocate_slots = allocate_slots
        # Async scheduling: nothing to catch up either (the state is not kept).
        manager.cache_blocks = lambda request, num_computed_tokens: None


BOUND = "bound: free decodes"


def _variants(async_scheduling: bool = False) -> dict[str, Any]:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    # Under async scheduling the pagedkv classes build their AsyncScheduler variants themselves.
    return {
        "vLLM stock": AsyncScheduler if async_scheduling else Scheduler,
        "pagedkv": PagedKVScheduler,
        "pagedkv per-request": PagedKVPerRequest,
        "pagedkv + vLLM hashes": PagedKVHashTwice,
        BOUND: FreeDecodesBound,
    }


class FakeConnectorWorker:
    """The worker side of the connector workloads: reads each step's connector metadata
    (``NixlConnectorMetadata``, ``OffloadingConnectorMetadata``) and reports every transfer it
    starts as done in that step's ``KVConnectorOutput``: NIXL loads in ``finished_recving``,
    offloading jobs as completed (``OffloadingWorkerMetadata``; an asynchronous offloading load
    also in ``finished_recving``). ``loads`` / ``stores`` count the blocks moved."""

    def __init__(self) -> None:
        self.loads = 0
        self.stores = 0

    def report(self, sched_output: Any) -> Any:
        """The ``KVConnectorOutput`` of ``sched_output``'s step."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        meta = sched_output.kv_connector_metadata
        recving: set[str] = set()
        sending: set[str] = set()
        worker_meta: Any = None
        if isinstance(meta, NixlConnectorMetadata):
            for rid, rm in meta.reqs_to_recv.items():
                self.loads += len(rm.local_block_ids[0])
                recving.add(rid)
            sending.update(meta.reqs_to_send)
        elif isinstance(meta, OffloadingConnectorMetadata):
            worker_meta = OffloadingWorkerMetadata()
            for job_id, job in meta.store_jobs.items():
                self.stores += len(job.dst_spec.block_ids)
                worker_meta.mark_completed(job_id)
            for job_id, job in meta.load_jobs.items():
                self.loads += len(job.src_spec.block_ids)
                worker_meta.mark_completed(job_id)
                if not getattr(job, "sync", False):
                    recving.add(job.req_id)
        elif meta is not None:
            raise TypeError(f"no fake worker for {type(meta).__name__}")
        return KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            kv_connector_worker_meta=worker_meta,
        )


def kv_transfer_config(connector: str, host_spec: str = "cpu") -> Any:
    """The ``KVTransferConfig`` of a connector workload: ``"offloading"`` (``host_spec``:
    ``"cpu"``, vLLM's CPU spec, or ``"pagedkv"``, ``PagedKVCPUOffloadingSpec``) or
    ``"nixl_consumer"``. Raises ``ValueError`` for another name."""
    from vllm.config import KVTransferConfig

    if connector == "nixl_consumer":
        return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer")
    if connector != "offloading":
        raise ValueError(f"unknown connector {connector!r}")
    extra: dict[str, Any] = {"cpu_bytes_to_use": HOST_BYTES}
    if host_spec == "pagedkv":
        extra.update(spec_name="PagedKVCPUOffloadingSpec", spec_module_path="pagedkv.integrations.vllm.offloading")
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)


def _remote_prefill_params(rid: str, prompt_len: int) -> dict[str, Any]:
    """NIXL ``kv_transfer_params`` of a request whose prompt KV a remote prefill node holds."""
    return dict(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_engine_id="prefill-engine",
        remote_request_id=f"prefill-{rid}",
        remote_block_ids=list(range(-(-prompt_len // BS))),
        remote_host="prefill-host",
        remote_port=1234,
        tp_size=1,
    )


# Frames that are KV-cache work: their source files, and vLLM's per-request hashing hook.
KV_FILES = (
    "/vllm/v1/core/kv_cache_manager.py",
    "/vllm/v1/core/kv_cache_coordinator.py",
    "/vllm/v1/core/single_type_kv_cache_manager.py",
    "/vllm/v1/core/block_pool.py",
    "/vllm/v1/core/kv_cache_utils.py",
    "/pagedkv/integrations/vllm/kv_cache_manager.py",
    "/pagedkv/integrations/vllm/decode_deferral.py",
    "/pagedkv/integrations/vllm/blocks.py",
    "/pagedkv/integrations/vllm/coordinator.py",
    "/pagedkv/integrations/vllm/events.py",
)
KV_FUNCTIONS = ("Request.update_block_hashes",)
# Qualified-name prefixes of the KVCacheBlocks results (vLLM's and pagedkv's).
BLOCKS_CLASSES = (
    "KVCacheBlocks.",
    "_make_blocks_class.<locals>.PagedKVBlocksImpl.",
    "DeferredBlocks.",
    "PrefixHit.",
)


class KVSampler:
    """Samples the main thread's stack on every ``SIGPROF`` (process CPU time, one kernel
    tick) during the measured steps: counts the samples inside the scheduler (``schedule`` /
    ``update_from_output`` of the scheduler class or a base) and, of those, the ones in KV
    frames (``KV_FILES``, ``KV_FUNCTIONS``), by the KV frame nearest the scheduler: ``manager``
    (a ``kv_cache_manager`` method), ``blocks`` (a ``KVCacheBlocks`` result's method; pagedkv's
    deferred block ids flush from there) or ``hashing`` (``Request.update_block_hashes``)."""

    def __init__(self, scheduler_cls: type) -> None:
        self.entry = {
            c.__dict__[name].__code__
            for c in scheduler_cls.__mro__
            for name in ("schedule", "update_from_output")
            if name in c.__dict__
        }
        self.stop = _measured_steps.__code__
        self.scheduler = 0
        self.kv = {"manager": 0, "blocks": 0, "hashing": 0}
        self._kind: dict[Any, str | None] = {}
        self._previous: Any = None

    def _kv_kind(self, code: Any) -> str | None:
        if code in self._kind:
            return self._kind[code]
        path = code.co_filename.replace("\\", "/")
        kind = None
        if code.co_qualname in KV_FUNCTIONS:
            kind = "hashing"
        elif path.endswith(KV_FILES):
            kind = "blocks" if code.co_qualname.startswith(BLOCKS_CLASSES) else "manager"
        self._kind[code] = kind
        return kind

    def _sample(self, signum: int, frame: Any) -> None:
        kind = None
        inside = False
        f = frame
        while f is not None:
            code = f.f_code
            if code is self.stop:
                break
            if code in self.entry:
                inside = True
            elif not inside:
                # The outermost KV frame below the scheduler names the kind.
                kind = self._kv_kind(code) or kind
            f = f.f_back
        else:
            return  # not in the measured steps (warm-up, set-up)
        if inside:
            self.scheduler += 1
            if kind is not None:
                self.kv[kind] += 1

    def __enter__(self) -> KVSampler:
        self._previous = signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, self._previous)


def _requests_decode(n: int, prompt_len: int, out_len: int) -> list[tuple[int, Any]]:
    return [(0, (f"d{i}", unique_tokens(i, prompt_len, 4000).tolist(), out_len)) for i in range(n)]


def _requests_trace(name: str, n: int, max_prompt: int) -> list[tuple[int, Any]]:
    w = load_workload(name)
    out = []
    for i in range(min(n, len(w))):
        p = int(min(w.prompt_lens[i], max_prompt))
        o = int(min(w.output_lens[i], 512))
        if w.hash_ids is not None:
            toks = expand_hash_ids(w.hash_ids[i], p, 4000)
        else:
            toks = unique_tokens(i, p, 4000)
        out.append((0, (f"{name}{i}", (toks + 16).tolist(), o)))
    return out


def _requests_conversations(
    conversations: int, turns: int, first: int, new: int, out_len: int
) -> list[tuple[int, Any]]:
    """Multi-turn conversations, turn-major (every conversation's turn ``t`` before any turn
    ``t + 1``): a turn's prompt is the previous prompt, the fake model's answer to it and
    ``new`` new tokens."""
    history = [(unique_tokens(c, first, 4000) + 16).tolist() for c in range(conversations)]
    out = []
    for t in range(turns):
        for c in range(conversations):
            rid = f"conv{c}t{t}"
            prompt = history[c]
            out.append((0, (rid, prompt, out_len)))
            answer = [fake_token(rid, len(prompt) + i) for i in range(out_len)]
            extra = (unique_tokens(conversations * (t + 1) + c, new, 4000) + 16).tolist()
            history[c] = prompt + answer + extra
    return out


def _one_step(
    sched: Any, in_flight: list[Any] | None, worker: FakeConnectorWorker | None = None
) -> tuple[float, float, float, float, int]:
    """One engine step: ``schedule()`` and ``update_from_output()`` (``in_flight`` not None:
    async scheduling, the output consumed is the oldest of two batches in flight; ``worker``:
    the connector's fake worker, whose report joins the model output). CPU and wall seconds of
    each, and the requests scheduled."""
    c0, w0 = time.thread_time(), time.perf_counter()
    out = sched.schedule()
    c1, w1 = time.thread_time(), time.perf_counter()
    if in_flight is None:
        model_out = fake_model_output(sched, out)
        if worker is not None:
            model_out.kv_connector_output = worker.report(out)
    else:
        in_flight.append((out, fake_async_model_output(sched, out)))
        if len(in_flight) < 2:
            return c1 - c0, 0.0, w1 - w0, 0.0, len(out.num_scheduled_tokens)
        done, model_out = in_flight.pop(0)
    c2, w2 = time.thread_time(), time.perf_counter()
    sched.update_from_output(out if in_flight is None else done, model_out)
    c3, w3 = time.thread_time(), time.perf_counter()
    return c1 - c0, c3 - c2, w1 - w0, w3 - w2, len(out.num_scheduled_tokens)


def _measured_steps(
    sched: Any,
    steps: int,
    top_up: Callable[[], None],
    in_flight: list[Any] | None = None,
    worker: FakeConnectorWorker | None = None,
) -> tuple[float, float, float, float, int]:
    """The timed steps (the sampled share counts the samples under this frame): CPU and wall
    seconds in ``schedule()`` and ``update_from_output()``, and requests scheduled."""
    t_sched = t_upd = wall_sched = wall_upd = 0.0
    scheduled_reqs = 0
    for _ in range(steps):
        a, b, c, d, n = _one_step(sched, in_flight, worker)
        t_sched += a
        t_upd += b
        wall_sched += c
        wall_upd += d
        scheduled_reqs += n
        top_up()
    return t_sched, t_upd, wall_sched, wall_upd, scheduled_reqs


def run_one(
    cls: Any,
    specs: list[tuple[int, Any]],
    *,
    num_blocks: int,
    max_running: int,
    warmup_steps: int,
    steps: int,
    sample: bool,
    wait_all_decoding: bool,
    groups: Any = None,
    async_scheduling: bool = False,
    connector: str | None = None,
    host_spec: str = "cpu",
) -> dict[str, float]:
    """Drives ``cls`` over the request specs (``groups``: hybrid KV cache groups as
    ``make_hybrid_kv_cache_config`` takes them; None: one full-attention group;
    ``async_scheduling``: two batches in flight; ``connector``: a KV connector with a
    :class:`FakeConnectorWorker`, see :func:`kv_transfer_config`); returns per-step means in
    microseconds."""
    extra: dict[str, Any] = {}
    if connector is not None:
        if async_scheduling:
            raise ValueError("the connector workloads run with synchronous scheduling only")
        extra["kv_transfer_config"] = kv_transfer_config(connector, host_spec)
    cfg = make_vllm_config(
        num_blocks=num_blocks,
        block_size=BS,
        max_num_seqs=max_running,
        max_num_batched_tokens=8192,
        max_model_len=32768,
        async_scheduling=async_scheduling,
        **extra,
    )
    in_flight: list[Any] | None = [] if async_scheduling else None
    worker = FakeConnectorWorker() if connector is not None else None
    kv = make_hybrid_kv_cache_config(num_blocks, groups, BS) if groups else None
    sched = build_scheduler(cls, cfg, log_stats=False, kv_cache_config=kv)
    reqs = [make_request(rid, prompt, out, block_size=BS) for _, (rid, prompt, out) in specs]
    if connector == "nixl_consumer":
        for r in reqs:
            r.kv_transfer_params = _remote_prefill_params(r.request_id, r.num_prompt_tokens)
    pending = list(reversed(reqs))

    def top_up() -> None:
        while pending and len(sched.requests) < max_running:
            sched.add_request(pending.pop())

    top_up()
    done_warmup = 0
    while done_warmup < warmup_steps or (
        wait_all_decoding
        and any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running)
        or (wait_all_decoding and len(sched.running) < max_running)
    ):
        _one_step(sched, in_flight, worker)
        top_up()
        done_warmup += 1
        if done_warmup > 10_000:
            raise RuntimeError("warm-up did not reach steady state")
    sampler = KVSampler(type(sched)) if sample else None
    gc.collect()
    gc.disable()
    try:
        if sampler is not None:
            with sampler:
                t_sched, t_upd, wall_sched, wall_upd, scheduled_reqs = _measured_steps(
                    sched, steps, top_up, in_flight, worker
                )
        else:
            t_sched, t_upd, wall_sched, wall_upd, scheduled_reqs = _measured_steps(
                sched, steps, top_up, in_flight, worker
            )
    finally:
        gc.enable()
    res = {
        "schedule_us": 1e6 * t_sched / steps,
        "update_us": 1e6 * t_upd / steps,
        "total_us": 1e6 * (t_sched + t_upd) / steps,
        "wall_total_us": 1e6 * (wall_sched + wall_upd) / steps,
        "scheduled_reqs_per_step": scheduled_reqs / steps,
    }
    if sampler is not None:
        res["samples"] = sampler.scheduler
        res["kv_samples"] = sum(sampler.kv.values())
        res.update({f"kv_samples_{k}": v for k, v in sampler.kv.items()})
    if worker is not None:
        # Blocks the connector moved by the end of the measured steps (warm-up included).
        res["connector_blocks_loaded"] = worker.loads
        res["connector_blocks_stored"] = worker.stores
    return res


def hashing_cost(num_tokens: int = 8192, repeats: int = 20) -> dict[str, float]:
    """CPU µs per 16-token block: vLLM's Python block hasher (what the engine core runs for
    every prompt and ``update_from_output`` for every filled output block) vs pagedkv hashing,
    allocating and caching the same blocks in Rust (``allocate_slots`` of the whole prompt)."""
    import pagedkv

    tokens = (unique_tokens(7, num_tokens, 4000) + 16).tolist()
    blocks = num_tokens // BS
    request = make_request("h", tokens, 1, block_size=BS)
    hasher = request._block_hasher
    best_vllm = best_pkv = float("inf")
    for _ in range(repeats):
        request.block_hashes.clear()
        t0 = time.thread_time()
        request.block_hashes.extend(hasher(request))
        best_vllm = min(best_vllm, time.thread_time() - t0)
        kvm = pagedkv.KVCacheManager(pagedkv.CacheConfig(blocks + 2, BS))
        kvm.add_sequence(0, tokens)
        t0 = time.thread_time()
        kvm.allocate_slots(0, num_tokens)
        best_pkv = min(best_pkv, time.thread_time() - t0)
    assert len(request.block_hashes) == blocks
    return {
        "vllm_python_hash_us_per_block": 1e6 * best_vllm / blocks,
        "pagedkv_hash_allocate_cache_us_per_block": 1e6 * best_pkv / blocks,
    }


def prefill_allocation_cost(
    prompt_lens: tuple[int, ...] = (64, 1024), num_requests: int = 200, repeats: int = 5
) -> dict[str, float]:
    """CPU µs per new request for the plug-in's prefill allocation (what vLLM's scheduler calls
    when it admits a request: ``get_computed_blocks`` then ``allocate_slots`` of the whole
    prompt with ``full_sequence_must_fit``, vLLM 0.33's default, no prefix hit) on
    ``PagedKVCacheManager`` alone, one full-attention group and
    Gemma 3's six groups; best of ``repeats`` runs over ``num_requests`` distinct prompts each.
    The ``Request`` objects (and vLLM's Python prompt hashing) are built before the clock."""
    from pagedkv.integrations.vllm import PagedKVCacheManager
    from pagedkv.testing.vllm_scheduler import make_kv_cache_config

    out: dict[str, float] = {}
    for layout, groups in (("one_group", None), ("gemma3", GEMMA3_GROUPS)):
        for plen in prompt_lens:
            blocks = num_requests * (-(-plen // BS)) * (len(groups) if groups else 1) + 1
            best = float("inf")
            for rep in range(repeats):
                kv_cfg = make_hybrid_kv_cache_config(blocks, groups, BS) if groups else make_kv_cache_config(blocks, BS)
                kvm = PagedKVCacheManager(kv_cfg, max_model_len=32768)
                reqs = [
                    make_request(f"p{rep}-{i}", (unique_tokens(i, plen, 4000) + 16).tolist(), 1, block_size=BS)
                    for i in range(num_requests)
                ]
                gc.collect()
                gc.disable()
                try:
                    t0 = time.thread_time()
                    for req in reqs:
                        hit_blocks, hit = kvm.get_computed_blocks(req)[:2]
                        n = req.num_tokens - hit
                        if kvm.allocate_slots(req, n, hit, hit_blocks, full_sequence_must_fit=True) is None:
                            raise RuntimeError("the pool must hold every request")
                    best = min(best, time.thread_time() - t0)
                finally:
                    gc.enable()
            out[f"{layout}_prompt{plen}_us_per_request"] = 1e6 * best / num_requests
    return out


def _workloads() -> dict[str, dict[str, Any]]:
    return {
        "decode256": dict(
            specs=lambda: _requests_decode(256, 512, 100_000),
            num_blocks=256 * 48 + 1,
            warmup_steps=5,
            wait_all_decoding=True,
        ),
        "azure_conv": dict(
            specs=lambda: _requests_trace("azure_conv", 1500, 8192),
            num_blocks=160_000,
            warmup_steps=300,
            wait_all_decoding=False,
        ),
        "mooncake": dict(
            specs=lambda: _requests_trace("mooncake", 1200, 16384),
            num_blocks=160_000,
            warmup_steps=300,
            wait_all_decoding=False,
        ),
        "gemma3_decode128": dict(
            specs=lambda: _requests_decode(128, 600, 100_000),
            num_blocks=128 * 6 * 48 + 1,
            warmup_steps=5,
            wait_all_decoding=True,
            groups=GEMMA3_GROUPS,
            max_running=128,
        ),
        "offload_conv": dict(
            specs=lambda: _requests_conversations(256, 5, 512, 64, 32),
            num_blocks=4000,
            warmup_steps=300,
            wait_all_decoding=False,
            max_running=64,
            connector="offloading",
        ),
        "nixl_prefill": dict(
            specs=lambda: _requests_decode(4000, 512, 64),
            num_blocks=256 * 48 + 1,
            warmup_steps=300,
            wait_all_decoding=False,
            connector="nixl_consumer",
        ),
    }


def _run(
    cls: Any,
    w: dict[str, Any],
    specs: Any,
    steps: int,
    sample: bool,
    async_scheduling: bool = False,
    host_spec: str = "cpu",
) -> dict[str, float]:
    return run_one(
        cls,
        specs,
        num_blocks=w["num_blocks"],
        max_running=w.get("max_running", 256),
        warmup_steps=w["warmup_steps"],
        steps=steps,
        sample=sample,
        wait_all_decoding=w["wait_all_decoding"],
        groups=w.get("groups"),
        async_scheduling=async_scheduling,
        connector=w.get("connector"),
        host_spec=host_spec,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="measured steps per workload")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant (best kept)")
    ap.add_argument(
        "--workloads",
        default="decode256,azure_conv,mooncake",
        help="comma-separated; also gemma3_decode128 and the connector workloads offload_conv, nixl_prefill",
    )
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    ap.add_argument(
        "--trace-variants",
        default="vLLM stock,pagedkv",
        help="variants run on the trace workloads (all but the bound run on decode256)",
    )
    ap.add_argument("--sample-runs", type=int, default=5, help="CPU-time sampled runs per variant (KV share)")
    ap.add_argument("--no-write", action="store_true", help="do not write the results JSON")
    ap.add_argument(
        "--prefill-only",
        action="store_true",
        help="only the block hashing and per-request prefill allocation figures (no scheduler runs)",
    )
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="async scheduling: stock AsyncScheduler vs the plug-in's async variant, two batches in flight",
    )
    args = ap.parse_args()
    mode = args.async_scheduling
    variants = _variants(mode)
    workloads = _workloads()
    if args.variants:
        variants = {k: variants[k] for k in args.variants.split(",")}

    rows = []
    results: dict[str, Any] = {}
    load_start = os.getloadavg()
    hashing = hashing_cost()
    prefill = prefill_allocation_cost()
    print(
        "prefill allocation through PagedKVCacheManager, CPU us per new request: "
        + ", ".join(f"{k.removesuffix('_us_per_request')} {v:.1f}" for k, v in prefill.items()),
        flush=True,
    )
    print(
        f"block hashing, CPU us per 16-token block: vLLM Python hasher "
        f"{hashing['vllm_python_hash_us_per_block']:.2f}, pagedkv hash+allocate+cache in Rust "
        f"{hashing['pagedkv_hash_allocate_cache_us_per_block']:.3f}",
        flush=True,
    )
    if args.prefill_only:
        return
    for wname in args.workloads.split(","):
        w = workloads[wname]
        specs = w["specs"]()
        results[wname] = {}
        if "connector" in w and mode:
            print(f"{wname}: skipped (connector workloads run with synchronous scheduling only)", flush=True)
            continue
        chosen = {k: v for k, v in variants.items() if k != BOUND or wname == "decode256"}
        if wname != "decode256":
            chosen = {k: v for k, v in chosen.items() if k in args.trace_variants.split(",")}
        if w.get("connector") == "offloading" and "pagedkv" in chosen:
            chosen[HOST_TIER] = chosen["pagedkv"]  # the plug-in with pagedkv's host tier
        # Round-robin over the variants, so a change in the machine's load hits them alike.
        timed: dict[str, list[dict[str, float]]] = {v: [] for v in chosen}
        sampled: dict[str, list[dict[str, float]]] = {v: [] for v in chosen}
        for rep in range(max(args.repeats, args.sample_runs)):
            for vname, cls in chosen.items():
                spec = "pagedkv" if vname == HOST_TIER else "cpu"
                if rep < args.repeats:
                    timed[vname].append(_run(cls, w, specs, args.steps, False, mode, spec))
                if rep < args.sample_runs:
                    sampled[vname].append(_run(cls, w, specs, args.steps, True, mode, spec))
        for vname in chosen:
            best: dict[str, Any] = min(timed[vname], key=lambda r: r["total_us"])
            best["runs_total_us"] = [r["total_us"] for r in timed[vname]]
            best["samples"] = sum(r["samples"] for r in sampled[vname])
            for key in ("kv_samples", "kv_samples_manager", "kv_samples_blocks", "kv_samples_hashing"):
                best[key] = sum(r[key] for r in sampled[vname])
            samples = max(best["samples"], 1)  # a short run may take no sample
            best["kv_share"] = best["kv_samples"] / samples
            for kind in ("manager", "blocks", "hashing"):
                best[f"kv_share_{kind}"] = best[f"kv_samples_{kind}"] / samples
            best["kv_us"] = best["kv_share"] * best["total_us"]
            results[wname][vname] = best
            print(f"{wname:10s} {vname:22s} {best}", file=sys.stderr, flush=True)
        base = results[wname].get("vLLM stock")
        for vname, r in results[wname].items():
            rows.append(
                [
                    wname,
                    vname,
                    f"{r['scheduled_reqs_per_step']:.0f}",
                    f"{r['schedule_us']:.0f}",
                    f"{r['update_us']:.0f}",
                    f"{r['total_us']:.0f}",
                    f"{base['total_us'] / r['total_us']:.2f}x" if base else "-",
                    f"{r['kv_us']:.0f}",
                    f"{100 * r['kv_share']:.1f}% ({r['samples']})",
                    f"{base['kv_share'] / r['kv_share']:.1f}x" if base and r["kv_share"] else "-",
                    " / ".join(f"{100 * r[f'kv_share_{k}']:.1f}" for k in ("manager", "blocks", "hashing")),
                ]
            )
    print_table(
        "vLLM Scheduler CPU time per step (us), stock vs PagedKVScheduler"
        + (" (async scheduling: AsyncScheduler, two batches in flight)" if mode else ""),
        [
            "workload",
            "scheduler",
            "reqs/step",
            "schedule",
            "update",
            "total",
            "speed-up",
            "KV us",
            "KV share (samples)",
            "share ratio",
            "manager / blocks / hashing %",
        ],
        rows,
        footnote=f"{BOUND!r} is no scheduler: decodes answered by a no-op, KV state not kept "
        "(vLLM's own cost around a free KV manager). Load average (1 min) "
        f"{load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end.",
    )
    if not args.no_write:
        import vllm

        name = "vllm_scheduler_async" if mode else "vllm_scheduler"
        path = write_json(
            name,
            {
                "benchmark": name,
                "async_scheduling": mode,
                "vllm": vllm.__version__,
                "steps": args.steps,
                "repeats": args.repeats,
                "sample_runs": args.sample_runs,
                "machine": machine_info(),
                "load_average_1_5_15min": {"start": list(load_start), "end": list(os.getloadavg())},
                "results": results,
                "hashing": hashing,
                "prefill_allocation": prefill,
                "notes": [
                    "CPU time (thread_time) per step, best of the timed runs",
                    "KV work = kv_cache_manager calls + KVCacheBlocks.get_block_ids + "
                    "Request.update_block_hashes, in both schedulers",
                    "kv_share: SIGPROF (CPU-time) samples over sample_runs separate runs, fraction of "
                    "schedule()/update_from_output() samples in KV frames; kv_us = kv_share * total_us",
                    f"{BOUND}: no scheduler; decodes answered by a no-op (vLLM's own cost)",
                    "requests (and the engine core's Python prompt hashing) built before timing",
                ],
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
