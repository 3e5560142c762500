"""The import graph of moejax and launch: no circles, and every import follows the layer order below.

Every `import` and `from ... import` counts, at the top of a module, inside a function or under `TYPE_CHECKING`, read
from the source; `from package import name` counts as importing the submodule `package.name` where there is one, else
the package. Imports inside functions are kept for optional dependencies only (those not in `[project.dependencies]`),
each with a comment saying so."""
import ast
import importlib.metadata
import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("moejax", "launch")

# The layers, bottom first: a unit imports only units in its own layer or below it. Units in one layer may import each
# other (the circles test still forbids circles between their modules).
LAYERS: list[tuple[str, ...]] = [
    ("config", "options", "buckets", "compiles", "row_tiles", "sampling", "chat", "layout"),
    ("kernels",),
    ("models",),
    ("steps",),
    ("costs",),
    ("offload",),
    ("plan",),
    ("sharding",),
    ("lightning",),
    ("placements",),
    ("presets", "weights"),
    ("engine",),
    ("measure",),
    ("loading",),
    ("moejax",),  # the package's __init__: the public API
    ("requests",),
    ("sched",),
    ("replicas",),
    ("serving",),  # launch.serve's library: loading an engine from flags, output paths, replicated runs
    ("eval", "train"),
    ("launch",),
]

# Root modules and folders that sit in a layer named differently from themselves (none today)
UNIT_OF: dict[str, str] = {}


def unit(module: str) -> str:
    """The layer unit of a module of moejax or launch: its first folder or root module below the package."""
    parts = module.split(".")
    if parts[0] == "launch":
        return "launch"
    if len(parts) == 1:
        return "moejax"
    return UNIT_OF.get(parts[1], parts[1])


def _modules() -> dict[str, str]:
    mods = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = path
    return mods


def _parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read())


def _absolute(node: ast.ImportFrom, name: str, path: str) -> str:
    """The module an `ImportFrom` names, relative imports resolved against the importing module `name`."""
    if node.level == 0:
        return node.module or ""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(node, name, path)
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    deps.add(sub if sub in mods else known(module))
            elif isinstance(node, ast.Import):
                deps.update(known(alias.name) for alias in node.names)
        graph[name] = {d for d in deps if d and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]], unit_of=unit) -> list[str]:
    """Every import of a unit from a layer above its own, as 'importer -> imported (unit < unit)'."""
    height = {u: i for i, layer in enumerate(layers) for u in layer}
    found = []
    for importer, deps in sorted(graph.items()):
        for dep in sorted(deps):
            low, high = unit_of(importer), unit_of(dep)
            if height[high] > height[low]:
                found.append(f"{importer} -> {dep} ({low} below {high})")
    return found


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_moejax_and_launch_import_without_circles():
    graph = import_graph()
    assert "moejax.kernels.backends" in graph and "launch.bench" in graph  # the walk found the packages
    assert circles(graph) == []


def test_upward_imports_are_found():
    layers = [("a", "b"), ("c",)]
    graph = {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}
    assert layer_violations(graph, layers, unit_of=lambda m: m) == ["a -> c (a below c)"]


def test_every_unit_has_a_layer():
    units = {unit(m) for m in import_graph()}
    declared = [u for layer in LAYERS for u in layer]
    assert len(declared) == len(set(declared))
    assert units <= set(declared), sorted(units - set(declared))


def test_imports_follow_the_layers():
    assert layer_violations(import_graph(), LAYERS) == []


def _declared_dependencies() -> set[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return {_normalized(re.match(r"[A-Za-z0-9_.\-]+", d).group()) for d in deps}


def _normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _optional(module: str, declared: set[str], distributions: dict[str, list[str]],
              optional_here: frozenset[str] = frozenset()) -> bool:
    """Whether importing `module` needs an optional dependency: one neither in the standard library nor declared (by
    the installed distribution that provides it, else by its own name), or a module of this project that imports one
    at its top (`optional_here`)."""
    top = module.split(".")[0]
    if top in PACKAGES:
        return module in optional_here
    if top in sys.stdlib_module_names:
        return False
    return not ({_normalized(d) for d in distributions.get(top, [])} | {_normalized(top)}) & declared


def _top_level_imports(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def optional_modules(declared: set[str], distributions: dict[str, list[str]]) -> frozenset[str]:
    """This project's modules that import an optional dependency at their top."""
    return frozenset(name for name, path in _modules().items()
                     if any(_optional(m, declared, distributions) for m in _top_level_imports(_parse(path))))


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _local_imports(tree: ast.Module, modules: frozenset[str] = frozenset()):
    """Imports inside function bodies or under `if TYPE_CHECKING:`: (node, the modules each imports: for `from package
    import name`, the submodule package.name where `modules` has it)."""
    seen = set()
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _type_checking(scope):
            for node in ast.walk(scope):
                if id(node) in seen:
                    continue
                seen.add(id(node))
                if isinstance(node, ast.Import):
                    yield node, [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    module = (node.module or "") if node.level == 0 else "moejax"
                    yield node, [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                                 for a in node.names]


def local_import_findings() -> list[str]:
    declared = _declared_dependencies()
    distributions = importlib.metadata.packages_distributions()
    modules = _modules()
    optional_here = optional_modules(declared, distributions)
    found = set()
    for path in modules.values():
        with open(path) as f:
            lines = f.read().splitlines()
        for node, imported in _local_imports(ast.parse("\n".join(lines)), frozenset(modules)):
            where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
            if not all(_optional(m, declared, distributions, optional_here) for m in imported):
                found.add(f"{where}: {', '.join(imported)} is imported at the top of the module, not in a function")
            elif "#" not in lines[node.lineno - 1] and not lines[node.lineno - 2].lstrip().startswith("#"):
                found.add(f"{where}: an optional dependency's import inside a function says why in a comment")
    return sorted(found)


def test_optional_dependencies_are_told_apart():
    declared = _declared_dependencies()
    distributions = importlib.metadata.packages_distributions()
    assert {"jax", "numpy", "orbax-checkpoint"} <= declared
    assert not _optional("orbax", declared, distributions) and not _optional("json", declared, distributions)
    assert not _optional("moejax", declared, distributions) and not _optional("jax.numpy", declared, distributions)
    assert _optional("ray", declared, distributions) and _optional("vllm.config", declared, distributions)
    assert optional_modules(declared, distributions) == {  # they import lm-eval, and pytest (a plugin of the tests)
        "moejax.eval.lm_eval_model", "launch.bench.pytest_outcomes"}


def test_imports_inside_functions_are_found():
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    import jax.numpy\ndef f():\n    import ray\n"
                     "    from moejax.eval import lm_eval_model, scoring\n")
    found = [imported for _, imported in _local_imports(tree, frozenset({"moejax.eval.lm_eval_model"}))]
    assert found == [["jax.numpy"], ["ray"], ["moejax.eval.lm_eval_model", "moejax.eval"]]


def test_imports_inside_functions_are_optional_dependencies_with_a_comment():
    assert local_import_findings() == []


def test_the_design_page_lists_the_same_layers():
    """docs/design.md's numbered list under "The folders are layers" names each layer's units, in this order."""
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        text = f.read().split("## The folders are layers", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. \*\*(.+?)\*\*", text, re.M)
    listed = [tuple("moejax" if n == "moejax/__init__" else n for n in re.findall(r"`([\w/]+)`", item))
              for item in items]
    assert listed == LAYERS
