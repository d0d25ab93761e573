"""The reference engine's model code: the forward passes over the paged KV cache
(:mod:`.model` for the Llama family, :mod:`.gemma3` for Gemma 3), RoPE (:mod:`.rope`), which
model serves which architecture (:mod:`.architectures`), finding, converting and loading weights
(:mod:`.loader`) and the cache identity of the loaded weights (:mod:`.identity`).

Nothing is imported here: the modules that need torch import it on their own.
"""
