"""The package's shape: layers import only downward, no import cycles, no module-level caches of
compiled functions or import-time compilation, lazy submodules, one cache, names from one place."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import linicl
from linicl import compiled, names

ROOT = pathlib.Path(linicl.__file__).parent

# Rank of each top-level part of linicl: a module may import only parts of lower or equal rank
# (equal: within its own layer, where the cycle check below still applies).
RANKS = {
    "errors": 0, "names": 0,
    "_validate": 1, "metrics": 1, "timing": 1, "compiled": 1, "parallel": 1, "checkpoint": 1, "reporting": 1,
    "stats": 1, "precision": 1,
    "kernels": 1,
    "config": 2,  # ModelConfig.feature_dim asks the kernels
    "nn": 3,
    "data": 4, "lm": 4, "interventions": 4, "generation": 4,
    "batching": 5, "activations": 5, "evaluate": 5, "memory": 5, "training": 5, "fidelity": 5, "recovery": 5,
    "selection": 5,
    "iclca": 6, "implicit": 6, "routing": 6, "diagnostics": 6, "linearize": 6, "capacity": 6, "approx": 6,
    "bias_training": 6, "prompt_file": 6,
    "verify": 7, "benchmarking": 7, "cli": 8,
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set:
    """Every linicl module a file imports, at module level or inside functions."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("linicl")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("linicl"):
                found.add(base)
                # "from linicl import iclca" imports the submodule linicl.iclca
                found |= {f"{base}.{a.name}" for a in node.names if (ROOT.parent / base.replace(".", "/") / a.name).exists()
                          or (ROOT.parent / base.replace(".", "/") / f"{a.name}.py").exists()}
    return found


def _graph() -> dict:
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    graph = {}
    for f in files:
        me = _module_name(f)
        # An import of a package also runs its __init__; keep only edges to real modules, not to parents
        # of the importer (a submodule importing its own package's name space is the package itself).
        graph[me] = {m for m in _imports(f) if m in modules and m != me and not me.startswith(m + ".")
                     and m != "linicl"}
    return graph


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_every_part_has_a_rank():
    parts = {_part(m) for m in _graph()} - {""}
    assert parts <= set(RANKS), f"add {sorted(parts - set(RANKS))} to RANKS (and think about where they sit)"


def test_nothing_imports_upward():
    bad = [(m, d) for m, deps in _graph().items() for d in deps
           if _part(m) and _part(d) and RANKS[_part(d)] > RANKS[_part(m)]]
    assert not bad, f"upward imports: {bad}"


def test_no_import_cycles():
    graph = _graph()
    state: dict = {}
    cycles = []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_kernels_are_plain_jnp():
    for f in (ROOT / "kernels").rglob("*.py"):
        text = f.read_text()
        assert "flax" not in text, f"{f.name} imports flax: kernels are plain jax.numpy"


def test_no_module_level_compiled_caches_or_import_time_compilation():
    for f in ROOT.rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    text = ast.unparse(dec)
                    assert "lru_cache" not in text and text not in ("functools.cache", "cache"), \
                        f"{f.name}:{node.lineno} caches with {text}; use linicl.compiled"
        for node in tree.body:  # statements that run at import time (not the bodies of defs/lambdas)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if any(isinstance(c, ast.Call) and ast.unparse(c.func) in ("jax.jit", "jit")
                   for c in _walk_outside_lambdas(node)):
                pytest.fail(f"{f.name}:{node.lineno} compiles at import time")


def _walk_outside_lambdas(node):
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.Lambda):
            yield from _walk_outside_lambdas(child)


def _calls(tree, names) -> list:
    return [c for c in ast.walk(tree) if isinstance(c, ast.Call) and ast.unparse(c.func) in names]


def test_library_code_does_not_flip_global_jax_flags():
    for f in ROOT.rglob("*.py"):
        if f.name == "cli.py":  # the entry point owns its process
            continue
        tree = ast.parse(f.read_text())
        calls = _calls(tree, ("jax.config.update", "config.update"))
        if f.name == "compiled.py":  # only inside the explicit opt-in that entry points call
            opt_in = next(d for d in ast.walk(tree) if isinstance(d, ast.FunctionDef)
                          and d.name == "enable_persistent_cache")
            calls = [c for c in calls if c not in list(ast.walk(opt_in))]
        assert not calls, f"{f.name}:{calls[0].lineno} changes a global JAX flag"
        if f.name not in ("cli.py", "compiled.py"):
            used = _calls(tree, ("enable_persistent_cache", "compiled.enable_persistent_cache"))
            assert not used, f"{f.name}:{used[0].lineno}: library code turns on the persistent cache"


def test_import_linicl_is_lazy_and_exposes_every_submodule():
    code = ("import sys, linicl; heavy = [m for m in ('linicl.routing', 'linicl.implicit', 'linicl.evaluate', "
            "'linicl.iclca', 'linicl.lm') if m in sys.modules]; print(heavy); "
            "import linicl as L; print(L.routing.__name__, L.implicit.__name__, L.evaluate.__name__, L.lm.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    first, second = out.strip().splitlines()
    assert first == "[]", f"import linicl loaded {first}"
    assert second.split() == ["linicl.routing", "linicl.implicit", "linicl.evaluate", "linicl.lm"]
    for name in linicl.SUBMODULES:
        assert getattr(linicl, name).__name__ == f"linicl.{name}"
    with pytest.raises(AttributeError):
        linicl.no_such_module


def test_the_function_cache_is_bounded_clearable_and_reuses_entries():
    cache = compiled.FunctionCache(maxsize=2)
    built = []

    def build(tag):
        built.append(tag)
        return lambda: tag
    a = cache.get("a", lambda: build("a"))
    assert cache.get("a", lambda: build("again")) is a and built == ["a"]
    cache.get("b", lambda: build("b"))
    cache.get("a", lambda: build("x"))  # "a" is now the most recent
    cache.get("c", lambda: build("c"))  # evicts "b", the least recently used
    assert "a" in cache and "c" in cache and "b" not in cache and len(cache) == 2
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError):
        cache.maxsize = 0


def test_library_functions_reuse_their_compiled_function():
    cfg = linicl.preset("tiny-linear", dtype="float64")
    model = linicl.Transformer(cfg)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
    compiled.clear()
    linicl.iclca.convert(model, variables, jnp.ones((1, 3), jnp.int32))
    n = len(compiled.CACHE)
    linicl.iclca.convert(model, variables, jnp.ones((1, 5), jnp.int32))
    assert len(compiled.CACHE) == n and compiled.CACHE.hits >= 1


def test_site_names_come_from_the_model_and_match_a_real_capture():
    for preset in ("tiny-linear", "tiny-softmax", "tiny-llama", "tiny-linear-learned"):
        cfg = linicl.preset(preset)
        model = linicl.Transformer(cfg)
        variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 3), jnp.int32))
        _, acts = linicl.interventions.capture(model, variables, jnp.zeros((1, 3), jnp.int32))
        assert tuple(acts) == linicl.interventions.site_names(cfg)


def test_layer_scopes_and_site_names_convert_both_ways():
    assert names.layer_scope(7) == "layers_7" and names.scope_layer("layers_7") == 7
    assert names.scope_layer("embed") is None
    for hook in names.ATTN_SITES + names.SCORE_SITES + names.BLOCK_SITES + names.MLP_SITES:
        full = names.block_site(3, hook)
        assert names.site_name(names.site_path(full)) == full and names.site_layer(full) == 3
    assert names.site_path("blocks.2.attn.hook_q") == ("layers_2", "attn", "hook_q")
    assert names.short_site("mlp_post", 1) == "blocks.1.mlp.hook_post"
    with pytest.raises(ValueError):
        names.block_site(0, "hook_nothing")
