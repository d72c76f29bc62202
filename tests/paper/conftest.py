"""tests/paper's setting: torch on one CPU thread. The tiny twins' forwards are a few milliseconds; a second thread
only adds synchronisation, and on a busy machine its waits cost more CPU time than the work (docs/efficiency.md,
"Threads on a CPU"; backbones.choose_threads gives a run of a tiny backbone one thread for the same reason)."""
import torch

torch.set_num_threads(1)
