"""Text -> ids: the one encoder of every path that reads text (``seqpar prepare``'s documents, a
plain text stream of ``--data FILE|DIR``).

A document is bytes or a string. With a tokenizer (a ``tokenizers`` JSON file) it is decoded as
UTF-8 (a byte that is not UTF-8 becomes U+FFFD) and encoded with no special token added *and none
matched*: text that spells a special token (a document quoting ``<|endoftext|>``) is encoded as the
characters it is, so only seqpar places an end-of-document id. Without a tokenizer its ids are its
UTF-8 bytes, NUL bytes dropped (NUL is the byte-level end-of-document).

``documents`` gives each document's ids (``seqpar prepare`` appends the end-of-document id to each);
``stream`` lays documents end to end as one stream, as a plain text source has always been read:
byte-level files joined by a newline, tokenized files back to back.
"""

from __future__ import annotations

import os

import torch

from seqpar.data import tokenizer as tokfile

# the encoding rule's name, in prepare's plan: a prepare begun under another rule is not resumed
# with this one
ENCODING = "special-text-is-text-1"


class Encoder:
    """Documents -> ids (see the module docstring); ``tokenizer_file`` '' for bytes. ``threads``:
    the tokenizer's own threads (off in a worker process of ``seqpar prepare``: one core each)."""

    def __init__(self, tokenizer_file: str = "", threads: bool = True):
        self.tok = None
        if tokenizer_file:
            if not threads:
                os.environ["RAYON_NUM_THREADS"] = "1"
            self.tok = tokfile.load(tokenizer_file)
            # a special token's text inside a document is text
            self.tok.encode_special_tokens = True

    def token(self, i: int) -> str:
        """How id ``i`` reads (a tokenizer's token, or a byte)."""
        return self.tok.id_to_token(i) if self.tok is not None else repr(bytes([i]))

    def documents(self, docs: list) -> list:
        """Each document's ids: ``bytes`` (byte-level; iterate as their values) or a list of
        ints."""
        if self.tok is None:
            return [
                (d if isinstance(d, bytes) else d.encode("utf-8")).replace(b"\0", b"") for d in docs
            ]
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def stream(self, docs: list) -> torch.Tensor:
        """The documents as one stream (see the module docstring): ``[n]`` uint8 ids (bytes) or
        int64."""
        ids = self.documents(docs)
        if self.tok is None:
            raw = b"\n".join(ids)
            return (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if raw
                else torch.zeros(0, dtype=torch.uint8)
            )
        return torch.tensor([i for doc in ids for i in doc], dtype=torch.int64)
