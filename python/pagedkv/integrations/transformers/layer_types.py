"""The attention types pagedkv serves inside transformers' continuous batching."""

from __future__ import annotations

from typing import Any

from pagedkv.integrations.transformers.errors import UnsupportedAttentionTypeError

__all__ = ["SERVED_LAYER_TYPES", "check_layer_types"]

#: The ``config.layer_types`` entries pagedkv serves: full attention (a ``"full"`` KV cache
#: group) and sliding-window attention (a ``"sliding_window"`` group of the config's window).
SERVED_LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")


def check_layer_types(config: Any) -> None:
    """Raise :class:`UnsupportedAttentionTypeError` naming the first entry of
    ``config.layer_types`` (a transformers text config) pagedkv does not serve. A config without
    ``layer_types`` has one kind for every layer, which pagedkv serves."""
    for layer_type in getattr(config, "layer_types", None) or ():
        if layer_type not in SERVED_LAYER_TYPES:
            served = ", ".join(SERVED_LAYER_TYPES)
            raise UnsupportedAttentionTypeError(
                f"layer type {layer_type!r} is not served by pagedkv's continuous-batching KV cache "
                f"(it serves {served})",
                field="layer_types",
                value=str(layer_type),
                reason=f"pagedkv serves {served}",
            )
