"""The studies beside the method: Table 6's cost, task and function vectors, learning curves, the gate and
delta-hyperbolicity analyses, and the plan of a run (--plan). Imports every wing but cli."""
