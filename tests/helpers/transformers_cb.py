"""The two ways a user runs continuous batching, stock and with pagedkv installed, for the
differential tests: ``generate_batch`` and the streaming manager."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from pagedkv.integrations.transformers import Installation, is_installed, use_pagedkv


@dataclass
class Run:
    """One run's outputs: request id -> generated tokens, request id -> error (failed ones), and
    the pagedkv installation (``None`` for a stock run)."""

    tokens: dict[str, list[int]]
    errors: dict[str, str] = field(default_factory=dict)
    kv: Installation | None = None


def _configs(model: Any, max_new_tokens: int, n: int, cb: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=max_new_tokens,
        # num_return_sequences > 1 needs sampling in transformers; top_k=1 keeps it greedy.
        do_sample=n > 1,
        top_k=1,
        num_return_sequences=n,
        eos_token_id=-1,  # every request runs max_new_tokens: the longest, most telling outputs
        pad_token_id=0,
    )
    return gen, ContinuousBatchingConfig(**({"page_size": 4, "max_batch_tokens": 64} | cb))


def generate_batch(
    model: Any, prompts: list[list[int]], *, pagedkv: bool, max_new_tokens: int = 12, n: int = 1, **cb: Any
) -> Run:
    """``model.generate_batch`` on the prompts (stock, or inside ``use_pagedkv(model)``)."""
    gen, cb_config = _configs(model, max_new_tokens, n, cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not pagedkv:
            assert not is_installed()
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config)
            kv = None
        else:
            with use_pagedkv(model) as kv:
                out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config)
    run = Run({rid: list(o.generated_tokens) for rid, o in out.items()}, kv=kv)
    run.errors = {rid: str(o.error) for rid, o in out.items() if o.error is not None}
    return run


def stream_with_cancel(
    model: Any, prompts: list[list[int]], *, pagedkv: bool, cancel_after: int, max_new_tokens: int = 16, **cb: Any
) -> Run:
    """The streaming manager (``continuous_batching_context_manager``): every prompt added as a
    streaming request, the first one cancelled once it has streamed ``cancel_after`` tokens, the
    others read to the end. Returns the tokens each request streamed (the cancelled one's up to
    the cancellation)."""
    gen, cb_config = _configs(model, max_new_tokens, 1, cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not pagedkv:
            assert not is_installed()
            return Run(_stream(model, prompts, gen, cb_config, cancel_after, None))
        with use_pagedkv(model) as kv:
            return Run(_stream(model, prompts, gen, cb_config, cancel_after, kv), kv=kv)


def _stream(
    model: Any, prompts: list[list[int]], gen: Any, cb_config: Any, cancel_after: int, kv: Installation | None
) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb_config, block=True, timeout=30
    ) as manager:
        ids = [manager.add_request(p, request_id=f"stream{i}", streaming=True) for i, p in enumerate(prompts)]
        victim = ids[0]
        for out in manager.request_id_iter(victim):
            tokens[victim] = list(out.generated_tokens[:cancel_after])
            if len(out.generated_tokens) >= cancel_after:
                manager.cancel_request(victim)
                break
        for rid in ids[1:]:
            for out in manager.request_id_iter(rid):
                tokens[rid] = list(out.generated_tokens)
        if kv is not None:
            # The cancellation is applied by the generation thread at its next step.
            for _ in range(400):
                if kv.manager.num_sequences == 0:
                    break
                time.sleep(0.05)
    return tokens
