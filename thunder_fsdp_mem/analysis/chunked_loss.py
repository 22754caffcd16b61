"""The chunked linear cross-entropy as the estimator sees it: its symbols' names, how its rows are cut into chunks,
and the memory one chunk needs while the op runs (its workspace). ``thunder_fsdp_mem.loss`` runs the op; this
module is the arithmetic both it and the estimator share, so that what is predicted is what runs.

One chunk of ``rows`` rows (of ``vocab`` columns) holds, at its most:
- on CUDA, where the chunk's logits go into one buffer in the weight's dtype and a compiled kernel pair
  (``torch.compile``) writes their gradient over them: that buffer;
- on CPU (eager torch, in place where it can): the logits in the weight's dtype and their float32 copy (one buffer
  when the weight is float32); with soft-capping, the float32 values and the cap's derivative; last, the float32
  values and the gradient rounded to the weight's dtype.
"""

from __future__ import annotations

import math

FORWARD = "chunked_linear_cross_entropy"  # the loss alone (a program without autograd)
FORWARD_WITH_GRADS = "chunked_linear_cross_entropy_with_grads"  # the loss and the gradients of its inputs
SCALE = "chunked_linear_cross_entropy_scale"  # the backward: a gradient times the cotangent, in place
EXECUTOR = "fsdp_mem_loss"
SYMBOLS = frozenset({FORWARD, FORWARD_WITH_GRADS})
# The symbols' arguments: (hidden, weight, bias, targets, ignore_index, softcap, reduction, chunks, loss_dtype).
SOFTCAP_ARG, CHUNKS_ARG = 5, 7
MIN_ROWS = 256  # fewer rows than this make the chunk's matmuls slow for what they save
MAX_CHUNKS = 64


def row_chunks(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each chunk: ``chunks`` chunks of ``ceil(rows / chunks)`` rows, the last one shorter."""
    if rows <= 0:
        return []
    size = math.ceil(rows / max(1, min(chunks, rows)))
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def chunk_rows(rows: int, chunks: int) -> int:
    """The rows of the largest chunk."""
    return max((stop - start for start, stop in row_chunks(rows, chunks)), default=0)


def candidate_chunks(rows: int) -> list[int]:
    """The chunk counts worth trying, fewest first: powers of two while a chunk keeps ``MIN_ROWS`` rows (at least
    one: a single chunk)."""
    counts = [1]
    while counts[-1] * 2 <= MAX_CHUNKS and math.ceil(rows / (counts[-1] * 2)) >= MIN_ROWS:
        counts.append(counts[-1] * 2)
    return counts


def workspace_bytes(rows: int, vocab: int, chunks: int, *, weight_bytes: int, softcap: bool, device_type: str) -> int:
    """Bytes a chunk holds beyond the op's outputs while it runs (the module docstring says what)."""
    cells = chunk_rows(rows, chunks) * vocab
    if device_type == "cuda":
        return cells * weight_bytes
    copy = 0 if weight_bytes == 4 else weight_bytes  # a float32 weight's logits are their own float32 copy
    return cells * max(copy + 4, 4 + (4 if softcap else 0), 4 + copy)
