"""Byte-level BPE tokenizer for code (HF `tokenizers`), trained on the corpus's training split."""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from megacpp.data.config import MIN_VOCAB_SIZE
from megacpp.data.corpus import Corpus, Document
from megacpp.errors import MegacppError
from megacpp.fs import atomic_path

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2

# Pre-token boundaries for code; BPE merges never cross them. In order of preference:
#   identifier with one optional leading blank (" foo", "\tbar", "_x1"); 1-3 digits;
#   a punctuation run with one optional leading blank (" ->", "::", ");", " {}");
#   trailing blanks + newline(s) + the next line's indentation as one piece ("\n    ");
#   other blank runs, leaving the last blank to the following identifier/punctuation.
SPLIT_PATTERN = (
    r"[^\S\n]?[\p{L}_][\p{L}\p{N}_]*"
    r"|\p{N}{1,3}"
    r"|[^\S\n]?[^\s\p{L}\p{N}_]+"
    r"|\s*\n[^\S\n]*"
    r"|[^\S\n]+(?!\S)"
    r"|[^\S\n]+"
)


class TokenizerError(MegacppError, ValueError):
    """A tokenizer.json that cannot be used: not a tokenizer, or without megacpp's special tokens."""


def file_hash(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


class CodeTokenizer:
    """Thin wrapper over a HF `Tokenizer`: ids without specials, fast batch encoding, hash."""

    def __init__(self, tok: Tokenizer, hash: str, path: Path | None = None) -> None:
        self._tok = tok
        # Text that happens to contain "<|bos|>" is encoded as ordinary bytes, so a document can
        # never inject a document boundary into the packed stream.
        self._tok.encode_special_tokens = True
        self.hash = hash
        self.path = path
        self.bos_id = self._special_id(BOS)
        self.eos_id = self._special_id(EOS)
        self.pad_id = self._special_id(PAD)

    @classmethod
    def from_file(cls, path: str | Path) -> CodeTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any parse failure
            raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from e
        return cls(tok, file_hash(path), path)

    def _special_id(self, token: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise TokenizerError(f"tokenizer {self.path} lacks the special token {token}")
        return idx

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Parallel (Rust threads) encoding; `encode_batch_fast` skips offset tracking where it exists."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each token stands for (0 for specials), for bits-per-byte.

        Byte-level BPE maps every byte to exactly one printable character, so a token's byte
        count is the length of its vocabulary string.
        """
        specials = {self.bos_id, self.eos_id, self.pad_id}
        out = np.zeros(self.vocab_size, dtype=np.int32)
        for idx in range(self.vocab_size):
            if idx not in specials:
                out[idx] = len(self._tok.id_to_token(idx))
        return out


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def sample_documents(docs: list[Document], budget_bytes: int) -> list[Document]:
    """Deterministic subsample: documents in content-hash order until the byte budget is spent."""
    out, total = [], 0
    for doc in sorted(docs, key=lambda d: d.hash):
        if total >= budget_bytes:
            break
        out.append(doc)
        total += doc.nbytes
    return out


def train_tokenizer(
    corpus: Corpus, vocab_size: int, sample_bytes: int, out_path: str | Path
) -> CodeTokenizer:
    """Train on (a sample of) the training split, save `tokenizer.json` atomically, load it back."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} < {MIN_VOCAB_SIZE} (256 bytes + 3 specials)")
    docs = sample_documents(corpus.split("train"), sample_bytes)
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for d in docs:
            yield d.text

    tok.train_from_iterator(texts(), trainer=trainer, length=len(docs))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_path) as tmp:
        tok.save(str(tmp))
    return CodeTokenizer.from_file(out_path)
