"""The allocator operation trace: continuous batching of real request lengths, built once and
replayed identically through pagedkv, vLLM's KV cache manager and nano-vllm's block manager.

A trace is a list of scheduler steps. In step ``t`` the scheduler
  1. admits the requests in ``admit[t]``: each registers its prompt and gets slots for the whole
     prompt in one go (prefix cache lookup first; no chunked prefill), which samples its first
     output token;
  2. gives every request admitted earlier and still running one decode slot for the token it
     sampled in the previous step;
  3. frees the requests in ``finish[t]``, the ones that sampled their last output token in this
     step.
So a request with output length O runs for O steps and writes prompt + O - 1 tokens of KV.

Admission is FCFS: a request may be admitted once it has arrived (Poisson arrivals, in steps)
while fewer than ``max_running`` requests run. The first ``max_running`` requests arrive at step 0
(a server starting with a queue), so the batch is full from the first step. The KV pool is sized
so that no allocation can fail in any of the three systems (no preemption: every system does the
same work).

Prompt tokens: for Mooncake, each hash id expands to 512 deterministic tokens
(:func:`common.expand_hash_ids`), so the trace's real prefix sharing reaches the prefix caches;
other traces get unique tokens per request. Output tokens are unique per request.

The module is pure Python + numpy and is imported by the replays in other environments.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

try:  # imported as benchmarks.op_trace or as a top-level module from the replays
    from . import common
except ImportError:  # pragma: no cover - replay subprocesses put benchmarks/ on sys.path
    import common  # type: ignore[no-redef]


@dataclass
class OpTrace:
    """A continuous-batching operation trace (see module docstring).

    Attributes:
        workload: trace name. block_size: tokens per KV block for every system.
        num_blocks: KV pool size in blocks, large enough that nothing fails (includes block 0).
        prompt_lens, output_lens: per request, tokens. hash_ids: Mooncake block ids or None.
        admit, finish: per step, request indices admitted / freed in that step.
        block_ops: total block operations of the trace (see :func:`count_block_ops`).
    """

    workload: str
    block_size: int
    num_blocks: int
    max_running: int
    prompt_lens: list[int]
    output_lens: list[int]
    hash_ids: list[list[int]] | None
    admit: list[list[int]]
    finish: list[list[int]]
    block_ops: int
    mean_running: float
    arrival_rate_per_step: float
    seed: int

    @property
    def num_steps(self) -> int:
        return len(self.admit)

    def prompt_tokens(self, r: int) -> np.ndarray:
        """Prompt token ids of request ``r`` (int64)."""
        if self.hash_ids is not None:
            return common.expand_hash_ids(self.hash_ids[r], self.prompt_lens[r])
        return common.unique_tokens(r, self.prompt_lens[r], salt=1)

    def output_tokens(self, r: int) -> np.ndarray:
        """The ``output_lens[r]`` sampled token ids of request ``r`` (int64), unique to it."""
        return common.unique_tokens(r, self.output_lens[r], salt=2)

    def save(self, path: str | Path) -> None:
        """Write the trace as JSON."""
        Path(path).write_text(json.dumps(asdict(self)))

    def save_tokens(self, path: str | Path) -> None:
        """Write every request's prompt then output token ids, request by request, as
        little-endian uint32 (the input of the Rust replay, ``rust/core/examples/replay.rs``)."""
        with open(path, "wb") as f:
            for r in range(len(self.prompt_lens)):
                f.write(self.prompt_tokens(r).astype("<u4").tobytes())
                f.write(self.output_tokens(r).astype("<u4").tobytes())

    @classmethod
    def load(cls, path: str | Path) -> OpTrace:
        """Read a trace written by :meth:`save`."""
        return cls(**json.loads(Path(path).read_text()))


def count_block_ops(prompt_len: int, output_len: int, block_size: int) -> int:
    """Block operations one request costs every system: each of its blocks is obtained once
    (allocated, or taken from the prefix cache) and released once. The KV it writes is
    prompt + output - 1 tokens (the last sampled token is never written)."""
    kv_tokens = prompt_len + output_len - 1
    return 2 * (-(-kv_tokens // block_size))


def build(
    workload: common.Workload,
    *,
    num_steps: int,
    block_size: int = 16,
    max_running: int = 256,
    load: float = 1.05,
    seed: int = 0,
    headroom: float = 1.25,
) -> OpTrace:
    """Build an operation trace of ``num_steps`` steps from a workload's lengths.

    Args:
        workload: request lengths (and Mooncake hash ids) in trace order.
        num_steps: scheduler steps to simulate.
        block_size: tokens per block, shared by all systems.
        max_running: the batch cap (running sequences).
        load: Poisson arrival rate as a multiple of the service rate ``max_running / mean output``,
            so a value > 1 keeps a queue and the batch full.
        seed: seed of the arrival process.
        headroom: KV pool = ``headroom`` x (peak blocks in use without sharing), so that no
            allocation fails and evicting cached blocks still happens rarely.

    Raises ValueError if the workload runs out of requests before ``num_steps``.
    """
    rng = np.random.default_rng(seed)
    out_mean = float(workload.output_lens.mean())
    rate = load * max_running / out_mean  # requests per step
    n = len(workload)
    arrivals = np.zeros(n)
    arrivals[max_running:] = np.cumsum(rng.exponential(1.0 / rate, n - max_running))
    admit: list[list[int]] = []
    finish: list[list[int]] = []
    running: dict[int, int] = {}  # request -> steps left (including this one)
    nxt = 0
    peak_blocks = 0
    block_ops = 0
    running_sum = 0
    p_lens = workload.prompt_lens.tolist()
    o_lens = workload.output_lens.tolist()
    for t in range(num_steps):
        adm = []
        while nxt < n and len(running) < max_running and arrivals[nxt] <= t:
            running[nxt] = o_lens[nxt]
            block_ops += count_block_ops(p_lens[nxt], o_lens[nxt], block_size)
            adm.append(nxt)
            nxt += 1
        if not running and nxt >= n:
            raise ValueError(f"workload {workload.name} has only {n} requests; ran out at step {t}")
        # Blocks held after this step's allocations (upper bound, ignoring sharing).
        used = 0
        fin = []
        for r, left in running.items():
            written = p_lens[r] + (o_lens[r] - left)  # KV tokens after this step
            used += -(-written // block_size)
            if left == 1:
                fin.append(r)
        peak_blocks = max(peak_blocks, used)
        running_sum += len(running)
        for r in fin:
            del running[r]
        for r in list(running):
            running[r] -= 1
        admit.append(adm)
        finish.append(fin)
    # Requests still running at the end are freed in the last step, so every system ends empty;
    # their block-op share is still counted in full above, so count what they actually did.
    last = finish[-1]
    for r, left in running.items():
        last.append(r)
        done_out = o_lens[r] - left
        block_ops -= count_block_ops(p_lens[r], o_lens[r], block_size)
        block_ops += count_block_ops(p_lens[r], done_out, block_size)
    return OpTrace(
        workload=workload.name,
        block_size=block_size,
        num_blocks=int(peak_blocks * headroom) + 2,
        max_running=max_running,
        prompt_lens=[int(x) for x in p_lens[:nxt]],
        output_lens=[int(x) for x in o_lens[:nxt]],
        hash_ids=None if workload.hash_ids is None else workload.hash_ids[:nxt],
        admit=admit,
        finish=finish,
        block_ops=block_ops,
        mean_running=running_sum / num_steps,
        arrival_rate_per_step=rate,
        seed=seed,
    )


def schedule(trace: OpTrace) -> tuple[dict[int, int], dict[int, int]]:
    """Admit and finish step of every request, as two dicts request -> step."""
    a = {r: t for t, rs in enumerate(trace.admit) for r in rs}
    f = {r: t for t, rs in enumerate(trace.finish) for r in rs}
    return a, f


def main() -> None:  # pragma: no cover - debugging aid
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="mooncake")
    ap.add_argument("--traces-dir", default=None)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tr = build(common.load_workload(a.trace, a.traces_dir), num_steps=a.steps, block_size=a.block_size)
    tr.save(a.out)
    print(
        f"{tr.num_steps} steps, {len(tr.prompt_lens)} requests, {tr.block_ops} block ops, "
        f"mean running {tr.mean_running:.1f}, pool {tr.num_blocks} blocks"
    )


if __name__ == "__main__":  # pragma: no cover
    main()
