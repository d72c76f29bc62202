"""The studies beside the method: the paper's tables (each cell's commands, run once, printed beside the paper's
numbers, planned), Table 6's cost, task and function vectors, learning curves, the gate and delta-hyperbolicity
analyses, and the plan of a run (--plan). Imports every wing but cli."""
