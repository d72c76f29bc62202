"""The learnable methods by name: one record each (registry.py: its module, where it attaches, its default sizes,
its loss and what that needs of the teacher), and the baselines' own modules, plugs and losses (MimIC, LIVE, LoRA),
one file each, and HiFICL's ablations (hificl_ablations.py). Imports the paper's bottom four files and no wing."""
