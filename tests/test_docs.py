"""The documentation against the code: every config key of the schema is in docs/config.md with the
schema's default, every relative Markdown link resolves (file and heading), and the README stays a
first page (under 160 lines), the reference living under docs/."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from shardlm.config import schema

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def schema_keys(cls: type = schema.Config, prefix: str = "") -> dict[str, object]:
    """``{dotted key: default}`` for every leaf of the config dataclasses, as ``config/load.py``
    builds them: an optional section (``lora``) through its ``section`` metadata, a nested
    dataclass through its default factory."""
    keys: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if "section" in f.metadata:
            keys.update(schema_keys(f.metadata["section"], f"{name}."))
        elif f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            keys.update(schema_keys(f.default_factory, f"{name}."))
        else:
            keys[name] = f.default
    return keys


def prose_lines(path: Path) -> list[str]:
    """The lines of a Markdown file outside fenced code blocks (a ``# comment`` in a shell block
    is no heading, a ``[x](y)`` in code no link)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped but ``-`` and ``_``, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets ``-1``, ``-2``... as GitHub numbers them."""
    seen: dict[str, int] = {}
    for line in prose_lines(path):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            if count:
                seen[f"{base}-{count}"] = 1
    return set(seen)


def test_every_config_key_is_in_config_md_with_its_default():
    rows = {}
    for line in (ROOT / "docs" / "config.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[1].startswith("`"):
            rows[cells[0].strip("`")] = cells[1].strip("`")
    keys = schema_keys()
    assert {"model", "train.max_steps", "parallel.tp", "lora.r", "eval.path"} <= set(keys)
    assert sorted(set(keys) - set(rows)) == [], "config keys missing from docs/config.md"
    assert sorted(set(rows) - set(keys)) == [], "docs/config.md documents keys the schema does not have"
    wrong = {k: (rows[k], keys[k]) for k in keys if yaml.safe_load(rows[k]) != keys[k]}
    assert wrong == {}, "defaults in docs/config.md (documented, schema)"


def test_every_relative_link_resolves_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for line in prose_lines(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_slug_follows_github():
    assert slug("The router's load-balancing loss") == "the-routers-load-balancing-loss"
    assert slug("MoE (52)") == "moe-52"
    assert slug("`train`") == "train"


def test_readme_is_a_first_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 160, f"README.md has {len(lines)} lines; move reference text to a page under docs/"
