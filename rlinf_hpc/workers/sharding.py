"""How a batch that every data-parallel rank holds whole is split over the ranks and into
minibatches, and the global counts a rank's loss is normalized by (`DataParallelScale`)."""

from __future__ import annotations

from rlinf_hpc.algorithms import DataParallelScale


def even_share(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``total`` items are split into ``parts`` contiguous
    parts whose sizes differ by at most one (manual placements are checked to divide evenly;
    a split chosen by ``auto`` may not).

    >>> [even_share(10, 3, i) for i in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def minibatch_share(
    lengths: list[int], ranks: int, rank: int, minibatches: int, m: int, dp_ranks: int
) -> tuple[slice, DataParallelScale]:
    """Rank ``rank``'s part of minibatch ``m`` of a batch of sequences with token ``lengths``
    (each rank's contiguous share cut into ``minibatches``), and the token and sequence counts
    of minibatch ``m`` over all ranks — computed locally, as every rank holds the batch.

    >>> minibatch_share([1, 2, 3, 4, 5, 6], 2, 1, 2, 0, 2)
    (slice(3, 5, None), DataParallelScale(tokens=12.0, sequences=4.0, ranks=2))
    """
    parts = []
    for r in range(ranks):
        lo, hi = even_share(len(lengths), ranks, r)
        a, b = even_share(hi - lo, minibatches, m)
        parts.append(slice(lo + a, lo + b))
    tokens = sum(n for part in parts for n in lengths[part])
    sequences = sum(part.stop - part.start for part in parts)
    return parts[rank], DataParallelScale(float(tokens), float(sequences), dp_ranks)
