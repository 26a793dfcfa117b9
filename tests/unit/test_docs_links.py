"""Every relative link in the repository's Markdown resolves, and every bench/results file a doc
names exists (docs are reference: a dead link or a deleted result file is a defect)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", ".venv-vllm", "node_modules", "__pycache__", ".mypy_cache",
             ".ruff_cache"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
# a result file named in prose or a command; `<commit>:bench/results/x.json` is git history
RESULT = re.compile(r"(?<![0-9a-f]:)\bbench/results/([\w.-]+\.(?:json|png))\b")


def markdown_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md")
                  if not SKIP_DIRS & set(p.relative_to(ROOT).parts[:-1]))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE.sub(lambda m: m.group(0)[1:-1], heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def dead_links(path: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    dead = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target} (no heading #{anchor} in {dest.name})")
    return dead


def missing_results(path: Path) -> list[str]:
    names = set(RESULT.findall(path.read_text(encoding="utf-8")))
    return sorted(n for n in names if not (ROOT / "bench" / "results" / n).exists())


def test_markdown_files_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "BENCHMARKS.md", "RELIABILITY.md"} <= names, names


def test_relative_links_resolve() -> None:
    dead = {p.relative_to(ROOT).as_posix(): d for p in markdown_files() if (d := dead_links(p))}
    assert not dead, f"dead relative links: {dead}"


def test_named_result_files_exist() -> None:
    missing = {p.relative_to(ROOT).as_posix(): m for p in markdown_files()
               if (m := missing_results(p))}
    assert not missing, f"bench/results files named in docs but absent: {missing}"


def test_checker_catches_dead_links(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Real heading\n", encoding="utf-8")
    doc.write_text("[ok](b.md#real-heading) [gone](c.md) [bad](b.md#nope) "
                   "`[code](x.md)` [web](https://example.org/x)\n", encoding="utf-8")
    assert dead_links(doc) == ["c.md (no such file)", "b.md#nope (no heading #nope in b.md)"]
    assert slug("End to end: GPU only vs L1+L2, `x`") == "end-to-end-gpu-only-vs-l1l2-x"
