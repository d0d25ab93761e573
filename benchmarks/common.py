"""Shared helpers for the pagedkv benchmarks: trace loading, synthetic lengths, token expansion,
result files, tables and plots.

Pure Python + numpy so that the foreign replays (vLLM, nano-vllm), which run in other Python
environments, can import it too. Rich, tqdm and matplotlib are imported lazily by the helpers
that need them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
DATA_DIR = BENCH_DIR / "data"
RESULTS_DIR = BENCH_DIR / "results"

#: Tokens covered by one Mooncake ``hash_ids`` entry (its README: one id per 512-token block).
MOONCAKE_HASH_BLOCK_TOKENS = 512

#: Paper-like length means (Kwon et al., SOSP'23, Fig. 11), in tokens.
PAPER_LENGTH_MEANS = {
    "sharegpt": (161.31, 337.99),
    "alpaca": (19.31, 58.45),
}

TRACE_FILES = {
    "azure_conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "azure_code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
    "mooncake": "mooncake_fast25/conversation_trace.jsonl",
}


@dataclass
class Workload:
    """Request lengths of one trace, in tokens.

    Attributes:
        name: short trace name (``azure_conv``, ``mooncake``, ``sharegpt_like``...).
        prompt_lens: int64[N] prompt tokens per request (>= 1).
        output_lens: int64[N] generated tokens per request (>= 1).
        arrival_s: float64[N] arrival times in seconds from the first request (may be synthetic).
        hash_ids: for Mooncake only, one list of 512-token block ids per request; else None.
        source: where the lengths came from (file path or distribution), for the result JSON.
    """

    name: str
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    arrival_s: np.ndarray
    hash_ids: list[list[int]] | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.prompt_lens.shape[0])

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (all of them when ``n`` is larger)."""
        n = min(n, len(self))
        return Workload(
            self.name,
            self.prompt_lens[:n],
            self.output_lens[:n],
            self.arrival_s[:n],
            None if self.hash_ids is None else self.hash_ids[:n],
            self.source,
            list(self.notes),
        )

    def describe(self) -> dict[str, Any]:
        """Summary statistics (count, means, p50/p99/max) for the result JSON."""
        p, o = self.prompt_lens, self.output_lens
        return {
            "name": self.name,
            "source": self.source,
            "requests": len(self),
            "prompt_mean": float(p.mean()),
            "prompt_p50": float(np.percentile(p, 50)),
            "prompt_p99": float(np.percentile(p, 99)),
            "prompt_max": int(p.max()),
            "output_mean": float(o.mean()),
            "output_p50": float(np.percentile(o, 50)),
            "output_max": int(o.max()),
            "notes": self.notes,
        }


def traces_root(traces_dir: str | os.PathLike | None) -> Path:
    """The folder holding the trace files: ``traces_dir`` if given, else the bundled excerpts."""
    return Path(traces_dir) if traces_dir else DATA_DIR


def load_azure(kind: str, traces_dir: str | os.PathLike | None = None) -> Workload:
    """Load the Azure LLM inference trace 2023 (``kind`` = ``"conv"`` or ``"code"``) through
    the package's one trace reader (:func:`pagedkv.engine.inputs.read_trace_rows`).

    Rows with 0 generated tokens are kept with output length 1 (a request always samples one
    token). Raises FileNotFoundError naming the missing path.
    """
    if kind not in ("conv", "code"):
        raise ValueError(f"azure trace kind must be 'conv' or 'code', got {kind!r}")
    path = traces_root(traces_dir) / TRACE_FILES[f"azure_{kind}"]
    rows = _trace_rows(path)
    missing = next((r.line for r in rows if r.arrival_s is None), None)
    if missing is not None:
        raise ValueError(f"{path}:{missing}: no parsable TIMESTAMP")
    ta = np.asarray([r.arrival_s for r in rows], dtype=np.float64)
    return Workload(
        f"azure_{kind}",
        np.asarray([max(1, r.prompt_tokens) for r in rows], dtype=np.int64),
        np.asarray([max(1, r.output_tokens) for r in rows], dtype=np.int64),
        ta - ta[0],
        None,
        str(path),
    )


def load_mooncake(traces_dir: str | os.PathLike | None = None) -> Workload:
    """Load the Mooncake FAST'25 conversation trace (lengths, ms timestamps and hash ids)
    through the package's one trace reader."""
    path = traces_root(traces_dir) / TRACE_FILES["mooncake"]
    rows = _trace_rows(path)
    return Workload(
        "mooncake",
        np.asarray([max(1, r.prompt_tokens) for r in rows], dtype=np.int64),
        np.asarray([max(1, r.output_tokens) for r in rows], dtype=np.int64),
        np.asarray([r.arrival_s for r in rows], dtype=np.float64),
        [list(r.hash_ids or ()) for r in rows],
        str(path),
    )


def _trace_rows(path: Path) -> list[Any]:
    """The rows of a trace file (torch-free reader); FileNotFoundError naming a missing path."""
    from pagedkv.engine.inputs import read_trace_rows

    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    return read_trace_rows(path)


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, max_len: int) -> np.ndarray:
    """``n`` integer lengths from a log-normal with shape ``sigma``, clipped to ``[1, max_len]``,
    whose realised mean is ``mean`` within 1% (the scale is corrected after clipping)."""
    mu = np.log(mean) - sigma * sigma / 2.0
    z = rng.standard_normal(n)
    for _ in range(20):  # rescale until the clipped, rounded mean matches
        x = np.clip(np.rint(np.exp(mu + sigma * z)), 1, max_len)
        if abs(x.mean() - mean) <= 0.01 * mean:
            break
        mu += np.log(mean / x.mean())
    return x.astype(np.int64)


def paper_like(
    name: str, n: int, seed: int = 0, sigma: float = 1.0, max_len: int = 2048, rate_per_s: float = 1.0
) -> Workload:
    """Synthetic ShareGPT- or Alpaca-like lengths matching the PagedAttention paper's means.

    Lengths are log-normal (shape ``sigma``) clipped to the model's context ``max_len`` (input plus
    output <= max_len, as OPT's 2048), with Poisson arrivals at ``rate_per_s``. The paper gives
    only the means (Fig. 11), so the distribution shape is our choice and is recorded in ``notes``.
    """
    if name not in PAPER_LENGTH_MEANS:
        raise ValueError(f"paper-like workload must be one of {sorted(PAPER_LENGTH_MEANS)}, got {name!r}")
    mi, mo = PAPER_LENGTH_MEANS[name]
    rng = np.random.default_rng(seed)
    p = lognormal_lengths(rng, n, mi, sigma, max_len // 2)
    o = lognormal_lengths(rng, n, mo, sigma, max_len // 2)
    arr = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    return Workload(
        f"{name}_like",
        p,
        o,
        arr - arr[0],
        None,
        f"synthetic log-normal(sigma={sigma}) matching paper means input {mi} / output {mo}",
        [f"lengths clipped to [1, {max_len // 2}] each; seed {seed}"],
    )


def load_workload(
    name: str, traces_dir: str | os.PathLike | None = None, n: int | None = None, seed: int = 0
) -> Workload:
    """Load a workload by name: ``azure_conv``, ``azure_code``, ``mooncake``, ``sharegpt_like``,
    ``alpaca_like`` (the latter two synthetic, ``n`` requests, default 2000)."""
    if name == "azure_conv":
        w = load_azure("conv", traces_dir)
    elif name == "azure_code":
        w = load_azure("code", traces_dir)
    elif name == "mooncake":
        w = load_mooncake(traces_dir)
    elif name in ("sharegpt_like", "alpaca_like"):
        return paper_like(name[: -len("_like")], n or 2000, seed)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return w.head(n) if n else w


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival times (float64[n], first at 0) of a Poisson process with ``rate`` per unit time."""
    a = np.cumsum(rng.exponential(1.0 / rate, n))
    return a - a[0]


def _mix64(x: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser: a cheap, well-mixed, deterministic hash of uint64 keys.
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def expand_hash_ids(
    hash_ids: Sequence[int],
    num_tokens: int,
    vocab_size: int = 32000,
    block_tokens: int = MOONCAKE_HASH_BLOCK_TOKENS,
    seed: int = 0,
) -> np.ndarray:
    """Deterministic token ids (int64[num_tokens]) for a Mooncake prompt.

    Each hash id stands for ``block_tokens`` tokens; token j of id h is a hash of (seed, h, j), so
    equal ids give equal tokens in every request and every process, and distinct ids differ. The
    last id may be partial (the prompt is cut at ``num_tokens``).
    """
    if num_tokens > len(hash_ids) * block_tokens:
        raise ValueError(f"num_tokens={num_tokens} exceeds {len(hash_ids)} hash ids x {block_tokens} tokens")
    ids = np.asarray(hash_ids, dtype=np.uint64)
    pos = np.arange(block_tokens, dtype=np.uint64)
    keys = (ids[:, None] << np.uint64(20)) ^ pos[None, :] ^ (np.uint64(seed) << np.uint64(52))
    toks = (_mix64(keys) % np.uint64(vocab_size)).astype(np.int64).reshape(-1)
    return toks[:num_tokens]


def unique_tokens(request_index: int, num_tokens: int, vocab_size: int = 32000, salt: int = 1) -> np.ndarray:
    """Deterministic token ids (int64[num_tokens]) unique to one request (no shared prefix
    with any other request, with overwhelming probability)."""
    pos = np.arange(num_tokens, dtype=np.uint64)
    keys = (np.uint64(request_index) << np.uint64(24)) ^ pos ^ (np.uint64(salt) << np.uint64(56))
    return (_mix64(keys) % np.uint64(vocab_size)).astype(np.int64)


# ----------------------------------------------------------------------------- environment


def git_commit(path: str | os.PathLike = REPO_DIR) -> str | None:
    """The HEAD commit of the git checkout at ``path`` (None if not a checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, core count, OS and Python version, for the result JSON."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "pagedkv_commit": git_commit(),
        "when": datetime.now().isoformat(timespec="seconds"),
    }


def pagedkv_version() -> str | None:
    """The installed pagedkv's version string, or None when it cannot be imported."""
    try:
        import pagedkv  # noqa: PLC0415

        return getattr(pagedkv, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


# ----------------------------------------------------------------------------- output


def write_json(name: str, payload: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``payload`` (plus machine info) to ``results_dir/name.json``; returns the path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine_info(), **payload}
    path = results_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], footnote: str | None = None) -> None:
    """Print a table with rich (falls back to plain text when rich is missing)."""
    rows = [[_fmt(c) for c in r] for r in rows]
    try:
        from rich.console import Console  # noqa: PLC0415
        from rich.table import Table  # noqa: PLC0415
    except ImportError:
        print(f"\n{title}")
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(r))
        if footnote:
            print(footnote)
        return
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c not in (columns[0],) else "left")
    for r in rows:
        t.add_row(*r)
    con = Console(width=max(170, Console().width))
    con.print(t)
    if footnote:
        con.print(footnote, style="dim")


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table of ``rows`` under ``columns``."""
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        out.append("| " + " | ".join(_fmt(c) for c in r) + " |")
    return "\n".join(out)


def _fmt(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, (float, np.floating)):
        ax = abs(float(x))
        if ax == 0:
            return "0"
        if ax >= 100:
            return f"{x:,.0f}"
        if ax >= 10:
            return f"{x:.1f}"
        return f"{x:.2f}"
    if isinstance(x, (int, np.integer)):
        return f"{int(x):,}"
    return str(x)


def pyplot():
    """matplotlib.pyplot with the non-interactive Agg backend."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def progress(iterable=None, total=None, desc: str = "", disable: bool | None = None, **kw):
    """A tqdm progress bar on stderr (disabled when stderr is not a terminal and
    PAGEDKV_BENCH_PROGRESS is unset, so logs stay clean)."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    if disable is None:
        disable = not (sys.stderr.isatty() or os.environ.get("PAGEDKV_BENCH_PROGRESS"))
    return tqdm(iterable, total=total, desc=desc, disable=disable, leave=False, dynamic_ncols=True, **kw)


class Timer:
    """Accumulating wall-clock timer (``perf_counter_ns``); use as a context manager."""

    def __init__(self) -> None:
        self.ns = 0
        self._t0 = 0

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ns += time.perf_counter_ns() - self._t0
