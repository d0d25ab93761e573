"""After a forward pass: sample the next tokens and apply them to each request's sequence group
-- append, fork the ``n > 1`` samples on their first token, run beam steps (fork continued
beams, free dropped ones), stop finished sequences and free their KV."""

from __future__ import annotations

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from .manager_protocol import EngineKVManager
from .metrics import MetricsCollector
from .outputs import OutputProcessor
from .registry import RequestRegistry
from .request import Request, Sequence
from .sampling import sample_tokens
from .speculative import num_accepted

__all__ = ["SequenceGroups", "Row"]

Row = tuple[Request, Sequence]  # a sequence that samples this step, and its request


class SequenceGroups:
    """Sampling and per-group updates (see the module docs).

    Args:
        manager: the KV cache manager (frees finished sequences).
        registry: creates and forks sequences.
        outputs: stop checks.
    """

    def __init__(self, manager: EngineKVManager, registry: RequestRegistry, outputs: OutputProcessor) -> None:
        self.manager = manager
        self.registry = registry
        self.outputs = outputs

    def sample(self, rows: list[Row], logits: torch.Tensor) -> list[int | None]:
        """The next token of each row (logits row ``i`` for ``rows[i]``); ``None`` for a beam,
        whose fp32 log-probs are kept on the sequence until every beam of its request has them."""
        plain = [i for i, (r, _) in enumerate(rows) if not r.params.use_beam_search]
        tokens: list[int | None] = [None] * len(rows)
        if plain:
            drawn = sample_tokens(
                logits[plain], [rows[i][0].params for i in plain], [rows[i][1].generator for i in plain]
            )
            for i, tok in zip(plain, drawn):
                tokens[i] = tok
        for i, (req, seq) in enumerate(rows):
            if req.params.use_beam_search:
                seq.logprobs = torch.log_softmax(logits[i].float().cpu(), dim=-1)
        return tokens

    def update(self, rows: list[Row], tokens: list[int | None], logits: torch.Tensor, now: float) -> list[Request]:
        """Apply the sampled ``tokens`` (see :meth:`sample`); returns the requests of ``rows``
        left with no live sequence (done), each once, in row order."""
        for i, ((req, seq), tok) in enumerate(zip(rows, tokens)):
            if tok is None:
                continue
            if req.params.n > 1 and not req.forked:
                self._fork_samples(req, seq, logits[i], now)
            self._append(req, seq, tok, now)
        beams = {id(r): r for r, _ in rows if r.params.use_beam_search}
        for req in beams.values():
            if all(s.logprobs is not None for s in req.seqs):
                self._beam_step(req, now)
        return [r for r in {id(r): r for r, _ in rows}.values() if not r.seqs]

    def verify(
        self,
        items: list[tuple[Request, Sequence, list[int]]],
        logits: torch.Tensor,
        now: float,
        metrics: MetricsCollector | None = None,
    ) -> list[Request]:
        """Greedy verification of a speculative step (:mod:`.speculative`): per item
        ``(request, sequence, k drafts)``, in order, ``k + 1`` rows of ``logits``. Accepts the
        longest draft prefix matching the argmax at each position (``manager.accept_drafts``
        rolls the rejected drafts' slots and blocks back), then emits the accepted drafts and
        the bonus token one by one with the usual stop checks, so EOS, stop strings and
        ``max_tokens`` cut exactly where plain decoding would. Returns the requests left with
        no live sequence."""
        done: list[Request] = []
        row = 0
        for req, seq, drafts in items:
            k = len(drafts)
            targets = sample_tokens(logits[row : row + k + 1], [req.params] * (k + 1), [None] * (k + 1))
            row += k + 1
            m = num_accepted(drafts, targets)
            self.manager.accept_drafts(seq.seq_id, m)
            if metrics is not None:
                metrics.on_verify(k, m)
            for i, tok in enumerate(targets[: m + 1]):
                # The accepted drafts already have KV in the manager; only the bonus is pending.
                if self._append(req, seq, tok, now, pending=i == m):
                    break
            if not req.seqs:
                done.append(req)
        return done

    def _fork_samples(self, req: Request, parent: Sequence, row: torch.Tensor, now: float) -> None:
        """First token of an ``n > 1`` request: fork the prompt's sequence n-1 times (blocks
        shared) and give each child its own sample from the same logits."""
        req.forked = True
        for index in range(1, req.params.n):
            child = self.registry.fork(req, parent, index)
            req.seqs.append(child)
            self._append(req, child, sample_tokens(row[None], [req.params], [child.generator])[0], now)

    def _append(self, req: Request, seq: Sequence, tok: int, now: float, *, pending: bool = True) -> bool:
        """Add a sampled token (``pending=False``: an accepted draft, already a token of the
        manager's sequence); finish the sequence (freeing its KV) when it stops. Returns
        whether it stopped."""
        if pending:
            seq.add_token(tok)
        else:
            seq.token_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        reason = self.outputs.finish_reason(seq, req.params)
        if reason is not None:
            seq.finish_reason = reason
            self.manager.free(seq.seq_id)
            req.seqs.remove(seq)
            req.finished_seqs.append(seq)
            return True
        return False

    def _beam_step(self, req: Request, now: float) -> None:
        """One beam search step over all beams of ``req`` (fork continued beams, free dropped)."""
        assert req.beam is not None
        old = req.seqs
        result = req.beam.step(torch.stack([s.logprobs for s in old]))  # type: ignore[misc]
        for s in old:
            s.logprobs = None
        if req.first_token_time is None:
            req.first_token_time = now
        if result.done:
            for s in old:
                self.manager.free(s.seq_id)
            req.seqs = []
            return
        # Fork every extra continuation from its unmodified parent first, then drop parents with
        # no continuation, then append the new tokens (sent to the manager next step).
        new: list[tuple[Sequence, int]] = []
        used: set[int] = set()
        for parent_index, tok in zip(result.parents, result.tokens):
            parent = old[min(parent_index, len(old) - 1)]
            if id(parent) not in used:
                used.add(id(parent))
                new.append((parent, tok))
            else:
                new.append((self.registry.fork(req, parent, 0), tok))
        for s in old:
            if id(s) not in used:
                self.manager.free(s.seq_id)
        for s, tok in new:
            s.add_token(tok)
        req.seqs = [s for s, _ in new]
