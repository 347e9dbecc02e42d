"""Data path: corpus discovery (corpus, system_corpus), BPE tokenizer (tokenizer), tokenized shard cache
(shards), packed loaders (loader), baselines, and `prepare` that runs them in order.

`from megacpp.data import prepare_data` works as documented, but the names load on first use
(PEP 562): `megacpp.config` reads `DataConfig` from this package, and reading the configuration should
not load the data path (the tokenizer library, the corpus walk, the loaders). Code inside megacpp
imports from the submodules.
"""
from __future__ import annotations

import importlib
from typing import Any

_SUBMODULE = {
    **dict.fromkeys(("Baselines",), "baselines"),
    **dict.fromkeys(("DataConfig", "default_cache_dir"), "config"),
    **dict.fromkeys(("Corpus", "CorpusError", "Document", "discover_corpus"), "corpus"),
    **dict.fromkeys(("Batch", "LoaderStateError", "PackedLoader", "SplitTooSmallError", "ValBatch", "ValLoader"),
                    "loader"),
    **dict.fromkeys(("PreparedData", "load_or_train_tokenizer", "prepare_data"), "prepare"),
    **dict.fromkeys(("ShardError", "ShardSet", "ShardSplit", "build_shards", "load_shards"), "shards"),
    **dict.fromkeys(("CodeTokenizer", "train_tokenizer"), "tokenizer"),
}
__all__ = sorted(_SUBMODULE)


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULE:
        raise AttributeError(f"module 'megacpp.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megacpp.data.{_SUBMODULE[name]}"), name)
