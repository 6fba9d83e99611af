"""The repository stands on its own: the README's and docs' links resolve inside it, nothing points
outside it (a link to a sibling folder or to the internet is dead for anyone with only the repo),
and the license that pyproject.toml declares is there, unmodified."""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Folders that are not the project's files: caches, virtual environments, build output.
SKIPPED_DIRS = {"__pycache__", "node_modules", "build", "dist"}

#: The Apache License 2.0 as the Apache Software Foundation publishes it (LICENSE-2.0.txt).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

#: Files that may name places outside, and why.
LINKS_ALLOWED_IN = {
    "LICENSE": "the license's standard text names its publisher",
    "tests/test_docs.py": "its own examples of what the checks below must find",
}

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target "title") and ![alt](target); [label]: target; <scheme://...>
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
AUTOLINK = re.compile(r"<([a-z][a-z0-9+.-]*:[^>\s]+)>", re.I)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
# A URL's host: the link checker below decides whether it is an example or a real place.
URL_HOST = re.compile(r"\b(?:https?|wss?|ftp)://([^/\s:\"'<>)`\]\\]+)", re.I)
# Well-known places written without a scheme.
BARE_HOST = re.compile(r"(?<![\w.@/-])(?:www\.[a-z0-9-]+\.[a-z]+|(?:github|gitlab)\.com/)", re.I)
EXAMPLE_TLDS = {"example", "internal", "local", "localhost", "test", "invalid"}


def project_files(root: Path) -> Iterator[Path]:
    """Every file of the project under ``root``: hidden folders (``.git``, ``.nox``, caches) and
    build output left out, ``.ci`` kept (it is the project's)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIPPED_DIRS and not d.endswith(".egg-info") and (not d.startswith(".") or d == ".ci")
        )
        for name in sorted(files):
            yield Path(folder) / name


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a built extension, an image)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives a heading: lower case, punctuation other
    than ``-`` and ``_`` dropped, spaces as ``-``."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown document's headings, repeated ones numbered as renderers do."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", markdown).splitlines():
        m = re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def markdown_links(markdown: str) -> list[str]:
    """Link targets of a Markdown document, code blocks and code spans left out (a link written
    as an example is not a link)."""
    prose = INLINE_CODE.sub("", FENCE.sub("", markdown))
    return [
        *INLINE_LINK.findall(prose),
        *REFERENCE_LINK.findall(prose),
        *AUTOLINK.findall(prose),
    ]


def link_problems(document: Path, root: Path) -> list[str]:
    """What is wrong with each link of the Markdown file ``document``: a link out of the repository
    (a URL, or a path that leaves ``root``), a file that is not there, or an anchor that no heading
    of the target has."""
    problems = []
    for target in markdown_links(document.read_text(encoding="utf-8")):
        where = f"{document.relative_to(root)}: link {target!r}"
        if SCHEME.match(target):
            problems.append(f"{where} points outside the repository")
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (document.parent / path_part).resolve() if path_part else document.resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where} leaves the repository")
        elif not resolved.exists():
            problems.append(f"{where}: {resolved.relative_to(root.resolve())} does not exist")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text("utf-8")):
            problems.append(f"{where}: no heading #{fragment} in {resolved.relative_to(root.resolve())}")
    return problems


def outside_references(path: Path, text: str) -> list[str]:
    """References in any file to places outside the repository: a sibling folder (the shared
    folder the project was planned in) or a real host on the internet. Example hosts
    (``cp.example``, ``*.internal``), addresses and placeholders (``http://HOST:PORT``) are config
    values, not links."""
    found = []
    if "../shared" in text:
        found.append(f"{path}: names ../shared")
    for m in URL_HOST.finditer(text):
        labels = m.group(1).lower().split(".")
        if len(labels) < 2 or not labels[-1].isalpha():
            continue  # a placeholder (HOST, {host}) or an IP address
        if "example" in labels or labels[-1] in EXAMPLE_TLDS:
            continue
        found.append(f"{path}: links {m.group(0)}")
    found.extend(f"{path}: names {m.group(0)}" for m in BARE_HOST.finditer(text))
    return found


def test_readme_and_docs_links_resolve_inside_the_repository() -> None:
    documents = [p for p in project_files(REPO) if p.suffix == ".md"]
    assert REPO / "README.md" in documents and REPO / "docs" / "design.md" in documents
    problems = [problem for doc in documents for problem in link_problems(doc, REPO)]
    assert not problems, "\n".join(problems)


def test_the_readme_leads_to_the_docs_and_the_license() -> None:
    """The README is for users; internals live in docs/, and the README says where."""
    links = {target.partition("#")[0] for target in markdown_links((REPO / "README.md").read_text())}
    assert {"docs/design.md", "docs/router.md", "docs/benchmarks.md", "LICENSE"} <= links, links


def test_the_quickstart_comes_first_and_is_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```sh\n(.*?)```", readme, re.S)
    assert first_block is not None and readme.index("## Quickstart") < first_block.start()
    assert first_block.group(1).splitlines() == [
        "python3 -m pip install nox && python3 -m nox -s demo",
        "python3 -m pip install nox && python3 -m nox -s tests",
    ]


def test_nothing_in_the_repository_points_outside_it() -> None:
    found = []
    for path in project_files(REPO):
        text = text_of(path)
        if text is not None and path.relative_to(REPO).as_posix() not in LINKS_ALLOWED_IN:
            found.extend(outside_references(path.relative_to(REPO), text))
    assert not found, "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The checkers themselves, on a small tree with every kind of bad link, so that a check that
    quietly finds nothing cannot pass for a clean repository."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title\n\n## The `relay` pump\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[plan](../shared/DESIGN.md) [web](https://github.com/o/r) [gone](docs/b.md)\n"
        "[ok](docs/a.md#the-relay-pump) [bad anchor](docs/a.md#nowhere) <https://pypi.org/x>\n"
        "![shot](docs/a.md) `[in code](https://x.org)`\n\n[ref]: https://example.org/y\n\n"
        '```toml\nurl = "[not a link](nowhere.md)"\n```\n'
    )
    problems = link_problems(readme, tmp_path)
    assert len(problems) == 6, problems
    assert any("'../shared/DESIGN.md' leaves the repository" in p for p in problems)
    assert any("docs/b.md does not exist" in p for p in problems)
    assert any("no heading #nowhere in docs/a.md" in p for p in problems)
    assert sum("points outside the repository" in p for p in problems) == 3

    code = 'see "../shared/DESIGN.md", https://docs.vllm.ai/en/latest and github.com/o/r\n'
    code += 'example = "http://cp.example:7070" or http://10.0.0.5:8000 or http://HOST:PORT\n'
    found = outside_references(Path("x.py"), code)
    assert len(found) == 3, found


def test_the_license_is_the_one_pyproject_declares() -> None:
    """An SPDX expression (the table form is deprecated by setuptools) and the file it names, the
    standard Apache-2.0 text without a changed byte."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("The relay pump", "the-relay-pump"),
        ("Router, before the split (2026-12-02 and 03)", "router-before-the-split-2026-12-02-and-03"),
        ("The `sim` engine's flags", "the-sim-engines-flags"),
    ],
)
def test_anchors_follow_the_renderers_rule(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_the_readmes_sample_config_is_one_the_control_plane_accepts() -> None:
    """The sample ``llmgw.toml`` is copied by people: it must parse, with its ``"..."`` secrets
    filled in (tokens are 16 characters or more, and each has one role)."""
    from control.config import parse

    readme = (REPO / "README.md").read_text()
    sample = re.search(r"```toml\n(.*?)```", readme, re.S)
    assert sample is not None, "the README has no ```toml sample"
    count = iter(range(1000))
    text = re.sub(r'"\.\.\."', lambda _: f'"{next(count):032x}"', sample.group(1))
    config = parse(text, "README.md")
    assert [m.name for m in config.models] == ["llama-70b"] and config.tls is not None
