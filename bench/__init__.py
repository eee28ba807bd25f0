"""outlast's benchmarks, each beside Ray Train 2.60 where Ray has a counterpart (docs/benchmarks.md).

Every module at this level is one benchmark, named for what it measures, and prints one JSON document.
Each runs as a module from the repository root, so that `bench` and `outlast` import from this checkout:

    .venv/bin/python -m bench.core --help

`bench.lib` holds what they share: the figures' arithmetic, the two virtual environments, the event
files their runs append to, and the scenarios, probes and training loops they run in processes of
their own (each a module too: `python -m bench.lib.core_scenario ...`).
"""
