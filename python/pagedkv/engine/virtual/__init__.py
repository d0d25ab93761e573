"""The virtual KV layout (``LLMEngine(kv_layout="virtual")``): each sequence's K and V
contiguous in reserved virtual memory, physical pages committed on demand.

:mod:`.memory` (the arenas: reserve, commit, release, share pages; :mod:`.memory_cuda` on a GPU),
:mod:`.layout` (slots, segments, page accounting, the page-group prefix cache, attention),
:mod:`.manager` (the KV cache manager the scheduler sees, capacity in pages) and :mod:`.runner`
(the model runner over the layout).

Nothing is imported here: the modules that need torch import it on their own.
"""
