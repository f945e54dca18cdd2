"""Data that training reads: tokenizers (a run's own copy, checked by hash), prepared token folders
(``seqpar prepare``: sharded ids, a document index, a manifest) and the windows cut from
documents."""
