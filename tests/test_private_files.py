"""Folders and files only this user can change (``gtpo.private_files``).

    .venv/bin/python -m pytest -q tests/test_private_files.py

"Another user" is uid 65534 (nobody): the tests that give it a folder need root, which may ``chown`` (skipped
otherwise). Each refusal must name the path and what is wrong with it.
"""

from __future__ import annotations

import os
import stat

import pytest

from gtpo.private_files import TOKEN_BYTES, check_private_dir, private_dir, ray_token_env, write_ray_token

NOBODY = 65534


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def chown(path, uid: int) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    os.chown(path, uid, -1)


def folder(path, perms: int, uid: int | None = None):
    path.mkdir(parents=True)
    if uid is not None:
        chown(path, uid)
    path.chmod(perms)
    return path


# ------------------------------------------------------------------------------------------- check_private_dir


@pytest.mark.parametrize("perms", [0o700, 0o755, 0o750, 0o1700])
def test_a_folder_of_this_users_that_nobody_else_may_write_passes(tmp_path, perms):
    path = folder(tmp_path / "mine", perms)
    assert check_private_dir(path, "CKPTS_DIR") == path
    assert check_private_dir(str(path), "CKPTS_DIR") == path  # a str too


ME = os.getuid()


@pytest.mark.parametrize(
    "perms,uid,message,fix",
    [
        (
            0o700,
            NOBODY,
            f"owned by uid {NOBODY}, not by this user (uid {os.getuid()}; mode 0700)",
            "use a folder of your own",
        ),
        (0o770, None, f"mode 0770 lets group or others write into it (uid {ME})", "chmod go-w {path}"),
        (0o720, None, f"mode 0720 lets group or others write into it (uid {ME})", "chmod go-w {path}"),
        (0o702, None, f"mode 0702 lets group or others write into it (uid {ME})", "chmod go-w {path}"),
        (
            0o1777,
            None,
            f"mode 1777 lets group or others write into it (uid {os.getuid()})",
            "chmod go-w {path}",
        ),  # sticky too
    ],
    ids=["another-owner", "group-writable", "group-write-only", "others-writable", "sticky-open"],
)
def test_a_folder_others_could_plant_files_in_is_refused(tmp_path, perms, uid, message, fix):
    """The message names the folder, owner and mode, and the fix that applies (one cannot chmod another's folder)."""
    path = folder(tmp_path / "theirs", perms, uid)
    with pytest.raises(PermissionError) as err:
        check_private_dir(path, "CKPTS_DIR")
    fix = fix.format(path=path)
    assert str(err.value) == f"CKPTS_DIR={path}: {message}; files planted there would be loaded as code: {fix}"


def test_a_symlink_is_refused_even_to_a_private_folder(tmp_path):
    real = folder(tmp_path / "real", 0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(PermissionError, match=f"CKPTS_DIR={link}: a symbolic link \\(to {real}\\); give the real"):
        check_private_dir(link, "CKPTS_DIR")


def test_a_missing_path_and_a_file_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"CKPTS_DIR={tmp_path / 'missing'}: does not exist"):
        check_private_dir(tmp_path / "missing", "CKPTS_DIR")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match=f"CKPTS_DIR={tmp_path / 'a-file'}: not a directory"):
        check_private_dir(tmp_path / "a-file", "CKPTS_DIR")


# ------------------------------------------------------------------------------------------------ private_dir


def test_private_dir_creates_0700_with_its_parents(tmp_path):
    old = os.umask(0o000)  # even under a umask that would let everyone write: the mode is asked for explicitly
    try:
        path = private_dir(tmp_path / "a" / "b" / "c", "numba cache")
    finally:
        os.umask(old)
    assert path == tmp_path / "a" / "b" / "c"
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    assert private_dir(path, "numba cache") == path  # existing and private: kept as it is


def test_private_dir_keeps_an_existing_parents_mode_and_refuses_a_planted_folder(tmp_path):
    shared = folder(tmp_path / "shared", 0o755)
    assert private_dir(shared / "mine", "x") == shared / "mine" and mode(shared) == 0o755
    planted = folder(tmp_path / "planted", 0o777, NOBODY)
    with pytest.raises(PermissionError, match=f"numba cache={planted}: owned by uid {NOBODY}"):
        private_dir(planted, "numba cache")
    assert mode(planted) == 0o777 and os.lstat(planted).st_uid == NOBODY  # refused, not "fixed"


# -------------------------------------------------------------------------------------- the Ray token file


def test_write_ray_token_makes_a_private_random_token_and_never_overwrites(tmp_path):
    old = os.umask(0o000)
    try:
        path = write_ray_token(tmp_path / "ray-auth")
    finally:
        os.umask(old)
    assert path == tmp_path / "ray-auth" / "token"
    assert (mode(path.parent), mode(path)) == (0o700, 0o600)
    token = path.read_text()
    assert len(token) == 2 * TOKEN_BYTES and int(token, 16) >= 0
    assert write_ray_token(tmp_path / "ray-auth", "other").read_text() != token  # random each time
    with pytest.raises(FileExistsError):
        write_ray_token(tmp_path / "ray-auth")
    assert path.read_text() == token


def test_write_ray_token_refuses_a_planted_folder(tmp_path):
    planted = folder(tmp_path / "ray-auth", 0o777, NOBODY)
    with pytest.raises(PermissionError, match=f"the Ray token folder={planted}: owned by uid {NOBODY}"):
        write_ray_token(planted)
    assert os.listdir(planted) == []


def test_ray_token_env_names_a_private_token_file(tmp_path):
    path = write_ray_token(tmp_path / "ray-auth")
    assert ray_token_env(path) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    assert ray_token_env(str(path))["RAY_AUTH_TOKEN_PATH"] == str(path)


@pytest.mark.parametrize(
    "perms,uid,shown",
    [
        (0o644, None, f"owned by uid {os.getuid()}, mode 0644"),
        (0o640, None, "mode 0640"),
        (0o600, NOBODY, f"uid {NOBODY}"),
    ],
    ids=["world-readable", "group-readable", "another-owner"],
)
def test_ray_token_env_refuses_a_token_others_could_read_or_own(tmp_path, perms, uid, shown):
    path = write_ray_token(tmp_path / "ray-auth")
    path.chmod(perms)
    if uid is not None:
        chown(path, uid)
    with pytest.raises(PermissionError, match=f"RAY_AUTH_TOKEN_PATH={path}: .*{shown}.*chmod 600"):
        ray_token_env(path)


def test_ray_token_env_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-token"):
        ray_token_env(tmp_path / "no-token")
