"""The Dockerfile, checked without a Docker engine: hadolint, COPY sources against .dockerignore, its shape."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.conftest import ROOT, Tools

DOCKERFILE = ROOT / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: str


def parse(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments (parser directives too) dropped."""
    instructions: list[Instruction] = []
    stage, pending = "", ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text, pending = pending + line, ""
        keyword, _, args = text.partition(" ")
        if keyword.upper() == "FROM":
            stage = args.split()[-1] if " AS " in args.upper() else args
        instructions.append(Instruction(keyword.upper(), args.strip(), stage))
    return instructions


def glob_regex(glob: str) -> str:
    """Docker's (Go filepath.Match) globs: `*`, `?` and `[...]` stay inside one path element, `**` crosses them."""
    regex = ""
    for token in re.split(r"(\*\*/|\*\*|\*|\?|\[[^\]]+\])", glob):
        if token.startswith("[") and token.endswith("]"):
            regex += token  # a character class reads the same in both
        else:
            regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
    return regex


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        regex = glob_regex(pattern.removeprefix("!").strip("/"))
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not pattern.startswith("!")
    return excluded


def ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def copy_sources(instructions: list[Instruction]) -> list[str]:
    sources = []
    for instruction in instructions:
        if instruction.keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(instruction.args)
        if any(word.startswith("--from=") for word in words):
            continue
        sources += [word for word in words if not word.startswith("--")][:-1]
    return sources


def test_hadolint(tools: Tools) -> None:
    tools.ok("hadolint", [DOCKERFILE])


def test_every_copy_source_exists_in_the_build_context() -> None:
    sources = copy_sources(parse(DOCKERFILE))
    assert {"pyproject.toml", "README.md", "shared", "swarm_node", "gateway", "docker/entrypoint.py"} <= set(sources)
    patterns = ignore_patterns()
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
        assert not dockerignore_excludes(source, patterns), f"COPY {source}: excluded by .dockerignore"


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = ignore_patterns()
    for path in (".venv", ".tools", ".git", "tests", "bench", "charts", "shared/__pycache__/x.pyc", "gateway/a.pyc"):
        assert dockerignore_excludes(path, patterns), path
    for path in ("shared/settings.py", "gateway/api/routes/x.py", "docker/identity.py"):
        assert not dockerignore_excludes(path, patterns), path


def test_runtime_stage_is_non_root_with_healthcheck_and_cache_volume() -> None:
    instructions = parse(DOCKERFILE)
    final = instructions[-1].stage
    runtime = [i for i in instructions if i.stage == final]
    (user,) = [i.args for i in runtime if i.keyword == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    assert "10001" in next(i.args for i in runtime if i.keyword == "ARG" and i.args.startswith("UID"))
    assert any(i.keyword == "HEALTHCHECK" and "swarmgate-healthcheck" in i.args for i in runtime)
    assert any(i.keyword == "VOLUME" and "/var/cache/swarmgate" in i.args for i in runtime)
    env = " ".join(i.args for i in runtime if i.keyword == "ENV")
    assert "HF_HOME=/var/cache/swarmgate/" in env
    assert [i.args for i in runtime if i.keyword == "ENTRYPOINT"] == ['["swarmgate-entrypoint"]']
    froms = [i.args for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2 and all(f.startswith("${PYTHON_IMAGE}") for f in froms), "one base for venv symlinks"


def test_torch_pin_matches_the_makefile_and_both_variants_are_built() -> None:
    makefile_pin = re.search(r"torch==([0-9.]+)", (ROOT / "Makefile").read_text())
    assert makefile_pin is not None
    args = {i.args.split("=")[0]: i.args for i in parse(DOCKERFILE) if i.keyword == "ARG"}
    assert args["TORCH_VERSION"] == f"TORCH_VERSION={makefile_pin.group(1)}"
    assert args["VARIANT"] == "VARIANT=cpu"
    text = DOCKERFILE.read_text()
    assert "cpu) index=" in text and "cuda) index=" in text


def test_the_image_ships_the_container_scripts() -> None:
    sources = copy_sources(parse(DOCKERFILE))
    for script in ("entrypoint", "identity", "healthcheck"):
        assert f"docker/{script}.py" in sources
