"""Which rows shard I of N runs: whole row groups, from the input's footers alone.

The row groups of every input file, in input order, are cut into N contiguous runs holding about
total/N rows each: a row group belongs to the shard whose equal share of the rows holds the
group's middle row (groups without rows belong to none). So a shard's rows are one range of
row_index, it reads only its own row groups (about 1/N of the bytes, front to back), it holds
total/N rows give or take the largest row group, and every process that reads the same footers
finds the same assignment. With more shards than row groups, some shards get no rows.
"""

from __future__ import annotations

from batchrun.io.input.reader import InputSource

Shard = tuple[int, int]  # (I, N) of --shard I/N


def group_shard(start: int, rows: int, total: int, count: int) -> int:
    """The shard of a row group of rows >= 1 rows from row_index start: the share of the rows
    [I * total / N, (I + 1) * total / N) holding its middle row, start + (rows - 1) / 2."""
    return (2 * start + rows - 1) * count // (2 * total)


def shard_rows(source: InputSource, shard: Shard | None) -> range:
    """The row_index range of shard (I, N) (None: every row); empty for a shard without rows."""
    total = source.total_rows
    if shard is None:
        return range(total)
    index, count = shard
    first = last = None  # the rows of the shard's first and last row groups
    for file in source.files:
        start = file.first_row
        for rows in file.row_group_rows:
            if rows and group_shard(start, rows, total, count) == index:
                first = start if first is None else first
                last = start + rows
            start += rows
    if first is None or last is None:
        return range(0)
    return range(first, last)
