"""Print the project's requirements from pyproject.toml, one a line: what building it needs, the runtime
dependencies and those of the extras named (comma-separated, may be empty).

The Dockerfile installs these in a layer of their own, before it copies the code, so that editing the code
or the README does not reinstall the dependencies.

    python requirements.py pyproject.toml xpu,quantize
"""

from __future__ import annotations

import sys

import tomllib


def requirements(pyproject: str, extras: str) -> list[str]:
    with open(pyproject, "rb") as f:
        toml = tomllib.load(f)
    project = toml["project"]
    reqs = [*toml["build-system"]["requires"], *project["dependencies"]]
    known = project.get("optional-dependencies", {})
    for extra in filter(None, extras.split(",")):
        if extra not in known:
            raise SystemExit(f"requirements.py: no extra {extra!r} in {pyproject} (known: {', '.join(sorted(known))})")
        reqs += known[extra]
    return reqs


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print("\n".join(requirements(sys.argv[1], sys.argv[2])))
