"""The ways in: train.py's and evaluate.py's flags and their checks, their other modes (modes.py, train_cli.py), and
lmms-eval's model `hyper_icl`. Imports every wing."""
