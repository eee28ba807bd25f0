"""Look for bytes in a whole address space (every readable mapping in /proc/PID/maps, read through
/proc/PID/mem), and the train function that does it from inside a rank.

A needle is never held as itself, which would put it in the memory being searched: it is given
with every byte shifted by one, and each chunk of memory is shifted the same way before the search.
A shifted copy of memory holds a shifted needle only where memory held the needle itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from outlast.protocol.run_credential import CREDENTIAL_ENV

SHIFT = bytes((b + 1) % 256 for b in range(256))
CHUNK = 8 << 20


def shifted(needle: bytes) -> str:
    return needle.translate(SHIFT).hex()


def regions(pid: int | str) -> list[tuple[int, int, str]]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if fields[1].startswith("r"):
            out.append((start, end, fields[5] if len(fields) > 5 else ""))
    return out


def scan(pid: int | str, needles: dict[str, str]) -> tuple[dict[str, list[str]], int]:
    """For each needle (as `shifted` gives it), the mappings of `pid` that hold it; and how many bytes were read."""
    wanted = {name: bytes.fromhex(h) for name, h in needles.items()}
    overlap = max(len(w) for w in wanted.values()) - 1
    found: dict[str, list[str]] = {name: [] for name in wanted}
    read = 0
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for start, end, name in regions(pid):
            at, tail = start, b""
            while at < end:
                try:
                    mem.seek(at)
                    chunk = mem.read(min(CHUNK, end - at))
                except (OSError, ValueError, OverflowError):
                    break  # [vvar], a guard page, a mapping gone since maps was read
                if not chunk:
                    break
                read += len(chunk)
                window = (tail + chunk).translate(SHIFT)
                for needle_name, needle in wanted.items():
                    if needle in window and f"{start:x} {name}" not in found[needle_name]:
                        found[needle_name].append(f"{start:x} {name}")
                tail = chunk[-overlap:] if overlap else b""
                at += len(chunk)
                del window, chunk
    return found, read


def scan_own_memory(config: dict) -> None:
    """In a rank: scan this process for config["needles"], and for its own run's credential (which
    must be found: the scan sees what the process holds)."""
    own = os.environ[CREDENTIAL_ENV].split(" ", 1)[1].encode()
    needles = {**config["needles"], "own credential": shifted(own)}
    del own
    found, read = scan("self", needles)
    Path(config["out"]).write_text(json.dumps({"pid": os.getpid(), "found": found, "read": read}))
