"""What the benchmarks share, and what they run in processes of their own.

Nothing is imported here: a module of this package runs in Ray's virtual environment as well as in
outlast's, so each imports only what it needs.
"""
