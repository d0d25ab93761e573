"""Prompt workloads with shared prefixes for the routing benchmarks: real token ids (not only
lengths), so a pagedkv manager finds the prefix hits by hashing its own blocks.

Three workloads, each a :class:`RoutingWorkload` (prompts, output lengths, relative arrival
times; the benchmark scales the times to its target rate):

- ``mooncake``: the Mooncake conversation trace (Qin et al., FAST'25): its ``hash_ids`` expanded
  to tokens (:func:`common.expand_hash_ids`) and its timestamps. The routing weights are tuned
  on this one.
- ``multi_tenant_chat`` (synthetic, held out): 40 tenants whose system prompts span 220 to
  5,600 tokens (log-uniform), Zipf(1.1) tenant popularity, multi-turn conversations (each turn's
  prompt is the system prompt, every earlier turn's user message and reply, and a new message),
  15 % unique prompts, Poisson arrivals; each turn names its previous turn
  (``RoutingWorkload.parents``) and the simulation sends it no earlier than that one finishes.
- ``azure_conv_apps`` (real arrivals and lengths, held out): the Azure LLM inference trace's
  conversation excerpt (Patel et al., ISCA'24): its timestamps (bursty) and its context /
  generated token counts; each request belongs to one of 30 applications (Zipf(1.0)) whose
  system prompt (log-uniform 300 to 4,000 tokens, cut to the request's context) leads its
  prompt, then unique tokens up to its context length; 10 % of requests share nothing.

A reply in a conversation is the token ids the simulated engine appended as that request's
output (``common.unique_tokens(request index, output length)``), so a later turn hits the blocks
its previous turn decoded, as in a real engine. Deterministic for a seed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

__all__ = ["RoutingWorkload", "WORKLOADS", "load_routing_workload"]

# Token-id salts per kind of text, so system prompts, user messages and unique prompts never
# share tokens by accident (the simulated engine's outputs use salt 1).
_SALT_SYSTEM, _SALT_USER, _SALT_UNIQUE = 11, 12, 13


@dataclass
class RoutingWorkload:
    """Requests of one workload, in arrival order.

    Attributes:
        name: workload name.
        prompts: one int64 token-id array per request.
        output_lens: int64[N] generated tokens per request (>= 1).
        arrival_s: float64[N] arrival times, seconds from the first (rescaled by the benchmark).
        notes: how it was built, for the result JSON.
        parents: int64[N], the conversation's previous turn of each request (-1: none), or None
            (no request continues another). The simulation holds a turn until its parent has
            finished: a user sends the next message after the reply.
    """

    name: str
    prompts: list[np.ndarray]
    output_lens: np.ndarray
    arrival_s: np.ndarray
    notes: list[str] = field(default_factory=list)
    parents: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def describe(self) -> dict[str, object]:
        """Counts and mean lengths (tokens), for the result JSON."""
        p = np.array([len(x) for x in self.prompts])
        return {
            "name": self.name,
            "requests": len(self),
            "prompt_mean": float(p.mean()),
            "prompt_p99": float(np.percentile(p, 99)),
            "output_mean": float(self.output_lens.mean()),
            "notes": self.notes,
        }


def mooncake(n: int | None = None, traces_dir: str | None = None) -> RoutingWorkload:
    """The Mooncake conversation trace (first ``n`` requests; the bundled excerpt by default)."""
    w = common.load_workload("mooncake", traces_dir, n=n)
    assert w.hash_ids is not None
    prompts = [common.expand_hash_ids(h, int(p)) for h, p in zip(w.hash_ids, w.prompt_lens.tolist())]
    return RoutingWorkload("mooncake", prompts, w.output_lens.astype(np.int64), w.arrival_s, [w.source])


def _zipf_probs(n: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    probs: np.ndarray = p / p.sum()
    return probs


@dataclass
class _Conversation:
    tokens: np.ndarray  # the prompt so far, the last reply included
    turns_left: int
    last: int = -1  # the request of the previous turn


def multi_tenant_chat(
    n: int = 3000,
    seed: int = 0,
    num_tenants: int = 40,
    system_tokens: tuple[int, int] = (220, 5600),
    zipf_s: float = 1.1,
    unique_share: float = 0.15,
    mean_turns: float = 3.0,
    active_conversations: int = 64,
) -> RoutingWorkload:
    """``n`` chat requests of ``num_tenants`` tenants (see the module docs). A request is unique
    with probability ``unique_share``; else it continues one of up to ``active_conversations``
    open conversations (chosen uniformly) or opens a new one for a Zipf(``zipf_s``)-popular
    tenant; a conversation lasts a geometric number of turns of mean ``mean_turns``. User
    messages: log-normal, mean 120 tokens; outputs: log-normal, mean 220 tokens (at most 1,024);
    unique prompts: log-normal, mean 900 tokens. Arrivals: Poisson, 1 per second."""
    rng = np.random.default_rng(seed)
    lo, hi = system_tokens
    sys_lens = np.exp(rng.uniform(np.log(lo), np.log(hi), num_tenants)).astype(np.int64)
    popularity = _zipf_probs(num_tenants, zipf_s)
    rng.shuffle(popularity)  # popularity independent of the system prompt's length
    systems = [common.unique_tokens(t, int(sys_lens[t]), salt=_SALT_SYSTEM) for t in range(num_tenants)]
    out_lens = common.lognormal_lengths(rng, n, 220.0, 0.8, 1024)
    user_lens = common.lognormal_lengths(rng, n, 120.0, 0.8, 1024)
    unique_lens = common.lognormal_lengths(rng, n, 900.0, 0.8, 6000)
    open_convs: list[_Conversation] = []
    prompts: list[np.ndarray] = []
    parents = np.full(n, -1, dtype=np.int64)
    unique = 0
    for i in range(n):
        user = common.unique_tokens(i, int(user_lens[i]), salt=_SALT_USER)
        if rng.random() < unique_share:
            prompts.append(common.unique_tokens(i, int(unique_lens[i]), salt=_SALT_UNIQUE))
            unique += 1
            continue
        if open_convs and (len(open_convs) >= active_conversations or rng.random() < 0.6):
            c = int(rng.integers(len(open_convs)))
            conv = open_convs[c]
        else:
            tenant = int(rng.choice(num_tenants, p=popularity))
            conv = _Conversation(systems[tenant], int(rng.geometric(1.0 / mean_turns)))
            open_convs.append(conv)
            c = len(open_convs) - 1
        prompt = np.concatenate([conv.tokens, user])
        prompts.append(prompt)
        parents[i] = conv.last
        conv.last = i
        reply = common.unique_tokens(i, int(out_lens[i]))  # what the simulated engine decodes
        conv.tokens = np.concatenate([prompt, reply])
        conv.turns_left -= 1
        if conv.turns_left <= 0:
            open_convs.pop(c)
    arrivals = common.poisson_arrivals(rng, n, 1.0)
    notes = [
        f"seed {seed}; {num_tenants} tenants, system prompts {lo}-{hi} tokens log-uniform, Zipf({zipf_s}); "
        f"{unique} unique prompts; conversations of mean {mean_turns} turns, at most {active_conversations} open"
    ]
    return RoutingWorkload("multi_tenant_chat", prompts, out_lens, arrivals, notes, parents)


def azure_conv_apps(
    n: int = 3000,
    seed: int = 0,
    traces_dir: str | None = None,
    num_apps: int = 30,
    system_tokens: tuple[int, int] = (300, 4000),
    zipf_s: float = 1.0,
    unique_share: float = 0.10,
) -> RoutingWorkload:
    """The Azure conversation trace's first ``n`` requests (timestamps, context and generated
    token counts as recorded), each led by the system prompt of one of ``num_apps`` applications
    (Zipf(``zipf_s``) popularity, log-uniform lengths in ``system_tokens``, cut to the request's
    context) and filled with unique tokens; ``unique_share`` of them share nothing."""
    w = common.load_workload("azure_conv", traces_dir, n=n)
    rng = np.random.default_rng(seed)
    lo, hi = system_tokens
    sys_lens = np.exp(rng.uniform(np.log(lo), np.log(hi), num_apps)).astype(np.int64)
    popularity = _zipf_probs(num_apps, zipf_s)
    rng.shuffle(popularity)
    systems = [common.unique_tokens(a, int(sys_lens[a]), salt=_SALT_SYSTEM + 10) for a in range(num_apps)]
    prompts: list[np.ndarray] = []
    for i, ctx in enumerate(w.prompt_lens.tolist()):
        if rng.random() < unique_share:
            prompts.append(common.unique_tokens(i, int(ctx), salt=_SALT_UNIQUE))
            continue
        head = systems[int(rng.choice(num_apps, p=popularity))][:ctx]
        tail = common.unique_tokens(i, int(ctx) - len(head), salt=_SALT_USER)
        prompts.append(np.concatenate([head, tail]))
    notes = [w.source, f"seed {seed}; {num_apps} apps, system prompts {lo}-{hi} tokens, Zipf({zipf_s})"]
    return RoutingWorkload("azure_conv_apps", prompts, w.output_lens.astype(np.int64), w.arrival_s, notes)


WORKLOADS = ("mooncake", "multi_tenant_chat", "azure_conv_apps")


def load_routing_workload(name: str, n: int | None = None, seed: int = 0) -> RoutingWorkload:
    """One of :data:`WORKLOADS` (first ``n`` requests; each generator's default when None)."""
    if name == "mooncake":
        return mooncake(n)
    if name == "multi_tenant_chat":
        return multi_tenant_chat(n or 3000, seed)
    if name == "azure_conv_apps":
        return azure_conv_apps(n or 3000, seed)
    raise ValueError(f"unknown routing workload {name!r}: expected one of {WORKLOADS}")
