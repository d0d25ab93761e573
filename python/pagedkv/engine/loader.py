"""The former place of :mod:`pagedkv.engine.models.loader`, kept so that imports of the
earlier releases (``from pagedkv.engine.loader import model_folder``) keep working; the loader
itself lives in :mod:`pagedkv.engine.models.loader`."""

from .models.loader import (
    DEFAULT_MODEL_PACKAGE,
    ModelSource,
    default_model_path,
    file_version,
    load_hf_model,
    load_tokenizer,
    model_folder,
    resolve_model_path,
)

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "ModelSource",
    "default_model_path",
    "resolve_model_path",
    "file_version",
    "model_folder",
    "load_tokenizer",
    "load_hf_model",
]
