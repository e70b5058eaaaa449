"""The pages link where they say: every relative link in the README, BENCHMARKS.md and
docs/ (its pages of benchmarks included) names a file or folder that is there;
BENCHMARKS.md stays a front page (its headline table, every topic page linked, at most
200 lines); and each part of scripts/benchmarks is quoted by the page its header names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FRONT_LINES = 200
HEADLINE = "| what is compared | ratio | date | machine | commit | command | page |"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address, or an anchor on the same page
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_benchmarks_is_a_front_page_with_its_headline_table():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= FRONT_LINES, "BENCHMARKS.md is a front page: runs go on docs/bench/ pages"
    rows = [line for line in text.splitlines()[text.splitlines().index(HEADLINE) + 2 :] if line.startswith("|")]
    assert rows, "the headline table has no rows"
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 7, row
        assert re.fullmatch(r"2026-\d\d-\d\d", cells[2]) and re.fullmatch(r"[0-9a-f]{7}", cells[4]), row
        assert re.fullmatch(r"\[\w+\]\(docs/bench/\w+\.md\)", cells[6]), row
    topics = {path.name for path in (ROOT / "docs" / "bench").glob("*.md")}
    linked = set(re.findall(r"\(docs/bench/(\w+\.md)\)", text))
    assert topics == linked, f"pages not linked from BENCHMARKS.md: {topics - linked}"


def test_each_part_of_scripts_benchmarks_is_quoted_by_the_page_its_header_names():
    script = (ROOT / "scripts" / "benchmarks").read_text()
    parts = set(re.findall(r"^run (\w+) ", script, re.M)) | set(re.findall(r'\*" (\w+) "\*', script))
    named: dict[str, str] = {}
    for words, page in re.findall(r"^#   ([a-z ]+?)\s+(docs/bench/\w+\.md)$", script, re.M):
        named.update(dict.fromkeys(words.split(), page))
    assert parts and parts == set(named), f"parts without a page in the header: {parts ^ set(named)}"
    for part, page in named.items():
        assert re.search(rf"\b{part}\b", (ROOT / page).read_text()), f"{page} does not name the part {part}"
