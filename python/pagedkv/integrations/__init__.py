"""Adapters that put pagedkv inside serving stacks.

Each adapter lives in its own subpackage and imports its stack on import (``import
pagedkv.integrations.vllm`` needs vLLM); ``import pagedkv`` never imports any of them.

- :mod:`pagedkv.integrations.vllm` -- a vLLM V1 scheduler whose KV cache manager is pagedkv.
"""
