"""pyproject.toml is the one list of dependencies: the requirements files only install the project with its
extras, every third-party import of the package is declared there, and the README's commands (and
.ci/run) install through them. Parsed from the files, no network."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_PARTY = {"ragen_jax", "envs", "configs"}
# Imported only by modules that --config.model.gguf_path loads: declared in that extra.
OPTIONAL_IMPORTS = {"gguf": "gguf"}
# `pip install -r FILE` lines: comments, -r other files, and this project (editable) with extras.
_PROJECT_LINE = re.compile(r"^-e \.(\[(?P<extras>[a-z0-9_,-]+)\])?$")


def pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def declared(extra: str | None = None) -> dict[str, Requirement]:
    """canonical distribution name -> Requirement, of the dependencies (or of one extra)."""
    project = pyproject()
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def requirement_lines(name: str) -> list[str]:
    with open(os.path.join(REPO, name)) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def installed_extras(name: str) -> set[str]:
    """The extras of this project that `pip install -r name` installs (None when it does not install it)."""
    extras = set()
    for line in requirement_lines(name):
        if line.startswith("-r "):
            extras |= installed_extras(line[3:].strip())
            continue
        match = _PROJECT_LINE.match(line)
        assert match, (f"{name}: {line!r} is not this project (-e .[extras]) or -r FILE; declare dependencies "
                       "in pyproject.toml, the one list")
        extras |= set((match["extras"] or "").split(",")) - {""}
    return extras


def third_party_imports() -> dict[str, str]:
    """Top-level module -> 'path:line' of its first import, for every module that is neither the standard
    library nor this repository's, imported anywhere in the installed packages."""
    found = {}
    for root in sorted(FIRST_PARTY):
        for folder, dirs, files in os.walk(os.path.join(REPO, root)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        modules = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0:
                        modules = [node.module]
                    else:
                        continue
                    for module in modules:
                        top = module.split(".")[0]
                        if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                            found.setdefault(top, f"{os.path.relpath(path, REPO)}:{node.lineno}")
    return found


def test_requirement_files_install_only_the_project():
    assert installed_extras("requirements.txt") == set()
    assert installed_extras("requirements-test.txt") == {"test"}


def test_every_extra_the_requirement_files_name_exists():
    extras = pyproject()["optional-dependencies"]
    for name in ("requirements.txt", "requirements-test.txt"):
        assert installed_extras(name) <= set(extras), name


def test_every_requirement_parses_and_has_a_range():
    """Each dependency has an upper bound or a pin where the README promises compatibility (jax < 0.12
    for gymnax 1.0.1), and extras name real extras."""
    project = pyproject()
    for extra in (None, *project["optional-dependencies"]):
        for name, req in declared(extra).items():
            if name == canonicalize_name(project["name"]):
                assert req.extras <= set(project["optional-dependencies"]), req
                continue
            assert str(req.specifier), f"{req} has no version range"
    for name in ("jax", "jaxlib"):
        assert not declared()[name].specifier.contains("0.12"), "gymnax 1.0.1 requires jax < 0.12"


def test_accelerator_extras_keep_the_jax_range():
    base = declared()["jax"].specifier
    for extra, jax_extra in (("cuda", "cuda12"), ("tpu", "tpu")):
        req = declared(extra)["jax"]
        assert jax_extra in req.extras and req.specifier == base, (extra, str(req))


def test_test_extra_includes_gguf():
    """The GGUF tests need it, and the README's test command installs only requirements-test.txt."""
    test = declared("test")[canonicalize_name(pyproject()["name"])]
    assert "gguf" in test.extras
    assert "gguf" in declared("gguf")


def test_every_third_party_import_is_declared():
    runtime = set(declared())
    providers = importlib.metadata.packages_distributions()
    for top, where in third_party_imports().items():
        if top in OPTIONAL_IMPORTS:
            assert canonicalize_name(top) in declared(OPTIONAL_IMPORTS[top]), f"{where}: {top} not in its extra"
            continue
        dists = {canonicalize_name(d) for d in providers.get(top, [])}
        assert dists, f"{where}: imports {top!r}, which no installed distribution provides"
        assert dists & runtime, f"{where}: imports {top!r} (from {sorted(dists)}), not in pyproject's dependencies"


def test_readme_quick_start_installs_through_the_requirement_files():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci_command = f.read().strip().splitlines()[-1]
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert "pip install -q -r requirements.txt" in blocks[0] and "ragen_jax.main" in blocks[0]
    assert blocks[1] == ci_command, ".ci/run must run exactly the README's test command"
    assert "pip install -q -r requirements-test.txt" in ci_command
    assert '.[gguf]' in readme, "the README's gguf_path section names the extra it needs"
