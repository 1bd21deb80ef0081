"""The docs read as GitHub renders them, for test_docs.py and test_docs_commands.py: shell code
blocks (fenced or indented) and inline code apart from the prose, each heading's anchor, relative
links, and the `python SCRIPT ...` and `python -m MODULE ...` commands of a shell line."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELLS = {"", "sh", "bash", "shell", "console", "zsh"}


# -- markdown
# --------------------------------------------------------------------------------------------------


def markdown_parts(text):
    """(shell code blocks, prose) of a markdown text. Fenced blocks in a shell (or no) language and
    indented blocks are code; prose is everything else, the code replaced by blank lines so that
    paragraphs stay apart."""
    blocks, prose, lines = [], [], text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence:
            end = next(
                (
                    j
                    for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence.group(1))
                ),
                len(lines),
            )
            if fence.group(2).lower() in SHELLS:
                blocks.append("\n".join(lines[i + 1 : end]))
            prose += [""] * (end + 1 - i)
            i = end + 1
        elif (
            line.startswith(("    ", "\t"))
            and (i == 0 or not lines[i - 1].strip())
            and line.strip()
        ):
            end = i
            while end < len(lines) and (
                lines[end].startswith(("    ", "\t")) or not lines[end].strip()
            ):
                end += 1
            blocks.append(
                "\n".join(ln[4:] if ln.startswith("    ") else ln[1:] for ln in lines[i:end])
            )
            prose += [""] * (end - i)
            i = end
        else:
            prose.append(line)
            i += 1
    return blocks, "\n".join(prose)


def inline_code(prose):
    """The inline code spans of prose (a span may wrap onto the next line, never across a
    paragraph)."""
    spans = []
    for paragraph in re.split(r"\n\s*\n", prose):
        spans += [
            m.group(2).replace("\n", " ")
            for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", paragraph, re.S)
        ]
    return spans


def without_code(prose):
    return re.sub(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", " ", prose, flags=re.S)


def links(prose):
    """Every link target of prose: inline links and images, and reference definitions."""
    text = without_code(prose)
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    return inline + re.findall(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text, re.M)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", markdown_parts(text)[1], re.M):
        s = slug(m.group(1))
        # GitHub numbers repeated headings: x, x-1, x-2
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def check_links(text, where):
    """Problems with the relative links of `text`, a markdown file at `where`."""
    problems = []
    for target in links(markdown_parts(text)[1]):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        file = (where.parent / path).resolve() if path else where
        if not file.exists():
            problems.append(f"{where.name}: link to {target}: {path} does not exist")
        elif anchor and file.suffix == ".md":
            names = anchors(text if file == where else file.read_text())
            if anchor not in names:
                problems.append(
                    f"{where.name}: link to {target}: no heading #{anchor} in {file.name}"
                )
    return problems


# -- shell commands
# -----------------------------------------------------------------------------------------------


def shell_lines(block):
    """The logical lines of a shell block: backslash continuations joined."""
    return block.replace("\\\n", " ").split("\n")


def without_comment(line):
    """The line up to a shell comment: a # that starts a word outside quotes (`# OpenAI's weights`
    has a quote)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def tokens_of(line):
    lex = shlex.shlex(without_comment(line), posix=True, punctuation_chars=";&|")
    lex.whitespace_split, lex.commenters = True, ""
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote: an inline span that quotes half a command
        return without_comment(line).split()


def python_commands(line):
    """Each python command of a shell line, as (target, args): target a script path or '-m
    MODULE'."""
    tokens, found, segment = tokens_of(line), [], []
    for t in [*tokens, ";"]:
        # a quoted command: gcloud ... --command="cd x && python train.py ..."
        if " " in t and "python" in t:
            found += python_commands(t.split("=", 1)[-1])
        if t and set(t) <= set(";&|"):
            starts = [
                i
                for i, w in enumerate(segment)
                if re.fullmatch(r"python3?(\.\d+)?", w.rsplit("/", 1)[-1])
            ]
            rest = segment[starts[0] + 1 :] if starts else []
            if rest[:1] == ["-m"] and len(rest) > 1:
                found.append(("-m " + rest[1], rest[2:]))
            elif rest and rest[0].endswith(".py"):
                found.append((rest[0], rest[1:]))
            segment = []
        else:
            segment.append(t)
    return found


def doc_commands(text):
    blocks, prose = markdown_parts(text)
    lines = [ln for b in blocks for ln in shell_lines(b)] + inline_code(prose)
    return [c for ln in lines for c in python_commands(ln)]
