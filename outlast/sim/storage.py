"""Storage for the simulator: a dict of path -> bytes with seeded faults.

Slowness is time the caller spends: every operation adds `latency_s` to `spent`, and the
simulated process that called it stays busy that long. Failing windows raise OSError;
a bucket without delete permission raises PermissionError on every delete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable


class SimStorage:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.files: dict[str, bytes] = {}
        self.latency_s = 0.0
        self.failing: list[tuple[float, float]] = []  # [start, end) windows where every operation fails
        self.refuse_deletes = False
        self.spent = 0.0

    def _op(self, what: str, path: str) -> None:
        self.spent += self.latency_s
        now = self.clock()
        if any(a <= now < b for a, b in self.failing):
            raise OSError(f"simulated storage failure: {what} {path}")

    def take_spent(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent

    def write_atomic(self, path: str, data: bytes) -> None:
        self._op("write", path)
        self.files[path] = bytes(data)

    def read_bytes(self, path: str) -> bytes:
        self._op("read", path)
        try:
            return self.files[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    def exists(self, path: str) -> bool:
        self._op("exists", path)
        return path in self.files or any(p.startswith(path.rstrip("/") + "/") for p in self.files)

    def list_dirs(self, path: str) -> list[str]:
        self._op("list", path)
        prefix = path.strip("/") + "/"
        return sorted({p[len(prefix):].split("/")[0] for p in self.files
                       if p.startswith(prefix) and "/" in p[len(prefix):]})

    def delete(self, path: str) -> None:
        self._op("delete", path)
        if self.refuse_deletes:
            raise PermissionError(f"simulated AccessDenied: delete {path}")
        self.files = {p: b for p, b in self.files.items() if p != path and not p.startswith(path + "/")}

    def upload_dir(self, local_dir: Path, dest: str) -> list:
        raise NotImplementedError("simulated workers write their files with write_atomic")

    def local_path(self, path: str) -> Path | None:
        return None

    def uri(self, path: str) -> str:
        return f"sim://{path}"
