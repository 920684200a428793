"""`bench.base_tree`: the A/B benchmarks' checkout of an earlier commit exists while in use,
holds that commit, and is gone (worktree unregistered) afterwards."""

from __future__ import annotations

from bench.base_tree import base_tree, git


def test_base_tree_checks_out_the_commit_and_removes_it():
    parent = git("rev-parse", "HEAD~1")
    with base_tree("HEAD~1") as bt:
        assert bt.base_sha == parent and bt.head == git("rev-parse", "HEAD")
        assert (bt.path / "README.md").is_file()
        assert git("-C", str(bt.path), "rev-parse", "HEAD") == parent
        path = bt.path
    assert not path.exists()
    assert str(path) not in git("worktree", "list")
