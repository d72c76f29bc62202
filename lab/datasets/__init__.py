"""The tasks and their data: the benchmarks' original files and the hub's parquet copies, a task of one's own, MME and
SEED-Bench, the toy world, RICES's choice of demonstrations, the checks of what evaluate.predict is given. Imports
data.py and disk."""
