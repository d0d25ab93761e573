"""Test and benchmark helpers that ship with pagedkv but are not part of its serving API.

- :mod:`pagedkv.testing.vllm_scheduler`: vLLM's real V1 scheduler driven on CPU by a
  deterministic fake model (no GPU, no network, no weights), for the vLLM plug-in's
  differential suite, ``benchmarks/vllm_scheduler.py`` and the README's "Inside vLLM" example.
  Needs the ``vllm`` extra.
"""
