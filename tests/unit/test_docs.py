"""docs/ARCHITECTURE.md stays true: every file it names exists, and its error tree lists every typed error."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from shared import errors

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_every_path_the_architecture_page_names_exists() -> None:
    named = set(re.findall(r"`([\w.-]+/[\w./-]*?(?:\.py|/))`", ARCHITECTURE))
    assert named, "the page names no paths: the pattern broke"
    assert sorted(path for path in named if not (ROOT / path).exists()) == []


def test_every_module_file_named_alone_exists_somewhere() -> None:
    packages = ("shared", "swarm_node", "gateway", "sim")
    names = {path.name for package in packages for path in (ROOT / package).rglob("*.py")}
    bare = set(re.findall(r"`(\w+\.py)`", ARCHITECTURE))
    assert sorted(bare - names) == []


def test_the_error_tree_lists_every_typed_error() -> None:
    tree = ARCHITECTURE.split("## The error tree", 1)[1].split("```", 2)[1]
    typed = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, errors.SwarmError) and value.__module__ == errors.__name__
    }
    listed = set(re.findall(r"\b([A-Z]\w+)\b", tree))
    assert sorted(typed - listed) == []


def test_every_page_the_readme_links_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    links = set(re.findall(r"\]\(((?:docs|bench)/[^)#]+)\)", readme))
    assert links, "README links to no docs page: the pattern broke"
    assert sorted(link for link in links if not (ROOT / link).exists()) == []
