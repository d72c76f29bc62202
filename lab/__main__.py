"""python -m lab <mode> [flags], from the project's root: lab's command line (lab/cli/commands.py)."""
import sys

from lab.cli import commands

try:
    commands.main()
except (ValueError, OSError, FloatingPointError) as e:  # bad input or a diverged run: the message, no traceback
    sys.exit(f"error: {e}")
except KeyboardInterrupt:  # Ctrl-C: every file is written whole or not at all (lab/disk/files.py)
    print("interrupted (Ctrl-C)", file=sys.stderr)
    raise SystemExit(130) from None
