"""The documentation holds together: relative links resolve, README's commands are the ones CI runs,
and the loss-curve runs the docs name are in the recorded CSV. Reads files only (no network)."""

import csv
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".pytest_cache", ".hypothesis", "build", "dist", "third_party", "runs", "__pycache__"}
MAIN_JOB = "pip install torch==2.13.0 -e . && python -m megatron_zeco.train --nproc-per-node 4"
TESTS = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest tests -q'
LOSS_CSV = "docs/results/loss-curves.csv"


def markdown_files():
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".md")]
    return sorted(found)


def _prose(text):
    """The text without fenced code blocks and inline code spans (neither holds links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slugs(path):
    """GitHub's anchors of a markdown file's headings."""
    seen, out = {}, set()
    for line in re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path):
    """(line number, target) of every link and image in ``path`` that is not a URL."""
    text = _prose(path.read_text(encoding="utf-8"))
    links = []
    for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        links.append((text.count("\n", 0, m.start()) + 1, target))
    return links


def test_markdown_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/benchmarks.md", "docs/design.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    broken = []
    for line, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"line ~{line}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            broken.append(f"line ~{line}: {target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_readme_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert MAIN_JOB in readme, "README lost the main job's command line"
    assert TESTS in readme, "README lost the test command line"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    # CI quiets pip; otherwise the same line
    assert any(line.replace("pip install -q ", "pip install ").startswith(TESTS) for line in ci), \
        ".ci/run no longer runs README's test command"


def test_loss_curve_runs_named_in_docs_are_recorded():
    with open(ROOT / LOSS_CSV, newline="") as f:
        runs = {row["run"] for row in csv.DictReader(f)}
    named = set()
    for path in markdown_files():
        text = path.read_text(encoding="utf-8").replace("\\\n", " ")
        for m in re.finditer(re.escape(f"loss_curves.py compare {LOSS_CSV}") + r"((?:\s+[a-z][a-z0-9-]*`?)+)", text):
            for token in m.group(1).split():
                named.add(token.rstrip("`"))
                if token.endswith("`"):
                    break
    assert named, "no loss_curves.py compare command found in the docs"
    assert named <= runs, f"runs named in the docs but not in {LOSS_CSV}: {sorted(named - runs)}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unfilled_placeholders(path):
    """No template slot such as ``{TIMES}`` left in the prose: a figure to fill is filled or left out."""
    slots = re.findall(r"\{[A-Z][A-Z0-9_]*\}", _prose(path.read_text()))
    assert not slots, f"{path.relative_to(ROOT)}: unfilled {slots}"
