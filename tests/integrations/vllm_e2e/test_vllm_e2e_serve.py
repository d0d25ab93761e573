"""One real ``vllm serve`` with ``PagedKVScheduler`` on 127.0.0.1, queried through the ``openai``
client, and its KV events consumed by ``pagedkv.KVIndexer``.

The server is vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the CPU
build's ``vllm`` command cannot start) on SmolLM2 from pagedkv's converted folder, with prefix
caching and ``--kv-events-config`` publishing on ZMQ over 127.0.0.1 only: the subscriber binds
127.0.0.1 before the server starts and vLLM's publisher connects to it (vLLM binds only wildcard
endpoints, which would listen on every interface), so the indexer sees every batch from ``seq`` 0. Checked: a chat
completion (the answer), a streamed one (the same text), a bounded set of concurrent requests,
and that the indexer fed by the server's events answers a repeated prompt as a full hit (the
server then reports exactly that many cached tokens) and a differently salted one as a miss
(the server computes it all).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm-e2e runs this suite)")

from e2e_helpers import (  # noqa: E402
    BLOCK_SIZE,
    Server,
    free_port,
    kv_events_config,
    skip_unless_vllm_runs_models,
    vllm_children,
)

skip_unless_vllm_runs_models()

import openai  # noqa: E402
import psutil  # noqa: E402
import zmq  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.integrations.vllm.events import publish_hash  # noqa: E402
from pagedkv.routing import wire  # noqa: E402

WORKER = 0
TOPIC = "kv"


class EventFeed:
    """A ZMQ subscriber bound to 127.0.0.1:``port`` for the server's KV events (received in its
    own thread) and the indexer its batches go into (``drain``, in the caller's thread)."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        # vLLM's publisher binds wildcard endpoints only (every interface) and connects to any
        # other: the subscriber binds 127.0.0.1 and the server connects to it.
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.frames: list[list[bytes]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()
        self.indexer = pagedkv.KVIndexer(BLOCK_SIZE)
        self.indexer.add_worker(WORKER, hash_source="tokens")
        self.outcomes: list[str] = []
        self.seqs: list[int] = []
        self.events: list[list[Any]] = []  # every wire event applied, oldest first

    def _receive(self) -> None:
        while not self.stopping.is_set():
            try:
                frames = self.sock.recv_multipart()
            except zmq.Again:
                continue
            with self.lock:
                self.frames.append(frames)

    def drain(self) -> None:
        """Applies the batches received so far to the indexer, in order."""
        with self.lock:
            frames, self.frames = self.frames, []
        for f in frames:
            seq, batch = wire.decode_zmq_frames(f)
            self.seqs.append(seq)
            self.events.extend(batch.events)
            self.outcomes.append(self.indexer.apply(WORKER, seq, batch.events, hash_root=batch.hash_root))

    def wait_for(self, tokens: list[int], blocks: int, timeout_s: float = 30.0, **query: Any) -> int:
        """Drains until the indexer's overlap of ``tokens`` (with ``query``) reaches ``blocks``;
        returns the overlap it ended with."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            got = self.indexer.overlap(tokens, **query)[WORKER]
            if got >= blocks or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, EventFeed]]:
    """The server with the plug-in, and the event feed subscribed before it started."""
    assert vllm_children(timeout_s=60) == [], "another vLLM engine is still running"
    events_port = free_port()
    feed = EventFeed(events_port)
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    args = [
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--scheduler-cls",
        "pagedkv.integrations.vllm.PagedKVScheduler",
        "--no-async-scheduling",
        "--kv-events-config",
        kv_events_config(events_port, TOPIC),
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
    ]
    try:
        server = Server(model_dir, log, args)
    except BaseException:
        feed.close()
        raise
    rss = sum(
        p.memory_info().rss for p in [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(True)]
    )
    print(f"\nvllm serve with PagedKVScheduler: ready in {server.ready_s:.0f} s, {rss / 2**30:.1f} GiB resident")
    try:
        yield server, feed
    finally:
        server.stop()
        feed.close()
        assert vllm_children() == [], "a server process outlived the server"


@pytest.fixture(scope="module")
def client(served: tuple[Server, EventFeed]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].base_url, api_key="unused", max_retries=0, timeout=300)


def _ask(client: openai.OpenAI, question: str, max_tokens: int = 32, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=max_tokens, **kw
    )


def test_chat_completion(client: openai.OpenAI):
    r = _ask(client, "What is the capital of France?")
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 32


def test_streamed_chat_gives_the_same_text(client: openai.OpenAI):
    whole = _ask(client, "What is the capital of Japan?").choices[0].message.content
    chunks = list(_ask(client, "What is the capital of Japan?", stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 3  # token by token, not one piece
    assert streamed == whole and "Tokyo" in streamed, (streamed, whole)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_concurrent_requests(client: openai.OpenAI):
    """Eight requests at once (bounded, loopback only): each one answered, in its own words."""
    questions = [f"In one sentence, what is {t}?" for t in ("rain", "music", "a bridge", "bread")] * 2
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(questions)) as pool:
        answers = list(pool.map(lambda q: _ask(client, q, max_tokens=24), questions))
    took = time.monotonic() - started
    texts = [a.choices[0].message.content for a in answers]
    assert all(len(t.split()) >= 3 for t in texts), texts
    assert all(0 < a.usage.completion_tokens <= 24 for a in answers)
    assert len(set(texts)) >= 4  # four different questions
    print(f"\n8 concurrent chat requests in {took:.1f} s")


def test_kv_events_index_a_full_hit_and_a_salted_miss(
    client: openai.OpenAI, served: tuple[Server, EventFeed], model_dir: Path
):
    """The indexer, fed only by the server's events, predicts what the server then reports."""
    from transformers import AutoTokenizer

    _, feed = served
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    text = " ".join(f"Section {i}: the library opens at nine and closes at five on weekdays." for i in range(40))
    prompt = tok(text, add_special_tokens=False)["input_ids"][: 4 * BLOCK_SIZE + 17]
    full = (len(prompt) - 1) // BLOCK_SIZE  # the full blocks a hit can cover
    assert full == 4

    def complete(**kw: Any) -> Any:
        return client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, **kw)

    feed.drain()
    assert feed.indexer.overlap(prompt)[WORKER] == 0  # not sent yet
    first = complete()
    assert first.usage.prompt_tokens == len(prompt)
    assert feed.wait_for(prompt, full) == full  # the stored blocks arrived as events
    assert feed.indexer.overlap(prompt, cache_salt="tenant-b")[WORKER] == 0

    # The server agrees: the repeated prompt is a full hit, the salted one a miss.
    again = complete()
    assert again.usage.prompt_tokens_details.cached_tokens == full * BLOCK_SIZE
    assert again.choices[0].text == first.choices[0].text
    salted = complete(extra_body={"cache_salt": "tenant-b"})
    assert (salted.usage.prompt_tokens_details.cached_tokens or 0) == 0
    # Its blocks are published under the salt: indexed apart from the unsalted ones.
    assert feed.wait_for(prompt, full, cache_salt="tenant-b") == full
    assert feed.indexer.overlap(prompt, cache_salt="tenant-c")[WORKER] == 0
    assert feed.indexer.overlap(prompt)[WORKER] == full
    assert feed.seqs == list(range(len(feed.seqs))) and set(feed.outcomes) == {"applied"}

    # The hashes published are pagedkv's (the plug-in's manager), not stock vLLM's: the prompt's
    # first stored block carries the first 8 bytes of pagedkv's chained SHA-256, as an int.
    manager = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=BLOCK_SIZE, enable_events=True))
    manager.add_sequence(1, prompt)
    manager.allocate_slots(1, len(prompt))
    ours = [h for ev in manager.take_events() if isinstance(ev, pagedkv.BlockStored) for h in ev.block_hashes]
    stored = [ev for ev in feed.events if ev[0] == "BlockStored" and ev[3][:BLOCK_SIZE] == prompt[:BLOCK_SIZE]]
    assert stored and stored[0][1][0] == publish_hash(ours[0])
