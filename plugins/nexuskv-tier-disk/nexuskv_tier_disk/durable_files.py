"""Durable, private files: a payload written whole or not at all (fsync, then rename); owner-only directories."""

from __future__ import annotations

import contextlib
import os
import stat


def write_file(path: str, chunks: list[bytes | memoryview], fsync: bool) -> None:
    """Create `path` with `chunks` written in order, fsynced when asked; removes it again on any failure."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        try:
            views = [memoryview(c).cast("B") for c in chunks]
            while views:
                n = os.writev(fd, views)
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


FILE_MODE = 0o600  # KV state is user data: only the owner reads it


DIR_MODE = 0o700


def private_dirs(path: str) -> None:
    """Create `path` and any missing parents as 0700 directories (whatever the umask); existing ones are kept."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(d, DIR_MODE)
            os.chmod(d, DIR_MODE)  # mkdir's mode is masked by the umask


def refuse_unsafe_dir(path: str) -> str:
    """Why `path` must not hold a tier's files ("" when it may).

    Not a directory, a symlink, another user's, or writable by group or others: anyone who can write there could
    swap files in, or delete them.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink (point the tier at the real directory)"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}; chmod 700 it)"
    return ""


def fsync_dir(dir_fd: int) -> None:
    """Make renames and unlinks in a directory durable."""
    os.fsync(dir_fd)
