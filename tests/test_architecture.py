"""The seams of docs/architecture.md, checked on the source.

- No import cycle between keras_dist's modules (function-level imports
  included; package `__init__` files, which only re-export, left out).
- `_kd_*` attributes stay inside the module that defines them: what one
  `fit` shares with its callbacks goes through `_fit_session.FitSession`.
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
