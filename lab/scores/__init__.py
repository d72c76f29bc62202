"""Scores: the official metrics, CHAIR, result files and their names, VQAv2's test-server file. Imports disk,
datasets and run."""
