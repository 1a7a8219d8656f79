"""The documentation's links hold: every relative link or image in README.md and
docs/**/*.md points at a file that exists, and a `#anchor` at a heading of its target
(GitHub's slugs). The README stays short enough to read (at most 300 lines), and
docs/design.md's EngineConfig table names every field."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300

# [text](target) and ![alt](target), with an optional "title"; the text may hold
# backticks and brackets one level deep ([`x`](y), [![img](a)](b)).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def markdown_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _blank_code_outside_links(line: str) -> str:
    """Inline code spans blanked, except inside a link's text (where `[`x`](y)` is a
    link whose text is code)."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "`":
            end = line.find("`", i + 1)
            if end == -1:
                out.append(line[i:])
                break
            span = line[i:end + 1]
            inside_link_text = line.rfind("[", 0, i) > line.rfind("]", 0, i) and \
                line.startswith("](", line.find("]", end))
            out.append(span if inside_link_text else " " * len(span))
            i = end + 1
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than
    `-` and spaces removed, spaces to `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated slug gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path) -> list[str]:
    """Every relative link of `path` whose file or anchor is missing, as messages."""
    problems = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(_blank_code_outside_links(line)):
            target = match.group(1)
            if EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            file_part = file_part.split("?", 1)[0]
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}"
            if not resolved.exists():
                problems.append(f"{where}: {target}: no such file")
                continue
            if anchor:
                if resolved.is_dir() or resolved.suffix != ".md":
                    problems.append(f"{where}: {target}: an anchor into a non-Markdown file")
                elif anchor not in anchors(resolved):
                    problems.append(f"{where}: {target}: no heading with anchor #{anchor} "
                                    f"in {resolved.name}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES}"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "target.md").write_text("# A title, with `code`\n\n## Second part\n")
    page = tmp_path / "page.md"
    page.write_text("""# Page
[fine](target.md) [fine too](target.md#a-title-with-code) [here](#page)
[missing file](nowhere.md) ![missing image](img.png)
[missing anchor](target.md#third-part) [missing here](#nothing)
[outside](https://example.org/x.md) [mail](mailto:a@example.org)
```
[in a code block](ignored.md)
```
`[in code](ignored-too.md)`
""")
    problems = broken_links(page)
    assert [p.split(": ", 2)[1] for p in problems] == [
        "nowhere.md", "img.png", "target.md#third-part", "#nothing"]


def test_slugs_follow_github():
    assert slug("The engine's contract") == "the-engines-contract"
    assert slug("KV core, from mechanism to policy") == "kv-core-from-mechanism-to-policy"
    assert slug("`EngineConfig`") == "engineconfig"
    assert slug("SQLite's writers") == "sqlites-writers"
    assert slug("docker compose") == "docker-compose"


def test_design_names_every_engine_config_field():
    """docs/design.md's EngineConfig table names every field of EngineConfig (it missed
    eight once)."""
    import dataclasses

    from engine import EngineConfig
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text[text.index("### EngineConfig"):text.index("### LLMEngine")]
    named = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            named |= set(re.findall(r"`([a-z_0-9]+)`", line.split("|")[1]))
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in named]
    assert not missing, f"docs/design.md's EngineConfig table misses {missing}"
