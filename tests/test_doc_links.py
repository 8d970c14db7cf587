"""Every relative link in the README and the docs resolves, and the README stays short.

Checked: README.md, every docs/*.md and every other Markdown file of the repository they link (followed link by
link). A link or image resolves when its file or folder exists; an anchor (``#section``) must name a heading of the
target Markdown file by GitHub's slug rules (the heading's text lowercased, punctuation other than ``-`` and ``_``
removed, each space turned into ``-``; a repeated heading gets ``-1``, ``-2``, ...). Links inside code blocks and
code spans are not links. External links (``http(s)://``, ``mailto:``) are not fetched.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
# [text](target "title") and ![alt](target); text may hold one level of brackets ([`x`] or an image's [alt]).
_LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_IMAGE = re.compile(r"!\[[^\[\]]*\]\(\s*(<[^>]*>|[^)\s]*)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HTML_ANCHOR = re.compile(r"<a\s+[^>]*?(?:name|id)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_HTML_TAG = re.compile(r"<[^>]+>")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out = []
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            continue
        out.append((number, line))
    return out


def heading_text(raw: str) -> str:
    """A heading's rendered text: code spans keep their content, links and images their text, emphasis goes."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), raw)
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", text)
    text = _HTML_TAG.sub("", text)
    text = re.sub(r"(\*{1,3})(\S(?:.*?\S)?)\1", r"\2", text)
    return text.strip()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before the -1, -2 ... of repeated headings)."""
    kept = []
    for char in heading.lower():
        if char in " -_" or unicodedata.category(char)[0] in "LNM" or unicodedata.category(char) == "Pc":
            kept.append(char)
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file defines: its headings' slugs (repeats numbered) and HTML name / id anchors."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(text):
        match = _HEADING.match(line)
        if match:
            base = slug(heading_text(match.group(2) or ""))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(m.group(1) for m in _HTML_ANCHOR.finditer(line))
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link, image and link reference definition outside code."""
    out = []
    previous_blank = True
    for number, line in _prose_lines(text):
        line = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        targets = [m.group(2) for m in _LINK.finditer(line)] + [m.group(1) for m in _IMAGE.finditer(line)]
        # A reference definition cannot interrupt a paragraph: "[1, 2]: (f, b)" inside one is text.
        ref = _REF_DEF.match(line) if previous_blank else None
        if ref:
            targets.append(ref.group(1))
        previous_blank = not line.strip()
        for target in dict.fromkeys(targets):
            out.append((number, target.strip("<>")))
    return out


def check_links(start: list[Path], root: Path) -> tuple[list[str], list[Path]]:
    """Broken links of the start files and of every Markdown file under root they link, and the files checked."""
    problems: list[str] = []
    queue = [p.resolve() for p in start]
    checked: list[Path] = []
    anchor_cache: dict[Path, set[str]] = {}
    while queue:
        source = queue.pop(0)
        if source in checked:
            continue
        checked.append(source)
        text = source.read_text(encoding="utf-8")
        where = source.relative_to(root)
        for number, target in links(text):
            if not target or _EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            path_part = unquote(path_part.split("?", 1)[0])
            if path_part.startswith("/"):
                dest = (root / path_part.lstrip("/")).resolve()
            elif path_part:
                dest = (source.parent / path_part).resolve()
            else:
                dest = source
            if not dest.exists():
                problems.append(f"{where}:{number}: {target}: no such file {path_part}")
                continue
            if root not in dest.parents and dest != root:
                problems.append(f"{where}:{number}: {target}: outside the repository")
                continue
            if dest.is_file() and dest.suffix.lower() == ".md":
                if dest not in checked and dest not in queue:
                    queue.append(dest)
                if anchor:
                    if dest not in anchor_cache:
                        anchor_cache[dest] = anchors(dest.read_text(encoding="utf-8"))
                    if unquote(anchor) not in anchor_cache[dest]:
                        problems.append(
                            f"{where}:{number}: {target}: no heading with anchor #{anchor} in {dest.relative_to(root)}"
                        )
    return problems, checked


def _start_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_is_at_most_300_lines():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


def test_every_relative_link_resolves():
    problems, checked = check_links(_start_files(), REPO)
    assert not problems, "broken links:\n" + "\n".join(problems)
    names = {p.relative_to(REPO).as_posix() for p in checked}
    # The Markdown files the README links are followed, not only the start files.
    assert {"benchmarks/RESULTS.md", "docker/README.md"} <= names, names


def test_readme_links_every_docs_page():
    linked = {
        (REPO / target.partition("#")[0]).resolve()
        for _, target in links((REPO / "README.md").read_text(encoding="utf-8"))
        if not _EXTERNAL.match(target) and target.partition("#")[0]
    }
    unlinked = [p.name for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_github_slugs():
    assert slug(heading_text("Every method side by side: `python -m gtpo.cpu.compare`")) == (
        "every-method-side-by-side-python--m-gtpocpucompare"
    )
    assert slug(heading_text("A task where a later token decides: second_word")) == (
        "a-task-where-a-later-token-decides-second_word"
    )
    assert slug(heading_text("GTPO and GRPO, 100 steps (the pictures below)")) == (
        "gtpo-and-grpo-100-steps-the-pictures-below"
    )
    assert slug(heading_text("4c. Kubernetes (KubeRay >= 1.2)")) == "4c-kubernetes-kuberay--12"
    assert slug(heading_text("3.7 ⚠ Split vs joint normalisation")) == "37--split-vs-joint-normalisation"
    assert slug(heading_text("**Bold** and [a link](x.md)")) == "bold-and-a-link"
    assert anchors("# Title\n## Notes\n```\n## Not a heading\n```\n## Notes\n### Notes\n") == {
        "title",
        "notes",
        "notes-1",
        "notes-2",
    }


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "img.png").write_bytes(b"")
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[ok](docs/page.md#second-part) [ok, repeated](docs/page.md#part-1) ![ok](img.png) [ok](#top)\n"
        "[gone](docs/missing.md) ![gone](missing.png) [bad anchor](docs/page.md#no-such-part) [bad](#nowhere)\n"
        "`[in a code span](nowhere.md)` [web](https://example.com/x.md)\n\n"
        "```\n[in a code block](nowhere.md)\n```\n\n"
        "[ref]: docs/also-missing.md\n"
    )
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Part\n\n## Part\n\n## Second part\n\n[back](../README.md#top) [onward](next.md)\n"
    )
    problems, checked = check_links([tmp_path / "README.md"], tmp_path.resolve())
    assert {p.split(": ", 1)[1].split(":")[0] for p in problems} == {
        "docs/missing.md",
        "missing.png",
        "docs/page.md#no-such-part",
        "#nowhere",
        "docs/also-missing.md",
        "next.md",
    }, problems
    assert (tmp_path / "docs" / "page.md").resolve() in checked
