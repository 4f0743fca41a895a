"""The user-facing files cannot drift from the code: the Dockerfile passes hadolint and keeps its
contract, the .dockerignore lets in what the Dockerfile copies, the README's flag tables equal the
argparse parsers, every command line in the docs parses, the metrics and error messages the docs name
exist in the source, and docs/smoke.sh passes shellcheck."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import DEMO_ADAPTERS, REPO_ROOT, build_parser

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
DOCKERFILE = REPO_ROOT / "Dockerfile"
ONECCL_ENV = ("ZE_AFFINITY_MASK", "CCL_ATL_TRANSPORT", "CCL_ZE_IPC_EXCHANGE", "CCL_TOPO_FABRIC_VERTEX_CONNECTION_CHECK",
              "CCL_ENABLE_SYCL_KERNELS", "SYCL_UR_USE_LEVEL_ZERO_V2")
SEED_MESSAGES = ("Unsupported base layer", "inputs.size(1) must match lora_b_weights.size(-1)",
                 "lora_b_weights.size(-2) must match slice_size")


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is missing: it comes with the test extras (pip install -e '.[test]')"
    return found


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# -- Dockerfile -------------------------------------------------------------------------------------------
def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def test_hadolint_passes_on_the_dockerfile() -> None:
    proc = subprocess.run([_tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_contract() -> None:
    ins = _instructions()
    args = {k: [a for i, a in ins if i == k] for k in {i for i, _ in ins}}
    assert ins[0] == ("ARG", "DEVICE=xpu")  # default XPU image; --build-arg DEVICE=cpu for the CPU one
    base = next(a for a in args["ARG"] if a.startswith("BASE_IMAGE="))
    assert re.fullmatch(r"BASE_IMAGE=ubuntu:noble-\d{8}", base)  # a dated tag, not a moving one
    assert args["FROM"][0] == "${BASE_IMAGE} AS runtime"
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/${DEVICE}" in args["ARG"]
    assert args["ENTRYPOINT"] == ['["xpulora", "serve"]'] and args["CMD"] == ["[]"]
    env = " ".join(args["ENV"])
    # `docker run IMAGE --port 9000 ...` keeps 0.0.0.0: the image sets the default of --host, not CMD flags.
    assert "XPULORA_HOST=0.0.0.0" in env and "XPULORA_DEMO_DIR=/opt/xpulora/demo" in env
    assert args["EXPOSE"] == ["8000"]
    assert args["VOLUME"] == ['["/models", "/adapters"]']
    user = args["USER"][-1]
    assert user not in ("root", "0") and not user.startswith("0:")
    run = " ".join(args["RUN"])
    # Intel's driver: every package at a pinned release, none from a moving repository.
    for pkg in ("libze-intel-gpu1_${INTEL_COMPUTE_RUNTIME}", "intel-opencl-icd_${INTEL_COMPUTE_RUNTIME}",
                "libigdgmm12_${INTEL_GMMLIB}", "intel-igc-core-2_${INTEL_IGC}", "level-zero_${LEVEL_ZERO}"):
        assert pkg in run, pkg
    pins = dict(a.split("=", 1) for a in args["ARG"] if a.startswith(("INTEL_", "LEVEL_ZERO")))
    assert all(re.fullmatch(r"[0-9.]+", v) for v in pins.values()) and len(pins) == 5, pins
    assert "add-apt-repository" not in run
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in run
    assert "pip uninstall -y triton" in run and "pytorch-triton-xpu==" in run
    assert "! pip show triton" in run  # the build fails if NVIDIA triton is still there
    # A regular install of the project's wheel, never an editable one.
    assert "pip install -e" not in run and "--no-deps --no-index /tmp/wheels/xpulora-*.whl" in run
    # Layer order: the dependencies are installed before any project code is copied, so a code or README
    # edit keeps them cached.
    deps_run = next(i for i, (k, a) in enumerate(ins) if k == "RUN" and "requirements.txt" in a)
    first_code = next(i for i, (k, a) in enumerate(ins)
                      if k == "COPY" and {"engine", "README.md"} & set(a.split()[:-1]))
    assert deps_run < first_code
    copies = [a for k, a in ins if k == "COPY" and "--from" not in a]
    assert copies[0] == "pyproject.toml deploy/docker/requirements.py /tmp/xpulora/"
    (health,) = args["HEALTHCHECK"]
    assert json.loads(health.split("CMD", 1)[1].strip()) == ["python", "/opt/xpulora/healthcheck.py"]
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        import tomllib

        assert tomllib.load(f)["project"]["scripts"]["xpulora"] == "server.cli:main"


def test_dockerfile_has_no_unexplained_hadolint_ignore() -> None:
    for line in DOCKERFILE.read_text().splitlines():
        if "hadolint ignore=" in line:
            assert re.search(r"hadolint ignore=\S+ # \S.{20,}", line), f"an ignore without its reason: {line}"


def test_docker_test_script_is_sound() -> None:
    script = REPO_ROOT / "tools" / "docker_test.sh"
    assert os.access(script, os.X_OK)
    proc = subprocess.run([_tool("shellcheck"), str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tools/docker_test.sh" in (REPO_ROOT / "Makefile").read_text()


def _dockerignore_includes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            included = neg
    return included


def test_dockerignore_lets_in_what_the_dockerfile_copies() -> None:
    patterns = [ln.strip() for ln in (REPO_ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    sources: list[str] = []
    for ins, arg in _instructions():
        if ins == "COPY" and "--from" not in arg:
            sources += shlex.split(arg)[:-1]
    assert {"engine", "kernels", "server", "demo/model", "demo/adapters", "configs", "pyproject.toml",
            "README.md"} <= {s.rstrip("/") for s in sources}
    needed: list[str] = []
    for src in sources:
        p = REPO_ROOT / src
        assert p.exists(), src
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
        needed += [f.relative_to(REPO_ROOT).as_posix() for f in files]
    needed = [n for n in needed if not n.startswith(("demo/make_demo", "demo/README", "demo/prompts"))]
    assert any(n.startswith("demo/model/") for n in needed) and any(n.startswith("demo/adapters/") for n in needed)
    left_out = [n for n in needed if not _dockerignore_includes(n, patterns)]
    assert not left_out, f".dockerignore excludes files the Dockerfile copies: {left_out[:10]}"
    for junk in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "engine/__pycache__/config.cpython-311.pyc",
                 "benchmarks/run.py", "demo/make_demo.py"):
        assert not _dockerignore_includes(junk, patterns), junk


# -- README ---------------------------------------------------------------------------------------------------
def _subparser(name: str) -> argparse.ArgumentParser:
    p = build_parser([name])
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flag_name(action: argparse.Action) -> str:
    if action.option_strings:
        return max(action.option_strings, key=len)
    return action.metavar or action.dest.upper()


def _table(md: str, heading: str) -> dict[str, list[str]]:
    assert heading in md, f"README has no section {heading!r}"
    section = md.split(heading, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name = cells[0].strip("`")
            assert name not in rows, f"{name} twice in {heading}"
            rows[name] = cells
    return rows


def _check_table(command: str, heading: str) -> None:
    rows = _table(README.read_text(), heading)
    actions = [a for a in _subparser(command)._actions if not isinstance(a, argparse._HelpAction)]
    assert sorted(rows) == sorted(_flag_name(a) for a in actions), \
        f"README table vs `xpulora {command} --help`: only in README {sorted(set(rows) - {_flag_name(a) for a in actions})}, " \
        f"only in the parser {sorted({_flag_name(a) for a in actions} - set(rows))}"
    for a in actions:
        name = _flag_name(a)
        _, default, meaning = rows[name]
        literals = re.findall(r"`([^`]*)`", default)
        if a.nargs == 0:
            want = "on" if a.default == a.const else "off"
            assert default == want, f"{name}: default {default!r}, the parser says {want}"
        elif a.required:
            assert default == "required", name
        elif a.default in (None, [], ()):
            assert not literals, f"{name}: the parser has no default value, the README says {default!r}"
        else:
            assert literals and literals[0] == str(a.default), f"{name}: README default {default!r}, parser {a.default!r}"
        for choice in a.choices or ():
            assert str(choice) in meaning or str(choice) in default, f"{name}: choice {choice!r} not described"
        assert len(meaning) > 10, f"{name}: no description"


def test_readme_serve_flag_table_matches_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XPULORA_API_KEY", raising=False)
    monkeypatch.delenv("XPULORA_HOST", raising=False)
    _check_table("serve", "## `xpulora serve` flags")


def test_readme_quantize_flag_table_matches_the_parser() -> None:
    _check_table("quantize", "## `xpulora quantize` flags")


def test_readme_keeps_its_opening() -> None:
    lines = README.read_text().splitlines()
    assert lines[0] == "# xpulora"
    first_block = README.read_text().split("```", 2)[1]
    assert first_block.startswith("bash\nmake serve") and "\nmake test" in first_block


def test_readme_names_every_demo_adapter_and_preset() -> None:
    text = README.read_text()
    for adapter in (p.name for p in DEMO_ADAPTERS.iterdir() if (p / "adapter_config.json").is_file()):
        assert f"`{adapter}`" in text, adapter
    for preset in (REPO_ROOT / "configs").glob("*.yaml"):
        assert f"configs/{preset.name}" in text, preset.name


# -- command lines in README and docs -----------------------------------------------------------------
def _command_lines(md: Path) -> list[str]:
    """Logical lines of the fenced code blocks (continuations joined, `#`-commented commands uncommented)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", md.read_text(), flags=re.S)
    lines: list[str] = []
    for block in blocks:
        buf = ""
        for raw in block.splitlines():
            line = re.sub(r"^#\s+(\.\.\. )?", "", raw.strip()) if re.match(r"#\s+(\.\.\. )?(docker|xpulora)", raw.strip()) \
                else raw.strip()
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            lines.append(buf + line)
            buf = ""
    return lines


def _xpulora_invocation(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) if these tokens run the xpulora CLI (directly or as the image's entrypoint)."""
    for i, tok in enumerate(tokens):
        if Path(tok).name == "xpulora" and i + 1 < len(tokens) and tokens[i + 1] in ("serve", "generate", "quantize"):
            if i > 0 and tokens[i - 1] == "--entrypoint":
                j = tokens.index("xpulora:xpu") if "xpulora:xpu" in tokens else tokens.index("xpulora:cpu")
                return tokens[j + 1], tokens[j + 2:]
            return tokens[i + 1], tokens[i + 2:]
        if re.fullmatch(r"xpulora:(xpu|cpu)", tok) and (tokens[:2] == ["docker", "run"] or i == 0):
            if "--entrypoint" in tokens:
                entry = tokens[tokens.index("--entrypoint") + 1]
                if entry != "xpulora":
                    return None
                return tokens[i + 1], tokens[i + 2:]
            return "serve", tokens[i + 1:]
    return None


def test_every_documented_command_line_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # presets are named relative to the checkout (and to /opt/xpulora in the image)
    checked = 0
    for md in _markdown_files():
        for line in _command_lines(md):
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue
            found = _xpulora_invocation(tokens)
            if found is None:
                continue
            command, args = found
            argv = [command, *args]
            try:
                build_parser(argv).parse_args(argv)
            except SystemExit as e:
                pytest.fail(f"{md.name}: `{line}` does not parse as `xpulora {command}` (exit {e.code})")
            checked += 1
    assert checked >= 15, f"only {checked} command lines found"


def test_two_gpu_run_line_sets_the_oneccl_environment() -> None:
    lines = [ln for ln in _command_lines(README) if ln.startswith("docker run") and "--tensor-parallel-size 2" in ln]
    assert lines, "README has no two-GPU docker run line"
    for var in ONECCL_ENV:
        assert f"-e {var}=" in lines[0], var
    # The render group by the host's id of the device node: a group name resolves inside the image.
    gpu = '--device /dev/dri --group-add "$(stat -c %g /dev/dri/renderD128)"'
    for needed in ("--device /dev/dri", '--group-add "$(stat -c %g /dev/dri/renderD128)"', "/dev/dri/by-path"):
        assert needed in lines[0], needed
    one = [ln for ln in _command_lines(README) if ln.startswith("docker run") and "xpulora:xpu /models/Qwen3-8B" in ln]
    assert one and gpu in one[0]
    for md in _markdown_files():  # no command line whose group works only by chance
        assert not [ln for ln in _command_lines(md) if "--group-add render" in ln], md.name
    cpu = [ln for ln in _command_lines(README) if ln.startswith("docker run") and "xpulora:cpu" in ln]
    assert cpu
    deploy = (DOCS / "deploy-intel-gpu.md").read_text()
    for needed in (*ONECCL_ENV, "xccl", "oneccl_bindings_for_pytorch", "intel_extension_for_pytorch", "render",
                   "end-of-life", "--tensor-parallel-size"):
        assert needed in deploy, needed


# -- docs/ ------------------------------------------------------------------------------------------------------
def test_docs_exist_and_links_resolve() -> None:
    for name in ("deploy-intel-gpu.md", "adapters.md", "metrics.md", "troubleshooting.md", "docker.md"):
        assert (DOCS / name).is_file(), name
    for md in _markdown_files():
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", md.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (md.parent / target).exists(), f"{md.name}: broken link {target}"


def test_metrics_doc_lists_every_series() -> None:
    source = (REPO_ROOT / "server" / "metrics.py").read_text()
    names = re.findall(r'P \+ "([a-z_]+)"', source)
    assert len(names) >= 10
    doc = (DOCS / "metrics.md").read_text()
    missing = [n for n in names if f"`xpulora:{n}" not in doc]
    assert not missing, f"docs/metrics.md does not list {missing}"


def test_troubleshooting_names_the_seed_errors_and_real_messages() -> None:
    doc = (DOCS / "troubleshooting.md").read_text()
    for message in SEED_MESSAGES:
        assert message in doc, message
    markers = re.findall(r"<!-- src: (\S+) \| (.+?) -->", doc)
    assert len(markers) >= 30
    for path, fragment in markers:
        assert fragment in (REPO_ROOT / path).read_text(), f"troubleshooting.md quotes {fragment!r}, not in {path}"


def test_docker_doc_is_honest_and_the_smoke_script_is_sound() -> None:
    doc = (DOCS / "docker.md").read_text()
    # What was run, and what was not: make docker-test's summary and the XPU build's stopping point.
    for needed in ("make docker-test", "docker-test [", "PASSED in", "Image size", "Intel GPU", "not run",
                   "docs/smoke.sh", '--group-add "$(stat -c %g /dev/dri/renderD128)"'):
        assert needed in doc, needed
    smoke = DOCS / "smoke.sh"
    assert os.access(smoke, os.X_OK), "docs/smoke.sh must be executable"
    text = smoke.read_text()
    for route in ("/health", "/v1/models", "/v1/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert route in text, route
    proc = subprocess.run([_tool("shellcheck"), str(smoke)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
