"""``python -m arlopti_jax.warm_start``: the start point's accuracy with its answers forced into
the answer block, on fresh puzzles that are none of its own (SFT, training or test)."""

import pyarrow.parquet as pq

from arlopti_jax.embedded.start_point import ANSWER_OPENING
from arlopti_jax.warm_start import held_out_rows, main


def test_held_out_puzzles_are_none_of_the_start_points(start_point):
    sets = held_out_rows(start_point, 16)
    assert sorted(sets) == [2, 3]
    own = {r["quiz"] for f in (start_point / "data").glob("*.parquet") for r in pq.read_table(f).to_pylist()}
    for n, rows in sets.items():
        assert rows and all(len(r["names"]) == n for r in rows)
        assert not {r["quiz"] for r in rows} & own
        assert len({r["quiz"] for r in rows}) == len(rows)


def test_prints_each_people_counts_accuracy(start_point, capsys):
    assert main([str(start_point), "--rows", "6"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    for n, line in zip((2, 3), lines):
        head, tail = line.split(" on ")
        assert head.startswith(f"{n} people: forced-block greedy accuracy ")
        assert 0.0 <= float(head.rsplit(" ", 1)[1]) <= 1.0
        assert tail.endswith(f"held-out puzzles (guessing {0.5 ** n:.3f})")
    assert ANSWER_OPENING.endswith("<answer>")
