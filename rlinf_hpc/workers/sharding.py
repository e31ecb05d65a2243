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


def token_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of sequences with token ``lengths`` packed into micro-batches whose padded size
    (rows x longest row) stays within ``budget`` tokens: longest first, each micro-batch
    filled greedily while the next sequence fits; a sequence longer than the budget gets a
    micro-batch of its own. ``budget`` 0: one micro-batch of everything, in order.

    >>> token_micro_batches([5, 9, 3, 9, 4], 18)
    [[1, 3], [0, 4, 2]]
    >>> token_micro_batches([5, 9, 3], 0)
    [[0, 1, 2]]
    """
    if budget <= 0 or sum(lengths) and max(lengths) * len(lengths) <= budget:
        return [list(range(len(lengths)))] if lengths else []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(i)  # sorted longest first: the batch's first row is its longest
        else:
            batches.append([i])
    return batches


def group_micro_batches(groups: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """`token_micro_batches` within each group of consecutive rows (``groups``: their sizes), never
    across: a row's micro-batch then depends on its own group only, not on which groups a
    caller put beside it (batch invariance).

    >>> group_micro_batches([2, 3], [5, 9, 3, 9, 4], 18)
    [[0, 1], [3, 4], [2]]
    """
    batches, start = [], 0
    for size in groups:
        part = lengths[start : start + size]
        batches += [[start + i for i in batch] for batch in token_micro_batches(part, budget)]
        start += size
    return batches


def split_to_count(batches: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """``batches`` split until there are ``count`` of them (each rank of a sharded model must
    run as many forwards as the others): the one of largest padded size is halved each time;
    when every batch is a single sequence, empty batches stand for forwards that count nothing.

    >>> split_to_count([[0, 1, 2], [3]], [4, 4, 4, 9], 3)
    [[3], [0], [1, 2]]
    >>> split_to_count([[0]], [4], 2)
    [[0], []]
    """
    batches = [list(b) for b in batches]
    while len(batches) < count:
        splittable = [b for b in batches if len(b) > 1]
        if not splittable:
            batches.append([])
            continue
        largest = max(splittable, key=lambda b: max(lengths[i] for i in b) * len(b))
        batches.remove(largest)
        half = len(largest) // 2
        batches += [largest[:half], largest[half:]]
    return batches
