"""The import structure the design rests on, read from the code with `ast` (nothing is imported).

The graph: one node per module under src/ (a package is its `__init__`), one arrow per import
statement anywhere in a module (top level, inside functions, under `if TYPE_CHECKING:`: a local import
is still a dependency, and hiding one in a function is how circles get dodged), relative imports
resolved. `from pkg import name` points at the submodule `pkg.name` when there is one, else at `pkg`;
importing `a.b.c` from outside package `a.b` also points at `a` and `a.b` (their `__init__` runs first).
Third-party imports are kept per module for the torch check.

The contracts, and why each holds:
1. No import circle among the modules of src/. Modules in a circle cannot be read, tested or moved
   apart, and the circle forces function-local imports to get the import order right.
2. Nothing imports `trainer.main` but train.py (train.py, src/, bench/ and tests/ are searched).
   trainer/main.py is the entry module; what other entry points (the preflight gates, `python -m
   eval.run`, the bench scripts) need from a run is built in trainer/setup.py and
   eval/during_training.py. A library that imports the entry module hangs the run's orchestration
   under everything and closes a circle as soon as the entry module uses that library.
3. The training run's layers, top to bottom: trainer.main, trainer.preflight, trainer.setup,
   trainer.loop, trainer.rollouts. A layer imports nothing from a layer above it: the entry and the
   gates drive the loop; the loop never reaches back into them.
4. trainer.losses imports nothing from the run around it (trainer.main, setup, preflight, loop,
   rollouts, backends; envs; eval). The losses are pure functions of tensors checked against an
   independent reference, and the engine, the loop and the correctness gate all build on them.
5. trainer.backends imports nothing from above the client boundary (trainer.main, setup, preflight,
   loop, rollouts, losses; envs; eval). A backend is a Tinker-shaped client: it runs whatever loss it
   is handed, and nothing above it knows which backend it talks to.
6. trainer.config imports no other part of src/ and loads no torch: composing and validating a
   config (train.py --cfg, eval.compare, eval.design) must not load the runtime; the runtime imports
   the config's enumerations and defaults, not the other way round.
7. The local engine's model code (`sampler_forward`, `train_forward`, `sampler_weights`) asks no
   capability question: it imports neither the native kernels, their autograd wrappers nor the
   precision probes, and names none of the probes. Every implementation choice is made once in
   `plan.py` and reaches the model code as the op tables of `ops.py`; a probe asked again at a call
   could change its answer inside a run and splits one decision over many places.
8. The run config reaches the runtime typed: outside trainer.config, nothing uses OmegaConf or holds a
   DictConfig, except the functions Hydra calls (`HYDRA_ENTRIES`), which validate what Hydra composed
   into the typed Config (`trainer.config.schema.validate`) and pass that down; a parameter named `cfg`
   is annotated `Config`; and no config is read by a string key (`cfg.get("x")`, `cfg["x"]`,
   `getattr(cfg, "x")`, on a `cfg` / `self.cfg` or a parameter typed with a config class). A typed read
   is checked against the schema where it is written; a string key is checked nowhere, and a `.get`
   with a default restates (or contradicts) the schema's.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"



@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    # src/ modules this one imports, each with the line of the first import statement naming it
    imports: dict[str, int] = field(default_factory=dict)
    # top-level names of the modules it imports from outside src/ (torch, numpy, ...)
    external: set[str] = field(default_factory=set)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    """The absolute name of what `from <...> import` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: Module, node: ast.Import | ast.ImportFrom) -> list[str]:
    """What one import statement names: each `import a.b`; for `from pkg import x, y` pkg.x, pkg.y
    and pkg itself (x may be a submodule or a name defined in pkg)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _resolve(module, node)
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def read_imports(module: Module, modules: dict[str, Module]) -> None:
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            subs = [f"{base}.{alias.name}" for alias in node.names]
            # `from pkg import sub` loads the submodule pkg.sub; any other name comes from pkg itself
            targets = [t for t in subs if t in modules] + ([base] if not all(t in modules for t in subs) else [])
        else:
            continue
        for target in targets:
            parts = target.split(".")
            # `import a.b.c` loads the longest prefix that is a module of the tree
            known = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules),
                         None)
            if known is None:
                module.external.add(parts[0])
                continue
            # importing a.b.c from outside package a.b first runs a/__init__ and a/b/__init__
            packages = [".".join(known.split(".")[:n]) for n in range(1, known.count(".") + 1)]
            for hit in [p for p in packages if p in modules and not _under(module.name, p)] + [known]:
                if hit != module.name:
                    module.imports.setdefault(hit, node.lineno)


@functools.cache
def build_graph(root: Path = SRC) -> dict[str, Module]:
    """Every module under `root` with its imports (read once per root and test session)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        modules[name] = Module(name, path, path.name == "__init__.py")
    for module in modules.values():
        read_imports(module, modules)
    return modules


def find_circles(modules: dict[str, Module]) -> list[list[str]]:
    """One import path per circle: for each strongly connected component with more than one module
    (Tarjan), a loop through it found by a walk from its first module."""
    edges = {m: sorted(mod.imports) for m, mod in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:  # the recursion depth is bounded by the number of modules (~100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [_loop_in(comp, edges) for comp in sorted(components)]


def _loop_in(comp: list[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest import loop from comp[0] back to itself inside the component (breadth first)."""
    inside, start = set(comp), comp[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    chain = [v]
                    while chain[-1] != start:
                        chain.append(came_from[chain[-1]])
                    return chain[::-1] + [start]
                if w in inside and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not a circle")


def _describe(loop: list[str], modules: dict[str, Module]) -> str:
    steps = [f"{a} (line {modules[a].imports[b]})" for a, b in pairwise(loop)]
    return " -> ".join(steps + [loop[-1]])


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden_arrows(modules: dict[str, Module], source: str, forbidden: list[str]) -> list[str]:
    """`module:line -> target` for every import from a module under `source` of one under `forbidden`."""
    return [f"{m}:{mod.imports[t]} -> {t}" for m, mod in sorted(modules.items()) if _under(m, source)
            for t in sorted(mod.imports) if any(_under(t, f) for f in forbidden)]


# --------------------------------------------------------------------------- the contracts
def test_no_import_circle_in_src():
    modules = build_graph()
    circles = find_circles(modules)
    assert not circles, "import circles in src/:\n  " + "\n  ".join(_describe(c, modules) for c in circles)


def test_only_train_py_imports_the_entry_module():
    importers = []
    files = [ROOT / "train.py"] + [p for d in ("src", "bench", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    for path in files:
        # each file read as a module of its own folder's tree, so that relative imports resolve
        top = SRC if SRC in path.parents else path.parent
        mod = Module(module_name(path, top), path, path.name == "__init__.py")
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    _under(t, "trainer.main") for t in _targets(mod, node)):
                importers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    others = [i for i in importers if not i.startswith("train.py:")]
    assert not others, ("only train.py may import trainer.main (build what other entry points share in "
                        "trainer/setup.py or eval/during_training.py); also imported at: " + ", ".join(others))
    assert importers, "the search did not find train.py's own import of trainer.main"


def test_the_run_layers_import_only_downwards():
    modules = build_graph()
    layers = ["trainer.main", "trainer.preflight", "trainer.setup", "trainer.loop", "trainer.rollouts"]
    bad = [a for i, layer in enumerate(layers) for a in forbidden_arrows(modules, layer, layers[:i])]
    assert not bad, "a lower layer imports a higher one:\n  " + "\n  ".join(bad)


def test_losses_import_nothing_of_the_run_around_them():
    bad = forbidden_arrows(build_graph(), "trainer.losses", [
        "trainer.main", "trainer.setup", "trainer.preflight", "trainer.loop", "trainer.rollouts",
        "trainer.backends", "envs", "eval"])
    assert not bad, "trainer.losses imports the run around it:\n  " + "\n  ".join(bad)


def test_backends_import_nothing_above_the_client_boundary():
    bad = forbidden_arrows(build_graph(), "trainer.backends", [
        "trainer.main", "trainer.setup", "trainer.preflight", "trainer.loop", "trainer.rollouts",
        "trainer.losses", "envs", "eval"])
    assert not bad, "trainer.backends imports from above the client boundary:\n  " + "\n  ".join(bad)


def test_config_is_self_contained_and_torch_free():
    modules = build_graph()
    bad = [f"{m}:{line} -> {t}" for m, mod in sorted(modules.items()) if _under(m, "trainer.config")
           for t, line in sorted(mod.imports.items())
           if not _under(t, "trainer.config")]
    assert not bad, "trainer.config imports other parts of src/:\n  " + "\n  ".join(bad)
    torch = sorted(f"{m} imports {x}" for m, mod in modules.items() if _under(m, "trainer.config")
                   for x in mod.external if x == "torch")
    assert not torch, "trainer.config loads torch:\n  " + "\n  ".join(torch)


ENGINE = "trainer.backends.local"
MODEL_CODE = [f"{ENGINE}.{m}"
              for m in ("sampler_forward", "train_forward", "sampler_weights", "training_compute")]
# the modules that probe, decide or run the implementation choices (model code takes the plan it is given: it
# makes none), and the names of the probes and of what decides
CAPABILITY_MODULES = [f"{ENGINE}.{m}" for m in ("kernels", "custom_ops", "precision", "plan")]
PROBES = {"ONEDNN_PACKING", "bf16_inputs_honoured", "packed_bf16_inputs_honoured", "unembed_inputs", "library",
          "avx512", "amx_head", "row_kernels", "native_decode", "blocked_linear", "blocked_head",
          "measured_entry", "auto_dtype", "resolve_dtypes", "train_packing", "sampler_plan_for",
          "train_plan_for", "forced_to_torch"}


def capability_questions(path: Path, name: str) -> list[str]:
    """`line: what` for every import of a capability module and every use of a probe's name in a file."""
    mod = Module(name, path, False)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [f"{node.lineno}: imports {t}" for t in _targets(mod, node)
                    if any(_under(t, c) for c in CAPABILITY_MODULES)]
            if isinstance(node, ast.ImportFrom):
                out += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in PROBES]
        elif isinstance(node, ast.Name) and node.id in PROBES:
            out.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in PROBES:
            out.append(f"{node.lineno}: .{node.attr}")
    return out


def test_the_engine_model_code_asks_no_capability_question():
    bad = [f"{m}:{q}" for m in MODEL_CODE
           for q in capability_questions(SRC / (m.replace(".", "/") + ".py"), m)]
    assert not bad, ("the model code asks what runs here (make the choice in plan.py and hand it over as an "
                     "op of ops.py):\n  " + "\n  ".join(bad))


def test_the_capability_check_sees_imports_names_and_attributes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from trainer.backends.local import kernels\n"
                    "from trainer.backends.local.model import ONEDNN_PACKING\n"
                    "x = kernels.avx512()\n"
                    "y = 1\n")
    got = capability_questions(path, f"{ENGINE}.sampler_forward")
    assert got == ["1: imports trainer.backends.local.kernels", "2: imports ONEDNN_PACKING", "3: .avx512"] or \
        sorted(got) == sorted(["1: imports trainer.backends.local.kernels", "2: imports ONEDNN_PACKING",
                               "2: ONEDNN_PACKING", "3: .avx512"]), got


#: the functions Hydra calls with its composed DictConfig (module, qualified name): each validates it (or,
#: for a Hydra callback, reads Hydra's own run-folder settings) and hands only the typed Config on
HYDRA_ENTRIES = {("trainer.main", "run_training"), ("eval.run", "main"),
                 ("trainer.hydra_callbacks", "RunFolderCheck.on_run_start"),
                 ("trainer.hydra_callbacks", "RunFolderCheck.on_multirun_start"),
                 ("trainer.hydra_callbacks", "SweepRecord.on_multirun_start")}


@functools.cache
def config_classes() -> frozenset[str]:
    """The dataclasses of trainer.config (read with ast): a parameter typed with one is a config."""
    names = {"Config"}
    for path in sorted((SRC / "trainer" / "config").glob("*.py")):
        names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
                  and any(isinstance(d, ast.Name) and d.id == "dataclass" for d in n.decorator_list)}
    return frozenset(names)


def _annotation_names(node: ast.expr | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _chain_root(node: ast.expr) -> str | None:
    """`a` of `a.b.c`, `self.cfg` of `self.cfg.b` (None for anything but a name/attribute chain)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return f"self.{parts[-1]}" if node.id == "self" and parts else node.id


def untyped_config_reads(path: Path, name: str) -> list[str]:
    """`line: what` for every untyped use of the run config in one module (contract 8)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[str] = []
    entries = {q for m, q in HYDRA_ENTRIES if m == name}
    entry_lines: set[int] = set()  # the parameter annotations of the Hydra entries
    typed_params: dict[ast.AST, set[str]] = {}

    def config_like(expr: ast.expr, params: set[str]) -> bool:
        root = _chain_root(expr)
        return root is not None and (root in ("cfg", "self.cfg") or root in params)

    def visit(node: ast.AST, qual: str, scope_params: set[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            q = f"{qual}.{node.name}" if qual else node.name
            params = set(scope_params)
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for a in args:
                names = _annotation_names(a.annotation)
                if q in entries and "DictConfig" in names:
                    entry_lines.add(id(a.annotation))
                if names & config_classes():
                    params.add(a.arg)
                elif a.arg == "cfg":
                    out.append(f"{a.lineno}: parameter cfg of {q} is not typed Config")
            # a local name bound to a part of the config (`d = cfg.decision`, `c, s = self.cfg, ...`) is one
            # too
            for _ in range(3):
                for stmt in ast.walk(node):
                    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                        pairs = [(stmt.targets[0], stmt.value)]
                        if isinstance(stmt.targets[0], ast.Tuple) and isinstance(stmt.value, ast.Tuple):
                            pairs = list(zip(stmt.targets[0].elts, stmt.value.elts))
                        params |= {t.id for t, v in pairs
                                   if isinstance(t, ast.Name) and config_like(v, params)}
            for child in ast.iter_child_nodes(node):
                visit(child, q, params)
            return
        if isinstance(node, ast.ClassDef):
            for child in ast.iter_child_nodes(node):
                visit(child, f"{qual}.{node.name}" if qual else node.name, scope_params)
            return
        typed_params[node] = scope_params
        for child in ast.iter_child_nodes(node):
            visit(child, qual, scope_params)

    visit(tree, "", set())
    allowed_annotations = {id(n) for a in ast.walk(tree) if id(a) in entry_lines for n in ast.walk(a)}

    for node, params in typed_params.items():
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "omegaconf":
            if not (entries and [a.name for a in node.names] == ["DictConfig"]):
                out.append(f"{node.lineno}: imports from omegaconf")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "omegaconf" for a in node.names):
            out.append(f"{node.lineno}: imports omegaconf")
        elif isinstance(node, ast.Name) and node.id in ("DictConfig", "OmegaConf", "ListConfig") \
                and id(node) not in allowed_annotations:
            out.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Call):
            f = node.func
            literal = bool(node.args) and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str)
            if isinstance(f, ast.Attribute) and f.attr == "get" and literal and config_like(f.value, params):
                out.append(f"{node.lineno}: .get({node.args[0].value!r})")
            elif isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and config_like(node.args[0], params):
                out.append(f"{node.lineno}: {f.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                isinstance(node.slice.value, str) and config_like(node.value, params):
            out.append(f"{node.lineno}: [{node.slice.value!r}]")
    return sorted(set(out), key=lambda x: (int(x.split(":")[0]), x))


def test_the_run_config_reaches_the_runtime_typed():
    bad = [f"{path.relative_to(ROOT)}:{q}" for path in sorted(SRC.rglob("*.py"))
           if not _under(module_name(path, SRC), "trainer.config")
           for q in untyped_config_reads(path, module_name(path, SRC))]
    assert not bad, ("the run config is read untyped outside trainer.config (take the typed Config that "
                     "trainer.config.schema.validate returns, and read its attributes):\n  "
                     + "\n  ".join(bad))


def test_the_config_check_sees_every_untyped_read(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from omegaconf import DictConfig, OmegaConf\n"
        "from trainer.config.schema import BackendCommonConfig, Config\n"
        "def a(cfg: DictConfig, n: int) -> int:\n"
        "    return cfg.env.get('n_test', 200)\n"
        "def b(cfg) -> None:\n"
        "    x = cfg['seed']\n"
        "def c(cfg: Config, b: BackendCommonConfig, d: dict) -> None:\n"
        "    y = getattr(b, 'faults', None), d.get('k'), cfg.loss.name, OmegaConf.select(cfg, 'x')\n"
        "class L:\n"
        "    def run(self) -> None:\n"
        "        z = self.cfg.schedule['num_steps']\n"
        "def main(cfg: DictConfig) -> None:\n"
        "    pass\n"
        "def e(cfg: Config) -> None:\n"
        "    d, n = cfg.decision, 3\n"
        "    f = d\n"
        "    return f.get('seed_sd'), n\n")
    assert untyped_config_reads(path, "m") == [
        "1: imports from omegaconf", "3: DictConfig", "3: parameter cfg of a is not typed Config",
        "4: .get('n_test')", "5: parameter cfg of b is not typed Config", "6: ['seed']", "8: OmegaConf",
        "8: getattr(..., 'faults')", "11: ['num_steps']", "12: DictConfig",
        "12: parameter cfg of main is not typed Config", "17: .get('seed_sd')"]
    # a Hydra entry may take the DictConfig (and import nothing else from omegaconf)
    path.write_text("from omegaconf import DictConfig\ndef main(cfg: DictConfig) -> None:\n    pass\n"
                    "def other(x: DictConfig) -> None:\n    pass\n")
    assert untyped_config_reads(path, "eval.run") == ["2: parameter cfg of main is not typed Config",
                                                      "4: DictConfig"]


# --------------------------------------------------------------------------- the checker itself
def test_the_checker_sees_circles_local_and_relative_imports(tmp_path):
    """A circle closed by a function-local relative import, `from pkg import submodule`, a name taken
    from a module (not a submodule), and the `__init__` of a package entered from outside are all read
    as the arrows they are."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import helper\n")
    (pkg / "b.py").write_text("def helper():\n    from . import c\n")
    (pkg / "c.py").write_text("import os\nfrom .a import nothing\n")
    (pkg / "d.py").write_text("from pkg import a\nimport torch.nn\nfrom pkg.sub.x import f\n")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.x import f\n")
    (pkg / "sub" / "x.py").write_text("def f():\n    pass\n")
    modules = build_graph(tmp_path)
    assert modules["pkg.a"].imports == {"pkg.b": 1}
    assert modules["pkg.b"].imports == {"pkg.c": 2}
    assert modules["pkg.c"].imports == {"pkg.a": 2} and modules["pkg.c"].external == {"os"}
    assert modules["pkg.d"].imports == {"pkg.a": 1, "pkg.sub": 3, "pkg.sub.x": 3}
    assert modules["pkg.d"].external == {"torch"}
    assert modules["pkg.sub"].imports == {"pkg.sub.x": 1}  # its own package is already running
    assert find_circles(modules) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert _describe(["pkg.a", "pkg.b", "pkg.c", "pkg.a"], modules) == \
        "pkg.a (line 1) -> pkg.b (line 2) -> pkg.c (line 2) -> pkg.a"
