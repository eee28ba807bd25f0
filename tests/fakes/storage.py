"""In-memory stand-ins for `outlast.storage.base.Storage`."""

from __future__ import annotations

from pathlib import Path

from outlast.protocol.messages import FileEntry


class MemoryStorage:
    """A Storage kept in a dict of path -> bytes; `ops` records every write and delete in order.

    Directories exist implicitly (any prefix of a file path) or explicitly via `make_dir`.
    """

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = set()
        self.ops: list[tuple[str, str]] = []  # ("write" | "delete" | "upload", path)

    def make_dir(self, path: str) -> None:
        self.dirs.add(path.strip("/"))

    def _all_dirs(self) -> set[str]:
        found = set(self.dirs)
        for path in self.files:
            parts = path.split("/")[:-1]
            found.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return found

    def upload_dir(self, local_dir: Path, dest: str, move: bool = False, replace: bool = True) -> list[FileEntry]:
        self.ops.append(("upload", dest))
        self.make_dir(dest)
        return []

    def write_atomic(self, path: str, data: bytes) -> None:
        self.ops.append(("write", path))
        self.files[path] = bytes(data)

    def read_bytes(self, path: str) -> bytes:
        try:
            return self.files[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    def read_head(self, path: str, n: int) -> bytes:
        return self.read_bytes(path)[:n]

    def size(self, path: str) -> int:
        try:
            return len(self.files[path])
        except KeyError:
            raise FileNotFoundError(path) from None

    def exists(self, path: str) -> bool:
        return path in self.files or path in self._all_dirs()

    def list_dirs(self, path: str) -> list[str]:
        prefix = path.strip("/") + "/" if path else ""
        names = {d[len(prefix):].split("/")[0] for d in self._all_dirs() if d.startswith(prefix)}
        return sorted(n for n in names if n)

    def delete(self, path: str) -> None:
        self.ops.append(("delete", path))
        self.files = {p: b for p, b in self.files.items() if p != path and not p.startswith(path + "/")}
        self.dirs = {d for d in self.dirs if d != path and not d.startswith(path + "/")}

    def local_path(self, path: str) -> Path:
        return Path("/memory") / path

    def uri(self, path: str) -> str:
        return f"memory://{path}"

    def writes(self) -> list[str]:
        return [path for op, path in self.ops if op == "write"]
