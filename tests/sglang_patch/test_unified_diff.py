"""The strict unified-diff applier used by the build, on hand-worked examples."""

from __future__ import annotations

from pathlib import Path

import pytest

from akv.system._build import PatchError, apply_patch, parse_patch

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 21))

TWO_HUNKS = """header text is ignored
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -2,3 +2,4 @@
 line 2
 line 3
+inserted after 3
 line 4
@@ -15,3 +16,3 @@
 line 15
-line 16
+line sixteen
 line 17
--- /dev/null
+++ b/pkg/new.py
@@ -0,0 +1,2 @@
+first
+second
"""


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir(parents=True)
    (tmp_path / "pkg" / "mod.py").write_text(ORIGINAL)
    return tmp_path


def test_applies_hunks_and_creates_files(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert apply_patch(root, TWO_HUNKS) == ["pkg/mod.py", "pkg/new.py"]
    expected = ORIGINAL.replace("line 3\n", "line 3\ninserted after 3\n").replace("line 16\n", "line sixteen\n")
    assert (root / "pkg" / "mod.py").read_text() == expected
    assert (root / "pkg" / "new.py").read_text() == "first\nsecond\n"


def test_context_mismatch_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    bad = TWO_HUNKS.replace(" line 17\n", " line 18\n")
    with pytest.raises(PatchError, match=r"pkg/mod.py: .* line 17 is 'line 17', the patch expects 'line 18'"):
        apply_patch(root, bad)
    assert (root / "pkg" / "mod.py").read_text() == ORIGINAL
    assert not (root / "pkg" / "new.py").exists()


def test_no_offset_search_a_shifted_hunk_fails(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    shifted = TWO_HUNKS.replace("@@ -2,3 +2,4 @@", "@@ -3,3 +3,4 @@")
    with pytest.raises(PatchError, match="line 3 is 'line 3', the patch expects 'line 2'"):
        apply_patch(root, shifted)


def test_applying_twice_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    apply_patch(root, TWO_HUNKS)
    with pytest.raises(PatchError):
        apply_patch(root, TWO_HUNKS)


def test_missing_target_and_existing_new_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PatchError, match="pkg/mod.py: file to patch does not exist"):
        apply_patch(tmp_path, TWO_HUNKS)
    root = _tree(tmp_path / "t")
    (root / "pkg" / "new.py").write_text("already here\n")
    with pytest.raises(PatchError, match="pkg/new.py: the patch creates this file but it already exists"):
        apply_patch(root, TWO_HUNKS)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ("no diff here\n", "no file sections"),
        ("--- a/x.py\n--- b/x.py\n", r"expected '\+\+\+ '"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n a\n", "hunk counts -2,\\+2 but body has -1,\\+1"),
        ("--- a/x.py\n+++ b/x.py\n@@ bogus @@\n", "malformed hunk header"),
        ("--- a/x.py\n+++ b/y.py\n@@ -1 +1 @@\n-a\n+b\n", "renames are not supported"),
        ("--- a/x.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-a\n", "deleting files is not supported"),
        ("--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n", "unsafe path"),
        ("--- x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n", "does not start with 'a/'"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n\\ No newline at end of file\n", "final newline"),
        ("--- a/x.py\n+++ b/x.py\n", "has no hunks"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n",
         "more than one section"),
    ],
)
def test_malformed_patches_are_refused(patch: str, message: str) -> None:
    with pytest.raises(PatchError, match=message):
        parse_patch(patch)


def test_shipped_patch_parses_and_touches_only_sglang() -> None:
    from akv.system._build import PATCH_FILE

    files = parse_patch(PATCH_FILE.read_text())
    assert files and all(f.new_path.startswith("sglang/") for f in files)
