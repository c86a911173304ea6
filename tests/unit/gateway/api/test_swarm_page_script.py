"""The swarm page's script parses: a syntax error leaves the page blank with no other sign (a Python escape that
became a raw newline inside a JS string literal did exactly that)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.api.swarm_page import PAGE


def test_the_page_script_is_valid_javascript(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page script cannot be parsed here")
    (script,) = re.findall(r"<script>(.*?)</script>", PAGE, flags=re.S)
    path = tmp_path / "page.js"
    path.write_text(script)
    checked = subprocess.run([node, "--check", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
