"""The import graph of dflash_zoo: no circles, imports that point down the layers only, no private name taken
from another module of the CUDA wing, and engines built in one place (engine/factory.py).

Read from the source (ast), not by importing: an import inside a function counts as an edge too, except where
a rule below says otherwise; an import under `if TYPE_CHECKING:` does not (it never runs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_zoo"

# lowest first; a module may import its own layer and the layers below. The longest matching prefix places a
# module (`dflash_zoo.cuda.ops` below `dflash_zoo.engine`, `dflash_zoo.cuda.static` above it).
LAYERS = [
    # the package root (its exports resolve lazily, by name), errors, output, paths, the transformers shim
    (
        "dflash_zoo",
        "dflash_zoo.errors",
        "dflash_zoo.output",
        "dflash_zoo.paths",
        "dflash_zoo.compat",
        "dflash_zoo.demo",
    ),
    ("dflash_zoo.cuda", "dflash_zoo.cuda.ops"),  # kernels and their torch forms: no models, no engines
    # what each target family declares; what a quantized target's config says (adapters load by it)
    ("dflash_zoo.adapters", "dflash_zoo.quantization"),
    # the engine interface, the eager engine, the drafters and their checkpoint formats
    ("dflash_zoo.engine", "dflash_zoo.drafters", "dflash_zoo.formats"),
    ("dflash_zoo.cuda.static", "dflash_zoo.cuda.placement"),  # the static engine; multi-GPU placement
    ("dflash_zoo.zoo", "dflash_zoo.sources"),  # registry, Hub client, check, serving commands; model sources
    ("dflash_zoo.pipeline", "dflash_zoo.loading", "dflash_zoo.api"),  # the Python API
    ("dflash_zoo.training",),  # the trainer and `eval`, over the API's loading
    ("dflash_zoo.bench",),  # bench builds on the API (a real pair loads through `api.load`) and eval's data
    ("dflash_zoo.commands", "dflash_zoo.cli", "dflash_zoo.__main__"),  # the CLI
]
# the one import that reaches up, made when an engine is built (engine/factory.py's docstring)
UPWARD = {("dflash_zoo.engine.factory", "dflash_zoo.cuda.static.fast")}
ENGINE_CLASSES = re.compile(r"(?<!class )\b(FastEngine|EagerEngine)\(")
# where an engine may be constructed: the factory, and the modules that define the two engines
ENGINE_BUILDERS = {
    "dflash_zoo/engine/factory.py",
    "dflash_zoo/engine/decode.py",
    "dflash_zoo/cuda/static/fast.py",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "adapters":  # installed as dflash_zoo.adapters (pyproject's package-dir)
        parts = ["dflash_zoo", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "adapters").glob("*.py")]
    return {_module_name(p): p for p in files}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, list[str], bool]]:
    """(imported module, names taken from it, at module level) for every dflash_zoo import that runs."""
    found: list[tuple[str, list[str], bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, [], top) for a in child.names if a.name.startswith("dflash_zoo"))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module.startswith("dflash_zoo"):
                    names = [a.name for a in child.names]
                    subs = [n for n in names if f"{child.module}.{n}" in modules]  # `from pkg import module`
                    found.extend((f"{child.module}.{n}", [], top) for n in subs)
                    if len(subs) < len(names):
                        found.append((child.module, [n for n in names if n not in subs], top))
            nested = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, nested)

    visit(ast.parse(path.read_text()), True)
    return found


def _layer(module: str) -> int:
    """The layer of the longest prefix that places `module` (the package root places itself only)."""
    best = max(
        (
            (len(p), i)
            for i, names in enumerate(LAYERS)
            for p in names
            if module == p or (p != "dflash_zoo" and module.startswith(p + "."))
        ),
        default=None,
    )
    assert best is not None, f"{module} is in no layer of LAYERS: place it"
    return best[1]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, list[str], bool]]]:
    sources = _sources()
    return {name: _imports(path, set(sources)) for name, path in sources.items()}


def test_the_layers_place_every_module(graph):
    assert len(graph) > 100  # the scan found the package (a wrong root would pass everything below)
    for module in graph:
        _layer(module)


def test_imports_point_down_the_layers(graph):
    """A module imports its own layer or a lower one, at module level or inside a function (an import that
    runs later is still a dependency); the factory's import of the static engine is the one exception."""
    up = [
        f"{src} ({_layer(src)}) imports {dst} ({_layer(dst)})"
        for src, edges in graph.items()
        for dst, _, _ in edges
        if dst in graph and _layer(dst) > _layer(src) and (src, dst) not in UPWARD
    ]
    assert not up, "imports up the layers:\n" + "\n".join(sorted(set(up)))


def test_engine_imports_no_upper_layer_at_module_level(graph):
    """Importing any engine module never loads the CUDA wing, the registry, the trainer, bench or the CLI."""
    upper = (
        "dflash_zoo.cuda",
        "dflash_zoo.zoo",
        "dflash_zoo.commands",
        "dflash_zoo.bench",
        "dflash_zoo.training",
    )
    bad = [
        f"{src} imports {dst}"
        for src, edges in graph.items()
        if src.startswith("dflash_zoo.engine")
        for dst, _, top in edges
        if top and dst.startswith(upper)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_circles(graph):
    """Module-level imports form no circle (a circle forces imports inside functions and an import order)."""
    edges = {src: {d for d, _, top in out if top and d in graph and d != src} for src, out in graph.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := walk(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (circle := walk(start, [start])):
            pytest.fail("import circle: " + " -> ".join(circle))


def test_no_private_name_crosses_a_module_of_the_cuda_wing(graph):
    """A name another module uses is public: `from x import _name` between cuda modules means a helper that
    should be public (or should move)."""
    bad = [
        f"{src} imports {name} from {dst}"
        for src, edges in graph.items()
        if src.startswith("dflash_zoo.cuda")
        for dst, names, _ in edges
        for name in names
        if name.startswith("_") and dst != src
    ]
    assert not bad, "\n".join(bad)


def test_cuda_modules_stay_small():
    """No module of the CUDA wing over ~350 lines (the rooms exist so that none has to be)."""
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in (PACKAGE / "cuda").rglob("*.py")}
    assert len(sizes) > 20 and all(n <= 350 for n in sizes.values()), {
        p: n for p, n in sizes.items() if n > 350
    }


def test_engines_are_built_by_the_factory_only():
    """`FastEngine(` / `EagerEngine(` appear only in the factory and the engines' own modules: every entry
    point (API, CLI, eval, bench) gets its engine from `build_engine`, which chooses it."""
    found = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if str(path.relative_to(ROOT)) not in ENGINE_BUILDERS
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if ENGINE_CLASSES.search(line)
    ]
    assert not found, "\n".join(found)
    assert ENGINE_CLASSES.search("eng = FastEngine(adapter)") and not ENGINE_CLASSES.search(
        "class FastEngine("
    )


def test_the_public_api_exports_what_goes_through_engine_selection():
    import dflash_zoo

    assert "speculative_generate" not in dflash_zoo.__all__
    assert {"load", "Pipeline", "GenerationConfig"} <= set(dflash_zoo.__all__)


def test_the_fast_path_reads_the_environment_in_one_place():
    """`FastOptions.from_env` (engine/options.py) is the only reader of the environment in the engines, the
    CUDA wing and bench: everything below takes the options, or the fields it needs, as arguments."""
    reads = re.compile(r"os\.environ|os\.getenv|getenv\(")
    places = [PACKAGE / "cuda", PACKAGE / "engine", PACKAGE / "bench"]
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for place in places
        for path in place.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if reads.search(line)
    ]
    assert found and {f.partition(":")[0] for f in found} == {"dflash_zoo/engine/options.py"}, found
