"""A deterministic simulator of outlast's control plane: the real controller core and preemption
logic, stepped on a virtual clock against simulated workers, nodes and storage, with seeded faults.

`python -m outlast.sim --seeds N` runs N schedules; `--seed S` replays one with its trace.
"""

# The controller imports the training API's errors, whose package imports the controller:
# loading the training API first resolves that cycle until the errors move down a layer.
import outlast.train  # noqa: E402,F401
