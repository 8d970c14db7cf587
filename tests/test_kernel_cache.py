"""Where the kernels' numba cache lives: never in a folder someone else could write (``kernels``).

    .venv/bin/python -m pytest -q tests/test_kernel_cache.py

numba unpickles a cache's index (``.nbi``) before any freshness check, so a cache folder another user can write is
code execution. The tests run as root, which may ``chown``: a "planted" folder is one owned by uid 65534 (nobody)
with mode 0777, made before the recipe looks, as an attacker on a shared machine would.
"""

from __future__ import annotations

import os
import stat

import pytest

from gtpo.algorithms import kernels
from gtpo.algorithms.kernels import cache_dir_for

NOBODY = 65534


def plant(folder):
    folder.mkdir(parents=True)
    os.chown(folder, NOBODY, -1)
    folder.chmod(0o777)
    return folder


def mode_and_owner(folder) -> tuple[int, int]:
    st = os.lstat(folder)
    return stat.S_IMODE(st.st_mode), st.st_uid


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(kernels, "_WARNED", set(), raising=False)


def test_a_private_folder_numba_would_pick_is_left_to_numba(tmp_path):
    here = tmp_path / "pkg" / "__pycache__"
    assert cache_dir_for([str(here), str(plant(tmp_path / "user"))], str(tmp_path / "fallback")) is None
    assert mode_and_owner(here) == (0o700, os.getuid())  # made here, private
    assert not (tmp_path / "fallback").exists()


def test_a_planted_folder_numba_would_pick_is_not_used(tmp_path):
    """The first writable candidate is the one numba takes: planted, the private fallback is used instead, made
    0700 (even when a later candidate is private: numba would not get there)."""
    fallback = tmp_path / "gtpo-numba-cache-0"
    got = cache_dir_for([str(plant(tmp_path / "pkg")), str(tmp_path / "user")], str(fallback))
    assert got == str(fallback) and mode_and_owner(fallback) == (0o700, os.getuid())
    # unwritable candidates (numba skips them) then a planted one
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert cache_dir_for([str(blocker / "sub"), str(plant(tmp_path / "user2"))], str(fallback)) == str(fallback)


def test_no_writable_candidate_gives_the_fallback_made_private(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    fallback = tmp_path / "tmp" / "gtpo-numba-cache-0"
    assert cache_dir_for([str(blocker / "pkg"), str(blocker / "user")], str(fallback)) == str(fallback)
    assert mode_and_owner(fallback) == (0o700, os.getuid())
    assert cache_dir_for([str(blocker / "pkg")], str(fallback)) == str(fallback)  # found again, private: reused


@pytest.mark.parametrize("how", ["another-owner", "group-writable", "symlink"])
def test_a_planted_fallback_is_not_used_a_fresh_folder_is(tmp_path, monkeypatch, how):
    """The predictable /tmp/gtpo-numba-cache-<uid> made in advance by someone else: a fresh mkdtemp folder, with a
    warning naming the planted one."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    fallback = tmp_path / "gtpo-numba-cache-0"
    if how == "another-owner":
        plant(fallback)
    elif how == "group-writable":
        fallback.mkdir()
        fallback.chmod(0o770)
    else:
        fallback.symlink_to(plant(tmp_path / "theirs"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.warns(RuntimeWarning, match=f"numba cache={fallback}: .*compiling into the fresh folder"):
        got = cache_dir_for([str(blocker / "pkg")], str(fallback))
    assert os.path.dirname(got) == str(tmp_path) and os.path.basename(got).startswith("gtpo-numba-cache-0-")
    assert mode_and_owner(got) == (0o700, os.getuid()) and os.listdir(got) == []


def test_the_process_is_pointed_at_the_private_folder_and_an_explicit_one_wins(tmp_path, monkeypatch):
    numba = pytest.importorskip("numba")
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)  # restored (unset) afterwards, whatever is set below
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "pkg" / "kernels.py"))
    plant(tmp_path / "pkg" / "__pycache__")  # the package folder's cache, writable by everyone
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    kernels._ensure_cache_dir()
    expected = str(tmp_path / f"gtpo-numba-cache-{os.getuid()}")
    assert os.environ["NUMBA_CACHE_DIR"] == numba.config.CACHE_DIR == expected
    assert mode_and_owner(expected) == (0o700, os.getuid())
    # the user's own choice is kept as it is, even a folder others could write
    theirs = str(plant(tmp_path / "chosen"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", theirs)
    kernels._ensure_cache_dir()
    assert os.environ["NUMBA_CACHE_DIR"] == theirs
