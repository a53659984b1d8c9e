"""orchestrator/runtime/outputs.py: output paths checked before work, folders replaced whole.

Real file systems only (a temp folder, fsspec's memory://); a full disk is exercised
for real in tests/integration/test_cli.py (a private tmpfs).
"""

from __future__ import annotations

import os
import stat

import fsspec
import pytest
from mxload.orchestrator.errors import OutputError
from mxload.orchestrator.runtime.outputs import (
    OutputDir,
    check_disjoint,
    check_file_target,
    write_file_atomic,
)


def tree(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_new_folder_appears_only_when_complete(tmp_path) -> None:
    target = tmp_path / "out"
    out = OutputDir(str(target), "--dump")
    out.check()
    with out:
        assert out.path is not None and os.path.dirname(out.path) == str(tmp_path)
        assert stat.S_IMODE(os.stat(out.path).st_mode) == 0o700  # private while written
        open(os.path.join(out.path, "a"), "wb").write(b"1")
        assert not target.exists(), "the target must not exist before commit"
    assert tree(target) == {"a": b"1"}
    assert os.listdir(tmp_path) == ["out"]
    assert stat.S_IMODE(os.stat(target).st_mode) & 0o700 == 0o700


def test_an_empty_existing_folder_is_used(tmp_path) -> None:
    (tmp_path / "out").mkdir()
    with OutputDir(str(tmp_path / "out"), "DST") as out:
        open(os.path.join(out.path, "x"), "wb").write(b"2")
    assert tree(tmp_path / "out") == {"x": b"2"}


def test_non_empty_folder_refused_without_overwrite_and_replaced_whole_with_it(tmp_path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    for i in range(4):
        (target / f"rank-{i:05d}.safetensors").write_bytes(b"old")
    with pytest.raises(OutputError, match="--overwrite") as err:
        OutputDir(str(target), "--dump").check()
    assert err.value.exit_code == 2 and err.value.key == "--dump"
    out = OutputDir(str(target), "--dump", overwrite=True)
    out.check()
    with out:
        open(os.path.join(out.path, "rank-00000.safetensors"), "wb").write(b"new")
    assert tree(target) == {"rank-00000.safetensors": b"new"}
    assert os.listdir(tmp_path) == ["out"], "no old or temporary folder left beside it"


def test_failure_inside_leaves_the_old_folder_byte_for_byte(tmp_path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"earlier good conversion")
    before = tree(target)
    with pytest.raises(RuntimeError, match="part-way"):
        with OutputDir(str(target), "DST", overwrite=True) as out:
            open(os.path.join(out.path, "model.safetensors"), "wb").write(b"half")
            raise RuntimeError("failed part-way")
    assert tree(target) == before
    assert os.listdir(tmp_path) == ["out"]


def test_disk_errors_become_output_errors_naming_the_path(tmp_path) -> None:
    target = tmp_path / "out"
    with pytest.raises(OutputError) as err:
        with OutputDir(str(target), "DST"):
            raise OSError(28, "No space left on device")
    assert str(target) in str(err.value) and "no space left" in str(err.value)
    assert err.value.exit_code == 2
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("make", ["file", "missing-parent", "parent-is-file"])
def test_unusable_folder_targets_are_refused_before_work(tmp_path, make) -> None:
    if make == "file":
        (tmp_path / "out").write_bytes(b"x")
        target, why = tmp_path / "out", "not a folder"
    elif make == "missing-parent":
        target, why = tmp_path / "nodir" / "out", "does not exist"
    else:
        (tmp_path / "f").write_bytes(b"x")
        target, why = tmp_path / "f" / "out", "not a folder"
    with pytest.raises(OutputError, match=why):
        OutputDir(str(target), "DST", overwrite=True).check()


def test_file_targets(tmp_path) -> None:
    with pytest.raises(OutputError, match="is a folder"):
        check_file_target(str(tmp_path), "--report")
    with pytest.raises(OutputError, match="does not exist"):
        check_file_target(str(tmp_path / "nodir" / "r.json"), "--report")
    with pytest.raises(OutputError, match="empty path"):
        check_file_target("", "--report")
    check_file_target(str(tmp_path / "r.json"), "--report")
    assert os.listdir(tmp_path) == [], "the probe leaves nothing"
    path = tmp_path / "r.json"
    path.write_text("old")
    write_file_atomic(str(path), b"new", "--report")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["r.json"]


def test_a_file_output_through_a_link_writes_the_target(tmp_path) -> None:
    (tmp_path / "reports").mkdir()
    target = tmp_path / "reports" / "r.json"
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    check_file_target(str(link), "--report")
    write_file_atomic(str(link), b"new", "--report")
    assert os.path.islink(link) and os.readlink(link) == str(target), "the link stays a link"
    assert target.read_text() == "new"
    assert sorted(os.listdir(tmp_path / "reports")) == ["r.json"]
    # A link to a folder is a folder; a dangling link's target folder must exist.
    folder_link = tmp_path / "dir-link"
    folder_link.symlink_to(tmp_path / "reports")
    with pytest.raises(OutputError, match="is a folder"):
        check_file_target(str(folder_link), "--report")
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere" / "r.json")
    with pytest.raises(OutputError, match="does not exist"):
        check_file_target(str(dangling), "--report")


def test_read_only_parent_is_found_before_work(tmp_path) -> None:
    """A read-only folder (as root, permission bits do not stop writes: a read-only
    bind is what a root user meets; skipped where neither applies)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: permission bits do not refuse writes")
        with pytest.raises(OutputError, match="permission denied"):
            check_file_target(str(ro / "r.json"), "--report")
    finally:
        ro.chmod(0o700)


def test_memory_url_folder_is_moved_into_place() -> None:
    fs = fsspec.filesystem("memory")
    url = "memory://outputs-test/out"
    try:
        with OutputDir(url, "DST") as out:
            with fsspec.open(out.path + "/a", "wb") as f:
                f.write(b"1")
            assert not fs.exists("/outputs-test/out")
        assert fs.cat("/outputs-test/out/a") == b"1"
        with pytest.raises(OutputError, match="--overwrite"):
            OutputDir(url, "DST").check()
        with OutputDir(url, "DST", overwrite=True) as out:
            with fsspec.open(out.path + "/b", "wb") as f:
                f.write(b"2")
        assert sorted(fs.ls("/outputs-test/out", detail=False)) == ["/outputs-test/out/b"]
        assert fs.ls("/outputs-test", detail=False) == ["/outputs-test/out"]
    finally:
        fs.rm("/outputs-test", recursive=True)


@pytest.mark.parametrize(
    ("src", "dst", "why"),
    [
        ("s3://b/ck", "s3://b/ck/", "DST s3://b/ck/ is SRC"),
        ("s3://b/ck", "S3://b/./ck", "is SRC"),
        ("s3://b/ck", "s3://b/ck/out", "is inside SRC"),
        ("s3://b/ck/sub", "s3://b/ck", "contains SRC"),
    ],
)
def test_overlapping_urls_are_refused(src, dst, why) -> None:
    with pytest.raises(OutputError, match=why):
        check_disjoint(src, dst)


def test_disjoint_locations_pass(tmp_path) -> None:
    check_disjoint(str(tmp_path / "ck"), str(tmp_path / "ck-out"))  # a prefix, not inside
    check_disjoint("s3://b/ck", "s3://b/ck2")
    check_disjoint("s3://b/ck", "memory://b/ck")


def test_an_output_over_the_target_of_an_input_link_is_refused(tmp_path) -> None:
    """A shard kept elsewhere and linked into the checkpoint (--allow-outside-links): an
    output folder holding the link's target would destroy the input."""
    from mxload.orchestrator.runtime.outputs import check_not_input

    ck, outside = tmp_path / "ck", tmp_path / "outside"
    ck.mkdir()
    outside.mkdir()
    (outside / "model-00002.safetensors").write_bytes(b"shard")
    (ck / "model-00002.safetensors").symlink_to(outside / "model-00002.safetensors")
    with pytest.raises(OutputError, match=r"model-00002\.safetensors \(a link"):
        check_not_input(str(outside), "DST", [("SRC", str(ck))])
    check_not_input(str(outside / "elsewhere"), "DST", [("SRC", str(ck))])  # beside it: fine
