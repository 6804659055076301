"""One Python process with SGLang's classes patched by the plugin, for unit tests.

The plugin's hooks patch SGLang classes for the life of a process, so tests of
the hooked classes cannot run in pytest's own process without leaking the patches
into every later test. They used to start one fresh interpreter each (≈20 s of
imports apiece on 2 cores); this module starts one per session and runs each
test's script in it, in a namespace of its own.

A script reports by printing one line ``RESULT <json>``; :meth:`Hooked.run`
returns that JSON and the stderr the script produced (SGLang logs there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# Runs in the child: apply the hooks once, then execute scripts read from stdin
# (one JSON string per line) and answer each with a REPLY line.
_SERVE = r"""
import json, sys, traceback
import sglang.srt.managers.scheduler  # tree hooks are registered where the scheduler is loaded
from sgl_importance import plugin
plugin.load()
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
print("READY", flush=True)
for line in sys.stdin:
    namespace = {"__name__": "__hooked__"}
    try:
        exec(compile(json.loads(line), "<hooked script>", "exec"), namespace)
        reply = {"ok": True}
    except BaseException:
        reply = {"ok": False, "error": traceback.format_exc()}
    sys.stderr.flush()
    print("REPLY " + json.dumps(reply), flush=True)
"""


@dataclass
class Outcome:
    result: Any  # the JSON of the script's RESULT line
    stderr: str  # what the script wrote to stderr


class Hooked:
    """The hooked interpreter; :meth:`run` executes one script in it."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="hooked-")
        self._stderr_path = Path(self._dir.name) / "stderr"
        with open(self._stderr_path, "ab") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self._read_until("READY")

    def _stderr_since(self, offset: int) -> str:
        with open(self._stderr_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def _read_until(self, prefix: str) -> tuple[list[str], str]:
        lines = []
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return lines, line[len(prefix) :].strip()
            lines.append(line)
        raise RuntimeError(f"hooked interpreter exited ({self.proc.wait()}):\n{self._stderr_since(0)[-3000:]}")

    def run(self, script: str) -> Outcome:
        """Execute ``script`` in a fresh namespace; fails the test if it raised or printed no RESULT."""
        offset = self._stderr_path.stat().st_size
        self.proc.stdin.write(json.dumps(script) + "\n")
        self.proc.stdin.flush()
        lines, reply = self._read_until("REPLY ")
        stderr = self._stderr_since(offset)
        answer = json.loads(reply)
        assert answer["ok"], answer["error"] + "\n" + stderr[-3000:]
        results = [line[len("RESULT ") :] for line in lines if line.startswith("RESULT ")]
        assert results, "the script printed no RESULT line:\n" + "".join(lines)[-2000:] + stderr[-3000:]
        return Outcome(json.loads(results[-1]), stderr)

    def close(self) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait()
        self._dir.cleanup()
        return code
