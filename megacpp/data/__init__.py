"""Data path: corpus discovery, BPE tokenizer, tokenized shard cache, packed loaders."""
from megacpp.data.baselines import Baselines
from megacpp.data.config import DataConfig, default_cache_dir
from megacpp.data.corpus import Corpus, CorpusError, Document, discover_corpus
from megacpp.data.loader import (
    Batch,
    LoaderStateError,
    PackedLoader,
    SplitTooSmallError,
    ValBatch,
    ValLoader,
    bits_per_byte,
)
from megacpp.data.prepare import PreparedData, load_or_train_tokenizer, prepare_data
from megacpp.data.shards import ShardError, ShardSet, ShardSplit, build_shards, load_shards
from megacpp.data.tokenizer import CodeTokenizer, train_tokenizer

__all__ = [
    "Baselines", "Batch", "CodeTokenizer", "Corpus", "CorpusError", "DataConfig", "Document", "LoaderStateError",
    "PackedLoader",
    "PreparedData", "ShardError", "ShardSet", "ShardSplit", "SplitTooSmallError", "ValBatch", "ValLoader",
    "bits_per_byte",
    "build_shards", "default_cache_dir", "discover_corpus", "load_or_train_tokenizer", "load_shards",
    "prepare_data", "train_tokenizer",
]
