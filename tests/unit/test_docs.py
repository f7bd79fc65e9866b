"""The README and the docs pages: the front page's shape, its commands and links, and the
configuration reference generated from the schemas (scripts/config_reference.py)."""

from __future__ import annotations

import importlib.util
import re

from tests.helpers.workflow import REAL_SITE, REPO, bash_blocks, doc_section

README = REPO / "README.md"


def generator():
    spec = importlib.util.spec_from_file_location(
        "config_reference", REPO / "scripts" / "config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_what_the_schemas_give_now() -> None:
    reference = generator()
    assert reference.PAGE.read_text() == reference.render(), (
        "docs/config-reference.md is not current: run .venv/bin/python scripts/config_reference.py"
    )


def test_config_reference_lists_every_key_of_the_schemas() -> None:
    import yaml

    page = (REPO / "docs" / "config-reference.md").read_text()
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    for section, sub in schema["properties"].items():
        for key in sub.get("properties", {}):
            assert f"| `{section}.{key}` |" in page, f"{section}.{key}"
    assert "| `sites.<name>.shapes[].walltime` |" in page
    pipes = "<code>^(auto&#124;cpu&#124;cuda(:[0-9]+)?)$</code>"  # a pipe in a cell, as HTML
    assert f"| `eval.device` | string, matching {pipes} |" in page


def test_readme_is_a_front_page_and_its_quick_start_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    assert bash_blocks("## Quick start")[0] == "make run\nmake test\n"


def without_comment(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line).rstrip()


def test_the_readme_real_site_commands_are_the_pages_as_written() -> None:
    """Every command line of "A real site in brief" is a line of docs/real-site.md's steps."""
    page = [
        *bash_blocks("## 1. The coordinator VM", REAL_SITE),
        *bash_blocks("## 3. Each site", REAL_SITE),
    ]
    written = {without_comment(line) for block in page for line in block.splitlines()}
    brief = bash_blocks("## A real site in brief")
    assert brief
    for block in brief:
        for line in block.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                assert without_comment(line) in written, line


def slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown (mkdocs) and GitHub make it, for plain headings."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_the_readme_links_name_files_and_headings_that_exist() -> None:
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", README.read_text())
    assert links
    for target, anchor in links:
        if "://" in target:
            continue
        path = REPO / target if target else README
        assert path.exists(), target
        if anchor:
            assert anchor in anchors(path), f"{target}#{anchor}"
    assert {target for target, _ in links if target.startswith("docs/")} >= {
        "docs/concepts.md", "docs/real-site.md", "docs/configuration.md", "docs/resume.md",
        "docs/benchmarks.md", "docs/cli.md", "docs/tests.md",
    }  # fmt: skip


def test_doc_section_ends_at_its_level_and_skips_fenced_comments() -> None:
    section = doc_section("## 1. The coordinator VM", REAL_SITE)
    assert "# secrets.yaml, mode 0600" in section  # a bash comment, not a heading
    assert "\n## 2. The run, identical at every site" not in section


def test_no_wrapped_line_of_the_pages_starts_a_quote_or_a_list_by_accident() -> None:
    """A paragraph wrapped so that a line starts with ``>=``, ``> `` or ``+ `` renders as a
    block quote or a list item in the middle of the text (mkdocs builds it without a word)."""
    accidents = []
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"\s*(>|\+ )", line):
                accidents.append(f"{page.relative_to(REPO)}:{number}: {line.strip()[:60]}")
    assert not accidents, accidents
