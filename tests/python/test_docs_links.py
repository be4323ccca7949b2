"""Every link in the project's Markdown documents leads somewhere: README.md, DEVELOPMENT.md,
ARCHITECTURE.md and docs/*.md. A relative link must name a file or directory that exists;
a `#anchor` (in the same document or another .md file) must be the GitHub slug of one of
that document's headings (lowercase, spaces to '-', punctuation other than '-' and '_'
dropped, '-1', '-2', ... on repeats). External http(s) links are not fetched, only checked
for form. Standard library only: no server, no build.

Run alone with `python3 tests/python/test_docs_links.py`."""

import re
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[2]


def documents(root=ROOT):
    """The documents whose links are checked."""
    names = [root / "README.md", root / "DEVELOPMENT.md", root / "ARCHITECTURE.md"]
    return [p for p in names if p.exists()] + sorted((root / "docs").glob("*.md"))


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def mask_code(text):
    """`text` with fenced blocks and inline code spans blanked (newlines kept), so that
    link-like text in code is not read as a link and offsets still give line numbers."""
    lines = text.split("\n")
    out = []
    fence = None
    for line in lines:
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            out.append(" " * len(line))
        elif fence is not None:
            if m and m.group(1).startswith(fence) and line.strip() == m.group(1):
                fence = None
            out.append(" " * len(line))
        else:
            out.append(line)
    masked = "\n".join(out)
    return re.sub(
        r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)",
        lambda m: re.sub(r"[^\n]", " ", m.group(0)),
        masked,
        flags=re.S,
    )


# [text](target "title") and ![alt](target); text may hold one level of brackets and span
# lines; the target is <...> or has no spaces (balanced parentheses allowed).
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"
    r"\(\s*(<[^>\n]*>|(?:[^()\s]|\([^()\s]*\))*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
# [label]: target
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*(<[^>\n]*>|\S+)", re.M)


def links(path):
    """(line number, target) of every link in the document at `path`."""
    text = mask_code(path.read_text(encoding="utf-8"))
    found = []
    for pattern in (INLINE_LINK, REFERENCE_DEFINITION):
        for m in pattern.finditer(text):
            target = m.group(1).strip()
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((text.count("\n", 0, m.start()) + 1, target))
    return sorted(found)


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor the document at `path` has: its headings' slugs (repeats numbered as
    GitHub does) and explicit `<a id>` / `<a name>` targets."""
    original = path.read_text(encoding="utf-8").split("\n")
    masked = mask_code("\n".join(original)).split("\n")
    heading = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
    seen = {}
    result = set()

    def add(text):
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")

    for i, line in enumerate(masked):
        if heading.match(line):
            # The heading's own text, code spans included (the masked line only locates it).
            add(heading.match(original[i]).group(1) or "")
            continue
        if (
            i > 0
            and re.match(r"^ {0,3}(=+|-+)[ \t]*$", line)
            and masked[i - 1].strip()
            and not masked[i - 1].lstrip().startswith(("|", "-", "*", "+", ">", "#"))
            and not re.match(r"^\s*\d+[.)]\s", masked[i - 1])
        ):
            add(original[i - 1])
    for m in re.finditer(r"<a\s+[^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", "\n".join(masked)):
        result.add(m.group(1))
    return result


def problem(path, target, root):
    """Why `target`, a link in the document at `path`, is broken; None when it is fine."""
    if not target:
        return "empty link target"
    parts = urlsplit(target)
    if parts.scheme in ("http", "https"):
        if not parts.hostname or re.search(r"\s", target):
            return "malformed external link"
        return None
    if parts.scheme == "mailto":
        return None if re.fullmatch(r"mailto:[^@\s]+@[^@\s]+", target) else "malformed mailto link"
    if parts.scheme or parts.netloc:
        return f"unknown link scheme {parts.scheme!r}"
    if parts.path:
        file = (root / unquote(parts.path).lstrip("/")) if parts.path.startswith("/") else path.parent / unquote(parts.path)
        if not file.exists():
            return "no such file"
    else:
        file = path
    if parts.fragment:
        if file.is_file() and file.suffix == ".md":
            if unquote(parts.fragment) not in anchors(file):
                return f"no heading with the anchor #{parts.fragment} in {file.name}"
        elif not file.is_file():
            return "an anchor on a directory"
    return None


def broken_links(files, root=ROOT):
    """'file:line: target (why)' for every broken link in `files`."""
    broken = []
    for path in files:
        for line, target in links(path):
            why = problem(path, target, root)
            if why:
                broken.append(f"{path.relative_to(root)}:{line}: {target} ({why})")
    return broken


def test_every_link_in_the_documents_resolves():
    files = documents()
    assert ROOT / "README.md" in files and any(p.parent.name == "docs" for p in files)
    broken = broken_links(files)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_check_finds_broken_links():
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "docs").mkdir()
        (root / "docs" / "other.md").write_text(
            "# Other\n\n## Triton's `server` arguments\n\n## Repeat\n\n## Repeat\n\nSetext\n------\n"
        )
        (root / "README.md").write_text(
            "# Title\n\n## Two words\n\n"
            "[ok](docs/other.md) [ok](docs/other.md#tritons-server-arguments) [ok](#two-words)\n"
            "[ok](docs/other.md#repeat-1) [ok](docs/other.md#setext) [ok](https://example.com/a)\n"
            "[ok](docs/) [wrapped\ntext](#title) `[code](missing.md)`\n"
            "```\n[fenced](missing.md)\n```\n"
            "[gone](missing.md)\n"
            "[bad anchor](docs/other.md#nope)\n"
            "[bad local](#Two-Words)\n"
            "[bad url](https://)\n"
            "[ref]: nowhere.md\n"
        )
        broken = broken_links(documents(root), root)
    assert [b.split(" (")[0] for b in broken] == [
        "README.md:12: missing.md",
        "README.md:13: docs/other.md#nope",
        "README.md:14: #Two-Words",
        "README.md:15: https://",
        "README.md:16: nowhere.md",
    ], broken


if __name__ == "__main__":
    test_the_check_finds_broken_links()
    found = broken_links(documents())
    print("\n".join(found) or f"all links resolve in {len(documents())} documents")
    sys.exit(1 if found else 0)
