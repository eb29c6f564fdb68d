"""What the generated tasks' commands share (``tasks.arith``, ``tasks.calc``, ``tasks.kk``): parquet
files in a fixed schema, and the train/test split's flags.

    write_parquet(rows, out, schema) -> out        # the folder made; rows as the schema types them
    add_split_arguments(parser); check_split_arguments(parser, args)
    write_splits(train, test, out, schema)         # OUT/train.parquet, OUT/test.parquet, one line said
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(rows: Sequence[dict], out: str | Path, schema: pa.Schema) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows), schema=schema), out)
    return out


def add_split_arguments(parser: argparse.ArgumentParser, held_out: str) -> None:
    """--out, --train-count, --test-count, --test-share (``held_out``: what the share counts), --seed."""
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train-count", type=int, default=2000)
    parser.add_argument("--test-count", type=int, default=128)
    parser.add_argument("--test-share", type=float, default=0.25, help=f"share of {held_out} held out for test")
    parser.add_argument("--seed", type=int, default=0)


def check_split_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.train_count < 1 or args.test_count < 1:
        parser.error("--train-count and --test-count must be positive")
    if not 0 < args.test_share < 1:
        parser.error("--test-share must be in (0, 1)")


def write_splits(train: Sequence[dict], test: Sequence[dict], out: str | Path, schema: pa.Schema) -> None:
    out = Path(out)
    write_parquet(train, out / "train.parquet", schema)
    write_parquet(test, out / "test.parquet", schema)
    print(f"wrote {len(train)} training and {len(test)} test problems to {out}/", file=sys.stderr)
