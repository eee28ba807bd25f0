"""The commit as a sub-machine of the controller's core: from a checkpoint the reports settled to its
manifest, its copies in the nodes' memory, and a notice's checkpoint's upload from a peer's memory.

`Commits.step(event, view, now)` (`machine.py`) is its one entry point: it takes an event (`events.py`),
a frozen view of what it needs of the core (`view.py`) and the time, and returns effects and typed
outcomes, which only the core applies (`controller/commit_steps.py`). It never imports the core.
"""

from outlast.controller.commits.machine import Commits
from outlast.controller.commits.view import MEMORY, STORAGE, NodeFacts, View

__all__ = ["MEMORY", "STORAGE", "Commits", "NodeFacts", "View"]
