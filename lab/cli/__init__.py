"""The ways in: train.py's and evaluate.py's flags and their checks (flags.py, train_cli.py, eval_cli.py, the harness's
settings in harness.py), python -m lab's modes (commands.py, modes.py, the studies' flag checks in study_flags.py), and
lmms-eval's model `hyper_icl`. Imports every wing; commands.py and modes.py also the two scripts."""
