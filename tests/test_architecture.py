"""The seams of docs/architecture.md, checked on the source.

- No import cycle between keras_dist's modules (function-level imports
  included; package `__init__` files, which only re-export, left out).
- `_kd_*` attributes stay inside the module that defines them: what one
  `fit` shares with its callbacks goes through `_fit_session.FitSession`;
  and so does every other private name (`_x` is its module's own).
- A model's `train_function` is assigned in `_fit_session.py` and
  `DistributedModel.make_train_function` only.
- `DistributedModel` does not look for callbacks by type.
"""

import ast
import pathlib

import keras_dist

PACKAGE = pathlib.Path(keras_dist.__file__).parent


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        yield ".".join(rel.parts), ast.parse(path.read_text())


def imported_modules(name, tree, known):
    package = name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            if target in known:
                yield target


def import_graph():
    trees = dict(modules())
    known = {n for n in trees if not n.endswith("__init__")}
    return {
        name: set(imported_modules(name, tree, known)) - {name}
        for name, tree in trees.items()
        if name in known
    }


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read():
    graph = import_graph()
    assert "keras_dist._fit_session" in graph["keras_dist.distributed_model"]
    assert "keras_dist._collectives" in graph["keras_dist.callbacks.backup_and_restore"]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_kd_attributes_stay_in_their_module():
    defined, used = {}, []
    for name, tree in modules():
        for node in ast.walk(tree):
            attr = None
            if isinstance(node, ast.Attribute) and node.attr.startswith("_kd_"):
                attr = node.attr
                if isinstance(node.ctx, ast.Store):
                    defined.setdefault(attr, set()).add(name)
            elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                args = node.args
                if len(args) > 1 and isinstance(args[1], ast.Constant) and str(
                    args[1].value
                ).startswith("_kd_"):
                    attr = args[1].value
                    if "setattr" in ast.unparse(node.func):
                        defined.setdefault(attr, set()).add(name)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = []
                    if isinstance(item, ast.Assign):
                        targets = [t.id for t in item.targets if isinstance(t, ast.Name)]
                    elif isinstance(item, (ast.FunctionDef, ast.AnnAssign)):
                        targets = [getattr(item, "name", None) or getattr(item.target, "id", "")]
                    for t in targets:
                        if t.startswith("_kd_"):
                            defined.setdefault(t, set()).add(name)
            if attr:
                used.append((name, attr))
    crossing = sorted(
        f"{module} uses {attr} (defined in {sorted(defined.get(attr, ['nowhere']))})"
        for module, attr in used
        if module not in defined.get(attr, set())
    )
    assert not crossing, crossing


def test_train_function_is_assigned_in_one_place():
    # A DistributedModel's train function is composed in one place; a
    # ShardedModel (another keras.Model) makes its own sharded functions.
    allowed = {"keras_dist._fit_session", "keras_dist.distributed_model",
               "keras_dist.dtensor.sharded_model"}
    offenders = []
    for name, tree in modules():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "train_function"
                and isinstance(node.ctx, ast.Store)
                and name not in allowed
            ):
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, offenders


def test_distributed_model_does_not_search_callbacks_by_type():
    tree = dict(modules())["keras_dist.distributed_model"]
    imports = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and "callbacks" in (node.module or "")
    ]
    assert imports == []


def private_names_defined(tree) -> set:
    """The `_private` names a module defines: module-level functions, classes
    and assignments, class members, and attributes it assigns (`x._y = ...`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            found.add(node.attr)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "delattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                found.add(str(node.args[1].value))
    return {n for n in found if n.startswith("_") and not n.startswith("__")}


def private_reads(name, tree, known_modules, imports_only=False):
    """(line, what) for each private name this module reads from elsewhere:
    `from keras_dist.m import _x`, `obj._x` and `getattr(obj, "_x")` on
    anything but self/cls."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras_dist"):
            for alias in node.names:
                if (alias.name.startswith("_") and not alias.name.startswith("__")
                        and f"{node.module}.{alias.name}" not in known_modules):
                    yield node.lineno, alias.name
        elif (not imports_only and isinstance(node, ast.Attribute)
              and isinstance(node.ctx, ast.Load)
              and node.attr.startswith("_") and not node.attr.startswith("__")
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            yield node.lineno, node.attr
        elif (not imports_only and isinstance(node, ast.Call)
              and ast.unparse(node.func) in ("getattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__")
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            yield node.lineno, node.args[1].value


def test_no_private_name_is_read_outside_the_module_that_defines_it():
    """The `_kd_` rule, for every private name: a module's `_x` is its own.

    A name keras_dist defines in one module and reads in another is an
    interface: make it public (no underscore) in a private module, or pass
    it through `_fit_session.FitSession`. Private Keras/TensorFlow and
    keras-tuner names are read in the compat modules only (see
    test_keras_compat.py); some coincide with a name keras_dist defines
    where it overrides them (`Tuner._build_hypermodel`), so attribute reads
    in the compat modules are theirs, not counted here (their imports are).
    """
    trees = dict(modules())
    known_modules = set(trees) | {n.rsplit(".", 1)[0] for n in trees}
    defined = {name: private_names_defined(tree) for name, tree in trees.items()}
    ours = set().union(*defined.values())
    crossing = sorted(
        f"{name}:{line} reads {attr} (defined in "
        f"{sorted(m for m, names in defined.items() if attr in names)})"
        for name, tree in trees.items()
        for line, attr in private_reads(name, tree, known_modules, "_compat" in name)
        if attr in ours and attr not in defined[name]
    )
    assert not crossing, "\n".join(crossing)
