"""Errors of resource isolation. Each names what is missing and the setting or command that fixes it."""

from __future__ import annotations


class IsolationError(RuntimeError):
    """Resource isolation cannot be set up or kept up on this node."""


class IsolationUnavailable(IsolationError):
    """Validation found problems before anything was written; `problems` lists every one of them."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"resource isolation cannot start; nothing was changed:\n{lines}")

    def __reduce__(self) -> tuple[type[IsolationUnavailable], tuple[list[str]]]:
        return (type(self), (self.problems,))


class BadSetting(IsolationError, ValueError):
    """A reservation or size given by the user that does not parse or does not fit the node."""
