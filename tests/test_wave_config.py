"""benchmarks/wave_config_h200.py's reading of its rows (the GPU part runs on the lent card)."""

from __future__ import annotations

from benchmarks.wave_config_h200 import crossover, wave_tables


def test_a_waves_table_names_its_first_n_experts():
    assert wave_tables([3, 0, 5, 1, 2, 4, 6, 7], 3, 8).tolist() == [8, -1, -1, 11, -1, 13, -1, -1]
    assert wave_tables(list(range(8)), 8, 0).tolist() == list(range(8))


def test_the_switch_is_the_last_n_of_an_unbroken_run_of_wins():
    us = {1: (38.5, 58.3), 2: (60.0, 70.0), 3: (90.0, 89.0), 4: (110.0, 120.0)}
    rows = [{"M": 8, "n": n, "config": c, "us": u} for n, (f, o) in us.items() for c, u in (("few", f), ("own", o))]
    rows.append({"M": 16, "n": 1, "config": "few", "us": 50.0})
    rows.append({"M": 16, "n": 1, "config": "own", "us": 40.0})
    assert crossover(rows, 8, "few", "own") == 2          # n = 3 lost: n = 4's win does not count
    assert crossover(rows, 16, "few", "own") == 0
    assert crossover(rows, 4, "few", "own") == 0          # no rows
