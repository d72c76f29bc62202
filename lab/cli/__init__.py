"""The ways in: train.py's and evaluate.py's flags and their checks, and lmms-eval's model `hyper_icl`. Imports every
wing."""
