"""The README and docs/ stay readable and connected: every relative link names a file
of the repository (and, into a markdown file, one of its headings), the README stays
short and keeps the two commands a fresh machine needs, every flag the plugin declares
is documented, and the metrics page lists every series the plugin registers.

Links are ``[text](target)`` and ``![alt](target)`` outside code blocks and code
spans. A target with a scheme (``https:``, ``mailto:``) is not checked. An anchor
(``path#anchor`` or ``#anchor``) into a markdown file must be one of its headings as
GitHub spells them; an anchor into any other file is not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import sgl_importance.metrics as metrics
from sgl_importance.config import FLAGS

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
SETUP_COMMANDS = (
    "make serve     # installs into .venv, prepares the embedded model, serves on 127.0.0.1:30000",
    "make test      # installs into .venv and runs the whole test suite",
)

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def doc_files(repo: Path = REPO) -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text with code blocks removed and code spans blanked (links inside are not links)."""
    text = _FENCE.sub("", text)
    return _CODE_SPAN.sub("code", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(files: list[Path], repo: Path = REPO) -> list[str]:
    """``file: target (why)`` for each relative link that does not resolve."""
    broken = []
    for source in files:
        for target in _LINK.findall(_prose(source.read_text())):
            if _SCHEME.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            where = (source.parent / path_part).resolve() if path_part else source.resolve()
            label = f"{source.relative_to(repo)}: {target}"
            if not where.is_relative_to(repo.resolve()):
                broken.append(f"{label} (outside the repository)")
            elif not where.exists():
                broken.append(f"{label} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{label} (no such heading)")
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves_to_a_file_and_heading():
    assert broken_links(doc_files()) == []


def test_the_link_check_reports_a_missing_file_a_missing_heading_and_a_link_out_of_the_repo(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## The `torch_cpu` platform: on any CPU\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md) [ok](docs/page.md#the-torch_cpu-platform-on-any-cpu) [ok](#title)\n"
        "[gone](docs/missing.md) ![gone](docs/missing.png) [bad](docs/page.md#no-such-heading)\n"
        "[out](../elsewhere.md) [web](https://example.com/x.md) `[code](docs/missing.md)`\n\n"
        "```\n[fenced](docs/missing.md)\n```\n\n# Title\n"
    )
    assert broken_links(doc_files(tmp_path), tmp_path) == [
        "README.md: docs/missing.md (no such file)",
        "README.md: docs/missing.png (no such file)",
        "README.md: docs/page.md#no-such-heading (no such heading)",
        "README.md: ../elsewhere.md (outside the repository)",
    ]


def test_a_repeated_heading_gets_numbered_anchors_as_on_github(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n### needle\n\n### needle\n\n## n = 12 (2026-11-26)\n")
    assert anchors(page) == {"results", "needle", "needle-1", "n--12-2026-11-26"}


def test_the_readme_stays_within_250_lines():
    assert len((REPO / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_the_readme_holds_exactly_the_two_setup_commands_in_one_block():
    blocks = re.findall(r"^```\n(.*?)^```$", (REPO / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert [line for block in blocks for line in block.splitlines() if line in SETUP_COMMANDS] == list(SETUP_COMMANDS)
    assert any(block.splitlines() == list(SETUP_COMMANDS) for block in blocks)


def test_the_metrics_page_lists_every_series_the_plugin_registers():
    page = (REPO / "docs" / "metrics.md").read_text()
    source = Path(metrics.__file__).read_text()
    named = set(re.findall(r'"(sgl_importance:[a-z_]+[a-z])"', source))
    hot_set = {suffix for suffix, _ in metrics.HOT_SET_SERIES.values()} | set(metrics.HOT_SET_GAUGES)
    assert named, "no series found in metrics.py"
    assert sorted(name for name in named if name not in page) == []
    assert sorted(name for name in hot_set if not re.search(rf"(?<![a-z]){name}(?![a-z])", page)) == []


def test_every_flag_the_plugin_declares_is_documented():
    docs = " ".join(path.read_text() for path in doc_files())
    assert sorted(flag for flag in FLAGS if not re.search(rf"{re.escape(flag)}(?![\w-])", docs)) == []
