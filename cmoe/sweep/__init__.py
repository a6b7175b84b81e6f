"""`cmoe sweep`: many simulations, each a point of settings, on local processes or a Ray cluster,
streamed into one resumable Parquet table. `points` makes and reads points, `table` keeps the
table, `run` runs them."""

from cmoe.sweep.points import SETTINGS, grid, normalise, point_id, points_file, read_points
from cmoe.sweep.run import SweepStats, run_point, sweep

__all__ = ["SETTINGS", "SweepStats", "grid", "normalise", "point_id", "points_file", "read_points", "run_point", "sweep"]
