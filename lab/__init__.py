"""The harness beside the paper's six files: one concept per file (command lines, runs, caches, the plan, readers,
metrics, the toy world, the studies). It imports data, lorentz, adapters and model, never train or evaluate."""
