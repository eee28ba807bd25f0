"""A deterministic simulator of outlast's control plane: the real controller core and preemption
logic, and on every node the agent's real supervisor, stepped on a virtual clock against simulated
workers, fork servers, agent processes and storage, with seeded faults.

`python -m outlast.sim --seeds N` runs N schedules; `--seed S` replays one with its trace.
"""
