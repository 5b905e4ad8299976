"""How the coordinator recovers a failed stage (docs/design.md §5, §7): the recovery modes and the restart limit."""

from __future__ import annotations

#: --recovery: `local` restarts only the failed stage (ZeroLock's stage-local recovery), `global` rolls every stage
#: back to the last window all committed and restarts them all (the baseline; --runtime torch's only one).
RECOVERY_MODES = ("local", "global")
#: Restarts of a failing stage (--runtime torch: of every rank) before a run gives up.
MAX_RESTARTS = 3
