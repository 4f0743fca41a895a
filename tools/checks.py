"""Pass/fail bookkeeping for the GPU check scripts: every comparison is one JSON line with `"ok"`, and the
script ends with one summary line and exits 1 if any check failed (so a run can fail, not only print)."""

from __future__ import annotations

import json
import sys


class Checks:
    def __init__(self, script: str) -> None:
        self.script = script
        self.failed: list[str] = []
        self.passed = 0

    def expect(self, name: str, ok: bool, **detail: object) -> bool:
        """Record one check (printed as a JSON line with its details); returns ok."""
        print(json.dumps({"check": name, "ok": bool(ok), **detail}), flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)
        return bool(ok)

    def finish(self) -> int:
        """Print the summary line; the process exit status (0: every check passed)."""
        if self.failed:
            print(f"{self.script}: FAIL ({len(self.failed)} of {len(self.failed) + self.passed} checks failed: "
                  f"{'; '.join(self.failed)})", flush=True)
            return 1
        if not self.passed:
            print(f"{self.script}: FAIL (no check ran)", flush=True)
            return 1
        print(f"{self.script}: PASS ({self.passed} checks)", flush=True)
        return 0


def exit_with(checks: Checks) -> None:
    sys.exit(checks.finish())
