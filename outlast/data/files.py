"""Where a read's files are: local paths or `s3://` URIs, expanded to the files under them.

S3 goes through fsspec's s3fs (it honours AWS_ENDPOINT_URL and the usual AWS settings), wrapped as a
pyarrow file system so that every format reads through one interface.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from outlast.data.errors import DataReadError


@dataclass(frozen=True)
class FileRef:
    """One file to read: the path within its file system, and the URI a user would recognise."""

    path: str
    uri: str
    scheme: str  # "local", "s3", or "s3-anonymous" (Ray's s3://anonymous@bucket/...: unsigned requests)

    def filesystem(self) -> Any:
        return filesystem_for(self.scheme)


def filesystem_for(scheme: str) -> Any:
    import pyarrow.fs as pafs

    if scheme == "local":
        return pafs.LocalFileSystem()
    import s3fs

    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    s3 = s3fs.S3FileSystem(anon=scheme == "s3-anonymous", client_kwargs={"endpoint_url": endpoint} if endpoint else {})
    return pafs.PyFileSystem(pafs.FSSpecHandler(s3))


def list_files(paths: str | list[str], extensions: tuple[str, ...] | None, read: str) -> list[FileRef]:
    """Every file under `paths` (a file, a directory, or a list of them), sorted, with one of `extensions`
    when given; a missing path or an empty directory is an error naming it."""
    import pyarrow.fs as pafs

    found: list[FileRef] = []
    for given in [paths] if isinstance(paths, (str, os.PathLike)) else list(paths):
        given = os.fspath(given)
        if given.startswith("s3://anonymous@"):
            scheme, path = "s3-anonymous", given[len("s3://anonymous@"):]
        elif given.startswith("s3://"):
            scheme, path = "s3", given[len("s3://"):]
        else:
            scheme, path = "local", os.path.abspath(given)
        fs = filesystem_for(scheme)
        try:
            info = fs.get_file_info(path)
        except OSError as e:  # the store could not be reached, or refused the request
            raise DataReadError(f"{read}({given!r}): could not reach it ({type(e).__name__}: {e}); check the "
                                "network, the credentials and, for an S3-compatible store, AWS_ENDPOINT_URL") from e
        if info.type == pafs.FileType.NotFound:
            raise DataReadError(f"{read}({given!r}): no such file or directory; check the path (and, for s3://, "
                                "the bucket and AWS_ENDPOINT_URL)")
        if info.type == pafs.FileType.File:
            infos = [info]
        else:
            infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                     if i.type == pafs.FileType.File and not i.base_name.startswith((".", "_"))]
            if extensions:
                infos = [i for i in infos if i.base_name.lower().endswith(extensions)]
            if not infos:
                raise DataReadError(f"{read}({given!r}): the directory holds no files"
                                    + (f" ending in {', '.join(extensions)}" if extensions else "")
                                    + "; point it at the data files")
        prefix = {"s3": "s3://", "s3-anonymous": "s3://anonymous@"}.get(scheme, "")
        found += [FileRef(i.path, prefix + i.path, scheme) for i in sorted(infos, key=lambda i: i.path)]
    return found
