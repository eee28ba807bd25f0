"""What a path or a name in a message may be: checked when the message is decoded, on every socket.

A message's path is joined to a directory by whoever receives it (a tier server writing a rank's files,
a data socket reading a copy's, an agent naming a rank's output file). Every such field is checked here, by
the `__post_init__` of the struct that carries it, which msgspec runs as it decodes: a message with a path
that could leave its directory never reaches the code that joins it, and the sender is told why
(`msgspec.ValidationError`, with the field's place in the message).

- A relative path (`relative_problem`): '/'-separated components under a root, each a real name: not
  absolute, no '.', '..' or empty component, no NUL, at most `MAX_PATH_BYTES` bytes and `MAX_DEPTH`
  components. Its text alone cannot say where a link under the root leads: `outlast/storage/safepath.py`
  opens it without following one.
- A name (`name_problem`): one path component (a checkpoint's directory, a run id in a file name).
- An absolute path on a node (`absolute_problem`): normalised, such as the directory a rank's files lie in.
"""

from __future__ import annotations

MAX_PATH_BYTES = 4096  # PATH_MAX on Linux
MAX_NAME_BYTES = 255  # a path component on ext4, xfs, tmpfs
MAX_DEPTH = 64  # directories a checkpoint's file lies under, and the file


def name_problem(name: str) -> str | None:
    """Why `name` cannot be one path component, or None when it can."""
    if not name:
        return "it is empty"
    if "/" in name:
        return "it holds a '/'"
    if name in (".", ".."):
        return f"{name!r} names a directory, not an entry in it"
    if "\0" in name:
        return "it holds a NUL byte"
    if len(name.encode(errors="surrogatepass")) > MAX_NAME_BYTES:
        return f"it is longer than {MAX_NAME_BYTES} bytes"
    return None


def relative_problem(path: str) -> str | None:
    """Why `path` cannot be a file's place under a root, or None when it can."""
    if not path:
        return "it is empty"
    if path.startswith("/"):
        return "it is absolute"
    if len(path.encode(errors="surrogatepass")) > MAX_PATH_BYTES:
        return f"it is longer than {MAX_PATH_BYTES} bytes"
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        return f"it is {len(parts)} components deep, more than {MAX_DEPTH}"
    for part in parts:
        if not part:
            return "it has an empty component ('//' or a trailing '/')"
        why = name_problem(part)
        if why is not None:
            return f"its component {part!r}: {why}"
    return None


def absolute_problem(path: str) -> str | None:
    """Why `path` cannot be a place on a node (absolute, normalised), or None when it can."""
    if not path.startswith("/"):
        return "it is not absolute"
    if path == "/":
        return None
    why = relative_problem(path[1:])
    return None if why is None else why.replace("it is absolute", "it starts with '//'")


def check_relative(what: str, path: str, empty_ok: bool = False) -> None:
    """Raise ValueError (a `ValidationError` at decode) when `path` may not be joined under a root."""
    if empty_ok and path == "":
        return
    why = relative_problem(path)
    if why is not None:
        raise ValueError(f"{what} {path!r} is not a relative path inside its directory: {why}")


def check_name(what: str, name: str | None, empty_ok: bool = False) -> None:
    """Raise ValueError when `name` may not be one path component (None, and "" with `empty_ok`, pass)."""
    if name is None or (empty_ok and name == ""):
        return
    why = name_problem(name)
    if why is not None:
        raise ValueError(f"{what} {name!r} cannot be one name in a directory: {why}")


def check_absolute(what: str, path: str, empty_ok: bool = False) -> None:
    """Raise ValueError when `path` is not absolute and normalised ("" passes with `empty_ok`)."""
    if empty_ok and path == "":
        return
    why = absolute_problem(path)
    if why is not None:
        raise ValueError(f"{what} {path!r} is not an absolute, normalised path: {why}")
