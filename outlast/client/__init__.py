"""How drivers, the executor, the CLI and tests reach a node agent: find it, start it, ask it.

Below every layer that talks to a node and above the protocol: it imports no agent code.
"""
