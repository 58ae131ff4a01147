"""A benchmark record names the commit of the code that ran, whatever directory it ran from."""

from __future__ import annotations

import os
import subprocess

from fsdp_offload import results


def test_the_commit_is_the_packages_checkout_not_the_working_directorys(tmp_path, monkeypatch):
    monkeypatch.delenv("FSDP_OFFLOAD_COMMIT", raising=False)
    other = tmp_path / "other-repo"
    other.mkdir()
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=other, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "other"], cwd=other, check=True)
    other_head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=other, capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.chdir(other)
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))  # a caller's git environment names the other one too
    commit = results.git_commit()
    assert other_head not in commit
    monkeypatch.delenv("GIT_DIR")

    def ours(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=results.CHECKOUT, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    at_top = os.path.realpath(ours("rev-parse", "--show-toplevel") or "/nonexistent") == os.path.realpath(results.CHECKOUT)
    assert commit.startswith(ours("rev-parse", "HEAD")) if at_top else commit == "unknown"


def test_the_environment_names_the_commit_of_a_copy_without_git(monkeypatch):
    monkeypatch.setenv("FSDP_OFFLOAD_COMMIT", "abc1234")
    assert results.git_commit() == "abc1234"
