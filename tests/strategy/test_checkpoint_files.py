"""The pieces of ``onebit_fsdp``'s whole-or-nothing, verified checkpoints, on one process (the 4-rank runs are in
``test_fsdp_checkpoints.py``): putting a finished folder in place over a folder, a file or a link (with the atomic
exchange and with the two renames used where the filesystem has none), what an interrupted save leaves and which
save removes it, the split of the files to verify between ranks, and the problems found in a folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lightning_onebit.strategy import checkpoint_files
from lightning_onebit.strategy.checkpoint_files import MANIFEST_NAME, FolderSave, folder_problems, put_in_place


def _folder(path: Path, **files: str) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


@pytest.fixture(params=["exchange", "two renames"])
def placing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "two renames":  # as on a filesystem without RENAME_EXCHANGE (NFS, macOS)
        monkeypatch.setattr(checkpoint_files, "_exchange", lambda a, b: False)
    return request.param


@pytest.mark.parametrize("before", ["folder", "file", "link", "nothing"])
def test_a_finished_folder_replaces_what_was_at_the_name(tmp_path: Path, placing: str, before: str) -> None:
    target = tmp_path / "last.ckpt"
    elsewhere = _folder(tmp_path / "epoch=3.ckpt", shard="kept")
    if before == "folder":
        _folder(target, shard="old", extra="old")
    elif before == "file":
        target.write_text("a one-file checkpoint")
    elif before == "link":
        target.symlink_to(elsewhere.name)
    new = _folder(tmp_path / "last.ckpt.onebit-partial-abc", shard="new")
    put_in_place(new, target)
    assert target.is_dir() and not target.is_symlink()
    assert sorted(os.listdir(target)) == ["shard"] and (target / "shard").read_text() == "new"
    # nothing else is left, and a link's target is another checkpoint: it stays
    assert sorted(os.listdir(tmp_path)) == ["epoch=3.ckpt", "last.ckpt"]
    assert (elsewhere / "shard").read_text() == "kept"


def test_the_next_save_removes_what_an_interrupted_one_left_once_the_name_holds_a_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    partial = _folder(tmp_path / "last.ckpt.onebit-partial-old", shard="interrupted")
    aside = _folder(tmp_path / "last.ckpt.onebit-previous-old", shard="set aside")
    other = _folder(tmp_path / "best.ckpt.onebit-partial-old", shard="another name's")
    # no checkpoint at the name: what was left may be the only copy of one (the two renames' window): kept
    FolderSave(target, "s1", 0, 1).begin(lambda folder: (folder / "sidecar").write_text("mine"))
    assert partial.is_dir() and aside.is_dir()
    assert (tmp_path / "last.ckpt.onebit-partial-s1" / "sidecar").read_text() == "mine"
    _folder(target, shard="a checkpoint")
    FolderSave(target, "s2", 0, 1).begin(lambda folder: None)
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt.onebit-partial-old", "last.ckpt", "last.ckpt.onebit-partial-s2"]
    assert other.is_dir()
    # only rank 0 removes (rank 1 leaves s2's folder), and never the folder of the save in progress (s3's, which the
    # other ranks may already be writing into)
    FolderSave(target, "s3", 1, 2).begin(lambda folder: None)
    assert (tmp_path / "last.ckpt.onebit-partial-s2").is_dir()
    FolderSave(target, "s3", 0, 2).begin(lambda folder: None)
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt.onebit-partial-old", "last.ckpt", "last.ckpt.onebit-partial-s3"]


def test_a_rank_that_cannot_write_its_files_fails_the_save_and_removes_the_partial_folder(tmp_path: Path) -> None:
    target = _folder(tmp_path / "last.ckpt", shard="previous")

    def fail(folder: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(RuntimeError, match=r"last.ckpt was not saved: rank 0 could not write its files \(OSError: "
                                           r"\[Errno 28\] No space left on device\)\. A checkpoint that was already"):
        FolderSave(target, "s1", 0, 1).begin(fail)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"] and (target / "shard").read_text() == "previous"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_every_file_is_verified_by_exactly_one_rank_and_the_bytes_are_balanced(world_size: int) -> None:
    sizes = {f"__{r}_0.distcp": 1000 + r for r in range(4)} | {".metadata": 50, "meta.pt": 20}
    shares = [checkpoint_files._share(list(sizes), sizes, rank, world_size) for rank in range(world_size)]
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values())


def _dcp_folder(path: Path, manifest: object) -> Path:
    folder = _folder(path, **{".metadata": "m", "meta.pt": "lightning"})
    if manifest is not None:
        (folder / MANIFEST_NAME).write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return folder


def test_what_a_folder_can_be_found_to_be(tmp_path: Path) -> None:
    digests = {name: checkpoint_files.file_digest(p) for name, p in
               (("x", _folder(tmp_path / "digests", x="m", y="lightning") / "x"),
                ("y", tmp_path / "digests" / "y"))}
    good = {"format": 1, "save_id": "s", "world_size": 1,
            "files": {".metadata": digests["x"], "meta.pt": digests["y"]}}
    assert folder_problems(_dcp_folder(tmp_path / "good", good), 0, 1, True).damaged == []
    assert folder_problems(tmp_path / "good", 0, 1, True).verified
    old = folder_problems(_dcp_folder(tmp_path / "old", None), 0, 1, True)
    assert (old.damaged, old.wrong_kind, old.verified) == ([], [], False)  # written before manifests: unverified
    assert "onebit-manifest.json cannot be read (JSONDecodeError" in folder_problems(
        _dcp_folder(tmp_path / "torn", '{"format": 1, "sa'), 0, 1, True).damaged[0]
    partial = dict(good, files={".metadata": digests["x"]})
    assert folder_problems(_dcp_folder(tmp_path / "partial", partial), 0, 1, True).damaged == [
        "the manifest lists no meta.pt: it is not that of a whole save"]
    # a name that holds nothing, after a save that died in the two renames' window: the user is told where it is
    _folder(tmp_path / "last.ckpt.onebit-partial-abc", shard="complete")
    (missing,) = folder_problems(tmp_path / "last.ckpt", 0, 1, True).wrong_kind
    assert f"there is no checkpoint at {tmp_path / 'last.ckpt'}" in missing
    assert "left last.ckpt.onebit-partial-abc next to it" in missing and "rename it to last.ckpt" in missing
    (not_dcp,) = folder_problems(_folder(tmp_path / "plain"), 0, 1, True).wrong_kind
    assert "is a folder but not a distributed checkpoint (it has no .metadata)" in not_dcp


def test_a_file_that_cannot_be_read_is_a_problem_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path / "ckpt", **{".metadata": "m", "meta.pt": "lightning"})
    manifest = {"format": 1, "save_id": "s", "world_size": 1,
                "files": {n: checkpoint_files.file_digest(folder / n) for n in (".metadata", "meta.pt")}}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))

    def denied(path: Path) -> dict:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint_files, "file_digest", denied)
    problems = folder_problems(folder, 0, 1, True).damaged
    assert sorted(problems) == [
        f"{name} cannot be read (PermissionError: [Errno 13] Permission denied: '{folder / name}')"
        for name in (".metadata", "meta.pt")
    ], problems
