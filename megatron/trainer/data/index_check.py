"""Read a megatron-core ``.idx`` header ourselves before megatron-core opens the dataset.

megatron-core's ``IndexedDataset`` asserts on a bad header halfway through its constructor,
and its ``__del__`` (and its bin reader's) then run on the half-built object and print
"Exception ignored in ... AttributeError" tracebacks after our one-line error. Checking the
header, the index's exact size and the ``.bin``'s non-emptiness first means megatron-core
only ever sees files it can open, so a garbage index is one line and nothing else.

Layout (megatron-core 0.16's ``_IndexWriter``, non-multimodal): 9-byte magic, version
``<Q`` (1), dtype code ``<B``, sequence count ``<Q``, document count ``<Q`` (34 bytes), then
int32 sequence lengths, int64 sequence pointers and int64 document indices.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")
DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron-core's DType codes


class IndexFileError(ValueError):
    """A ``.idx``/``.bin`` pair megatron-core cannot open; one line naming the file."""


@dataclass(frozen=True)
class IndexHeader:
    dtype_code: int
    sequences: int
    documents: int


def read_index_header(idx_path: str, bin_path: str) -> IndexHeader:
    """The header of ``idx_path``, after checking the magic, version, dtype code, the file's
    size against its counts and that ``bin_path`` holds data."""
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise IndexFileError(f"{idx_path}: corrupt or not a megatron-core index file ({size} bytes, shorter than its header)")
    magic, version, code, sequences, documents = HEADER.unpack(raw)
    if magic != MAGIC:
        raise IndexFileError(f"{idx_path}: corrupt or not a megatron-core index file (bad magic {magic[:7]!r})")
    if version != 1:
        raise IndexFileError(f"{idx_path}: corrupt or unsupported index (version {version}, megatron-core reads 1)")
    if code not in DTYPE_SIZES:
        raise IndexFileError(f"{idx_path}: corrupt index (unknown token dtype code {code})")
    expected = HEADER.size + 12 * sequences + 8 * documents
    if size != expected:
        raise IndexFileError(f"{idx_path}: corrupt or truncated index ({size} bytes, its header describes "
                             f"{sequences} sequences and {documents} document boundaries = {expected} bytes)")
    if os.path.getsize(bin_path) == 0:
        raise IndexFileError(f"{bin_path}: empty (no tokens); re-run tools/preprocess_data.py on a non-empty corpus")
    return IndexHeader(code, sequences, documents)
