"""Folders and files only this user can change, and the Ray token kept in one (stdlib only; imports nothing of gtpo).

Several things the recipe loads are code, whatever their names say: numba unpickles its cache index before any
freshness check, verl loads checkpoints with ``torch.load(weights_only=False)``, and a Ray node's session folder
holds its sockets. A folder someone else owns, or one that group or others may write, lets them plant such a file.
Every such folder goes through :func:`check_private_dir` (refuse) or :func:`private_dir` (create 0700, or refuse).
A checkpoint goes through :func:`check_private_tree` right before it is loaded, in the process that loads it: every
folder and file in it real (no symlink), this user's and writable by nobody else (a file ACL that lets another user
write shows in the group bits), and no folder above it writable by everyone without the sticky bit (anyone could
rename it and put another in its place between the check and the load).

Ray's token authentication (``RAY_AUTH_MODE=token``) reads the token from ``RAY_AUTH_TOKEN``, then from the file
``RAY_AUTH_TOKEN_PATH`` names, then from ``~/.ray/auth_token``. The recipe always passes a *path* (a value in the
environment would be printed by a ``set -x`` trace and shows in ``/proc/<pid>/environ`` of every worker's parent):
:func:`write_ray_token` makes a fresh random token in a private folder, :func:`ray_token_env` gives the two
variables every process of the cluster needs. Ray does not check the token file's permissions; this module does.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

__all__ = [
    "check_private_dir", "check_private_file", "check_private_tree", "check_unswappable_parents", "looks_secret",
    "private_dir", "ray_token_env", "token_file_problem", "write_ray_token", "TOKEN_BYTES",
]  # fmt: skip

# Ray's own generator makes 32 random bytes as hex too (ray/_private/authentication/authentication_token_generator.py).
TOKEN_BYTES = 32
# Names of environment variables that hold credentials, or paths to them (RAY_AUTH_TOKEN_PATH), in any case.
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def looks_secret(name: str) -> bool:
    """Whether the environment variable ``name`` looks like a credential (``WANDB_API_KEY``, ``HF_TOKEN``, ...): the
    grader's workers never inherit one, and a job's runtime env warns about one."""
    return _SECRET_NAME.search(name) is not None


def _refuse_unless_private(st: os.stat_result, path: Path, what: str, kind: str, consequence: str) -> None:
    """Raise PermissionError (what is wrong; ``consequence``; the fix) unless ``st`` is owned by this user and neither
    group nor others may write the folder or file (``kind``) at ``path``."""
    if st.st_uid != os.getuid():
        problem = f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()}; mode {stat.S_IMODE(st.st_mode):04o})"
        fix = f"use a {kind} of your own"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        into = "into it" if kind == "folder" else "it"
        problem = f"mode {stat.S_IMODE(st.st_mode):04o} lets group or others write {into} (uid {st.st_uid})"
        fix = f"chmod go-w {path}"
    else:
        return
    raise PermissionError(f"{what}={path}: {problem}; {consequence}: {fix}")


def check_private_dir(path: str | os.PathLike, what: str) -> Path:
    """Refuse ``path`` unless it is a real directory (no symlink) owned by this user that neither group nor others
    may write; ``what`` names it in the error (e.g. ``"CKPTS_DIR"``). Returns the path."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}={path}: does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"{what}={path}: a symbolic link (to {os.readlink(path)}); give the real folder")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{what}={path}: not a directory")
    _refuse_unless_private(st, path, what, "folder", "files planted there would be loaded as code")
    return path


def check_private_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse ``path`` unless it is a regular file (no symlink) owned by this user that neither group nor others may
    write (an ACL granting another user write shows as group write); ``what`` names it in the error."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}={path}: does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(
            f"{what}={path}: a symbolic link (to {os.readlink(path)}); whoever may write its target could plant code "
            "there: copy the file itself"
        )
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(f"{what}={path}: not a regular file (mode {stat.filemode(st.st_mode)})")
    _refuse_unless_private(st, path, what, "file", "a file others may write would be loaded as code")
    return path


def check_unswappable_parents(path: str | os.PathLike, what: str) -> None:
    """Refuse ``path`` when a folder above it (as written, and as resolved) is writable by everyone without the sticky
    bit: anyone could rename ``path`` away and put their own in its place after it was checked."""
    absolute = Path(os.path.abspath(path))
    for parent in dict.fromkeys([*absolute.parents, *Path(os.path.realpath(absolute)).parents]):
        try:
            st = os.stat(parent)
        except OSError:
            continue  # not there (yet): nothing in it to swap
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise PermissionError(
                f"{what}={path}: the folder above it, {parent}, is writable by everyone without the sticky bit (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): anyone could put another folder in its place after this check; "
                f"chmod +t {parent} (or o-w), or move it under a folder of your own"
            )


def check_private_tree(folder: str | os.PathLike, what: str, kind: str = "checkpoint") -> int:
    """Refuse the folder ``folder`` unless it and every folder and file in it pass :func:`check_private_dir` /
    :func:`check_private_file` and no folder above it could be swapped (:func:`check_unswappable_parents`). For a
    checkpoint, right before it is loaded; ``what`` names the folder, ``kind`` what is in it ("a file of the
    checkpoint"). Returns the number of files checked."""
    check_unswappable_parents(folder, what)
    check_private_dir(folder, what)

    def unreadable(err: OSError) -> None:
        raise PermissionError(f"{what}={folder}: cannot list {err.filename} ({err.strerror})")

    files = 0
    for top, dirs, names in os.walk(folder, onerror=unreadable):
        for name in dirs:  # a symlinked folder is listed here and refused, never entered
            check_private_dir(os.path.join(top, name), f"a folder of the {kind}")
        for name in names:
            check_private_file(os.path.join(top, name), f"a file of the {kind}")
        files += len(names)
    return files


def private_dir(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a folder only this user can write: created with mode 0700 if missing (parents 0700 too when they
    are created here), else checked by :func:`check_private_dir`."""
    path = Path(path)
    if not os.path.lexists(path):
        missing = []
        parent = path
        while not os.path.lexists(parent):
            missing.append(parent)
            parent = parent.parent
        for folder in reversed(missing):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass  # made at the same moment by another process: checked below like any existing folder
    return check_private_dir(path, what)


def write_ray_token(folder: str | os.PathLike, name: str = "token") -> Path:
    """A fresh random token (``TOKEN_BYTES`` bytes, hex) in ``folder/name``: the folder private (0700, see
    :func:`private_dir`), the file created 0600 and never over an existing one. Returns the file's path."""
    folder = private_dir(folder, "the Ray token folder")
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(TOKEN_BYTES))
    return path


def token_file_problem(token_path: str | os.PathLike) -> str | None:
    """What is wrong with ``token_path`` as a Ray token file (``RAY_AUTH_TOKEN_PATH=<path>: ...``), or None: it must
    be a regular file (a Kubernetes Secret's symlink to one is followed), this user's, readable by nobody else."""
    try:
        st = os.stat(token_path)
    except OSError as err:
        return f"RAY_AUTH_TOKEN_PATH={token_path}: no readable token file here ({err.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"RAY_AUTH_TOKEN_PATH={token_path}: not a file (mode {stat.filemode(st.st_mode)})"
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        return (
            f"RAY_AUTH_TOKEN_PATH={token_path}: owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}; "
            "a token file must be this user's and readable by nobody else (chmod 600)"
        )
    return None


def ray_token_env(token_path: str | os.PathLike) -> dict[str, str]:
    """The variables every process of a token-authenticated Ray cluster needs (head, nodes, drivers, clients):
    ``RAY_AUTH_MODE=token`` and the token's path, after checking the file is this user's and private."""
    token_path = Path(token_path)
    os.stat(token_path)  # a missing file: FileNotFoundError, naming it
    problem = token_file_problem(token_path)
    if problem:
        raise PermissionError(problem)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
