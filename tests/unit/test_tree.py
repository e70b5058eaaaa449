"""The tree keeps its shape: modules stay small and cite only files in the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
MAX_LINES = 450
MAX_TEST_LINES = 600  # a test module holds one unit's or one feature's tests


def _oversized(folder: Path, limit: int) -> dict[str, int]:
    sizes = {path: len(path.read_text().splitlines()) for path in folder.rglob("*.py")}
    return {str(path.relative_to(ROOT)): n for path, n in sizes.items() if n > limit}


def test_no_module_is_over_the_size_limit():
    big = _oversized(ROOT / "kvasir", MAX_LINES)
    assert not big, f"split these along their jobs (at most {MAX_LINES} lines): {big}"


def test_no_test_module_is_over_the_size_limit():
    big = _oversized(ROOT / "tests", MAX_TEST_LINES)
    assert not big, f"split these by the unit or feature they test (at most {MAX_TEST_LINES} lines): {big}"


def test_comments_cite_files_in_the_repository():
    """The design record is docs/architecture.md; files outside the checkout are not cited."""
    outside = re.compile(r"\b(DESIGN|MISSION)\.md\b|\.\./shared/")
    texts = [*ROOT.glob("kvasir/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md")]
    cited = [
        str(path.relative_to(ROOT)) for path in texts if path != Path(__file__) and outside.search(path.read_text())
    ]
    assert not cited, f"these cite files outside the repository: {cited}"


def test_every_cited_module_path_exists():
    """A comment or doc naming kvasir/<path>.py names a file that is there (paths move)."""
    texts = [*ROOT.glob("kvasir/**/*.py"), *ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("systemd/*")]
    missing = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in texts
        for name in re.findall(r"\bkvasir/[a-z_/]+\.py\b", path.read_text())
        if not (ROOT / name).is_file()
    }
    assert not missing, sorted(missing)


def test_test_modules_have_unique_names():
    """pytest imports test modules by their base name (the test folders are not packages):
    two with one name stop the whole run at collection."""
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}
