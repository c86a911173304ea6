"""Run by ``tests/unit/test_launcher.py`` as ``python -m tests.helpers.launched_probe OUT CODE [sleep]``: writes what
it sees of its start to OUT (JSON), a line to stdout and one to stderr, then (after ``sleep`` seconds) exits with
CODE; at exit a non-daemon thread it started finishes and an ``atexit`` hook appends to OUT."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    out, code = Path(sys.argv[1]), int(sys.argv[2])
    seen = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "probe_variable": os.environ.get("PROBE_VARIABLE"),
        "path": sys.path,
        "own_session": os.getsid(0) == os.getpid(),
        "ours_imported": sorted(m for m in sys.modules if m.split(".")[0] in ("gateway", "swarm_node", "shared")),
    }
    out.write_text(json.dumps(seen) + "\n")
    print("to stdout", flush=True)  # noqa: T201
    sys.stderr.write("to stderr\n")

    def finish() -> None:
        time.sleep(0.2)
        with out.open("a") as file:
            file.write("thread\n")

    threading.Thread(target=finish).start()
    atexit.register(lambda: out.open("a").write("atexit\n"))
    if len(sys.argv) > 3:
        time.sleep(float(sys.argv[3]))
    sys.exit(code)


if __name__ == "__main__":
    main()
