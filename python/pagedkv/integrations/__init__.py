"""Adapters that put pagedkv inside serving stacks.

Each adapter lives in its own subpackage; ``import pagedkv`` never imports any of them.
``import pagedkv.integrations.vllm`` imports vLLM; ``pagedkv.integrations.transformers`` imports
transformers only when it installs (so an unsupported release is refused by name).

- :mod:`pagedkv.integrations.vllm` -- a vLLM V1 scheduler whose KV cache manager is pagedkv.
- :mod:`pagedkv.integrations.transformers` -- pagedkv as the KV cache of Hugging Face
  transformers' continuous batching.
"""
