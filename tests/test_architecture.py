"""The import graph of ragen_jax/ and envs/ (parsed with ``ast``, nothing is imported): no cycle, every
import points the way docs/architecture.md draws it, and no import inside a function between the
package's own modules except the optional heavy ones and the CLI's deferred start-up."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("ragen_jax", "envs")

# Who may import whom. Keys are groups: a sub-package of ragen_jax ("rollout" = ragen_jax/rollout/), the
# top-level modules "main" and "export", and "envs". Values: groups, or single modules (full dotted
# names) where one module of a group is allowed and the rest is not. Imports inside a group are free
# (the module-level cycle check still applies). docs/architecture.md draws this graph.
ALLOWED: dict[str, set[str]] = {
    "models": set(),
    "envs": {"ragen_jax.models.tokenizers"},  # the tokenizer interface, nothing else of ragen_jax
    "sampling": {"models"},
    "rollout": {"models", "sampling", "envs"},
    "rl": {"models", "sampling", "rollout"},
    "diagnostics": {"models", "sampling", "rollout", "rl"},
    "parallel": {"models", "sampling", "rollout", "rl"},  # sharded wrappers of the rollout and the update
    "setup": {"models", "envs"},
    # The warm start writes its cache with the trainer's Checkpointer (one orbax saver for the package).
    "sft": {"models", "envs", "sampling", "rollout", "rl", "setup", "parallel", "ragen_jax.train.checkpoint"},
    "train": {"models", "envs", "sampling", "rollout", "rl", "diagnostics", "parallel", "setup", "sft"},
    # Export reads checkpoints as the trainer writes them (its one-line damage reports too).
    "export": {"models", "setup", "ragen_jax.parallel.distributed", "ragen_jax.train.checkpoint"},
    "api": {"models", "envs", "diagnostics", "parallel", "setup", "sft", "train", "export"},
    "main": {"models", "envs", "sampling", "rollout", "rl", "diagnostics", "parallel", "setup", "sft", "train",
             "api"},
}

# Imports allowed inside a function body (the only ones).
# Optional heavy modules, lazily by anyone: they run only with model.hf_path / model.gguf_path (and pull
# in safetensors / tokenizers / GGUF parsing), or draw plots (matplotlib).
LAZY_HEAVY = {
    "ragen_jax.models.hf_io",
    "ragen_jax.models.hf_tokenizer",
    "ragen_jax.models.gguf",
    "ragen_jax.train.plots",
}
# The CLI's start-up: main checks the config before anything imports JAX (a bad key exits in a fraction
# of a second) and calls jax.distributed.initialize before anything touches a JAX backend (importing
# envs/ creates arrays); config_check is what main imports first. The Python API (api.py) likewise
# initialises multi-host JAX in ``api.train`` before it imports what builds a run.
LAZY_CLI = {
    "ragen_jax.main": None,  # None: any module of the package
    "ragen_jax.api": None,
    "ragen_jax.setup.config_check": {"ragen_jax.models.config"},
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module (or package), dotted
    line: int
    in_function: bool

    def where(self, files: dict[str, str]) -> str:
        return f"{files[self.source]}:{self.line} ({self.source} imports {self.target})"


def module_files(repo: str = REPO) -> dict[str, str]:
    """dotted module name -> path relative to the repository, for every .py file under ROOTS."""
    out = {}
    for root in ROOTS:
        for folder, dirs, files in os.walk(os.path.join(repo, root)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, name), repo)
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = rel
    return out


def is_package(module: str, files: dict[str, str]) -> bool:
    return files[module].endswith("__init__.py")


def imports_of(module: str, source: str, files: dict[str, str]) -> list[Import]:
    """The imports of the package's own modules in ``source`` (resolved to modules where they name one)."""
    tree = ast.parse(source)
    found: list[Import] = []
    package = module if is_package(module, files) else module.rpartition(".")[0]

    def add(target: str, node: ast.AST, depth: int) -> None:
        if target.split(".")[0] in ROOTS and target not in ROOTS:
            found.append(Import(module, target, node.lineno, depth > 0))

    def visit(node: ast.AST, depth: int) -> None:
        for child in ast.iter_child_nodes(node):
            inner = depth + isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child, depth)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")
                    up = up[: len(up) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    add(sub if sub in files else base, child, depth)
            visit(child, inner)

    visit(tree, 0)
    return found


def group_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "envs":
        return "envs"
    return parts[1] if len(parts) > 1 else parts[0]


def allowed(imp: Import) -> bool:
    src, dst = group_of(imp.source), group_of(imp.target)
    if src == dst:
        return True
    rule = ALLOWED[src]
    return dst in rule or any(imp.target == m or imp.target.startswith(m + ".") for m in rule if "." in m)


def lazy_allowed(imp: Import) -> bool:
    if imp.target in LAZY_HEAVY:
        return True
    if imp.source in LAZY_CLI:
        targets = LAZY_CLI[imp.source]
        return targets is None or imp.target in targets
    return False


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def all_imports(repo: str = REPO) -> tuple[dict[str, str], list[Import]]:
    files = module_files(repo)
    out = []
    for module, rel in files.items():
        with open(os.path.join(repo, rel), encoding="utf-8") as f:
            out.extend(imports_of(module, f.read(), files))
    return files, out


@pytest.fixture(scope="module")
def graph():
    return all_imports()


def test_every_module_belongs_to_a_group_of_the_rule(graph):
    files, _ = graph
    unknown = sorted(m for m in files if m not in ROOTS and group_of(m) not in ALLOWED)
    assert not unknown, (f"{unknown}: a new sub-package or top-level module; add it to ALLOWED here and to "
                         "docs/architecture.md")


def test_no_import_cycle(graph):
    files, imports = graph
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target in files:
            edges.setdefault(imp.source, set()).add(imp.target)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_rule_itself_points_one_way():
    edges = {src: {d for d in dst if "." not in d} for src, dst in ALLOWED.items()}
    assert find_cycle(edges) is None


def test_imports_point_the_allowed_way(graph):
    files, imports = graph
    wrong = [f"{imp.where(files)}: {group_of(imp.source)} may import only {sorted(ALLOWED[group_of(imp.source)])}"
             for imp in imports if not allowed(imp)]
    assert not wrong, "imports against the layout rule (docs/architecture.md):\n" + "\n".join(wrong)


def test_no_function_level_import_of_package_modules(graph):
    files, imports = graph
    lazy = [imp.where(files) for imp in imports if imp.in_function and not lazy_allowed(imp)]
    assert not lazy, ("imports inside a function (move them to the top of the module; only the optional "
                      "heavy ones and the CLI's start-up may stay, see LAZY_HEAVY / LAZY_CLI):\n" + "\n".join(lazy))


def test_the_checks_catch_what_they_should(tmp_path):
    """The checker on a small synthetic package: a cycle, a wrong-way import and a lazy import."""
    pkg = tmp_path / "ragen_jax"
    for sub in ("models", "rl"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("from ragen_jax.rl.b import x\n")
    (pkg / "rl" / "b.py").write_text("from ragen_jax.models import a\n\ndef f():\n    from . import c\n")
    (pkg / "rl" / "c.py").write_text("")
    (tmp_path / "envs").mkdir()
    files, imports = all_imports(str(tmp_path))
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.source, set()).add(imp.target)
    assert find_cycle(edges) == ["ragen_jax.models.a", "ragen_jax.rl.b", "ragen_jax.models.a"]
    assert [imp.target for imp in imports if not allowed(imp)] == ["ragen_jax.rl.b"]
    assert [(imp.target, imp.line) for imp in imports if imp.in_function and not lazy_allowed(imp)] == [
        ("ragen_jax.rl.c", 4)]


def test_no_script_directory_shadows_a_top_level_package():
    """benchmarks/ and tests/configs/ go onto sys.path (scripts, tests), and spawned worker processes
    inherit that path: a module there named like a top-level package (``envs``) would replace it."""
    top_level = {name for name in os.listdir(REPO) if os.path.isdir(os.path.join(REPO, name, ""))
                 and os.path.exists(os.path.join(REPO, name, "__init__.py"))}
    assert {"ragen_jax", "envs"} <= top_level
    for script_dir in ("benchmarks", os.path.join("tests", "configs")):
        modules = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(REPO, script_dir)) if f.endswith(".py")}
        assert not modules & top_level, (script_dir, modules & top_level)
