"""One owner of the daemon's state, checked over the source with ast.

Only the registry (pled/daemon/registry.py) assigns the served tables, a table's generation and the config, and
only it makes a TableState (which is where a generation is given). No daemon object holds the Daemon: each one's
constructor names what it depends on, and the Daemon hands none of them itself."""
import ast
import builtins
from pathlib import Path

PLED = Path(__file__).resolve().parent.parent / "pled"
REGISTRY = "pled/daemon/registry.py"
LIFECYCLE = "pled/daemon/lifecycle.py"
OWNED = {"tables", "generation", "config"}  # attributes only the registry assigns
MUTATORS = {"pop", "popitem", "clear", "update", "setdefault"}  # methods that change a dict in place


def sources(under: str = "") -> dict[str, ast.Module]:
    """Every module of pled/ (under ``under``) but the client side: a client process's own records (its attached
    ``tables``, a mapped table's ``generation``) are not the daemon's state."""
    out = {}
    for path in sorted((PLED / under).rglob("*.py")):
        name = path.relative_to(PLED.parent).as_posix()
        if not name.startswith("pled/client/"):
            out[name] = ast.parse(path.read_text(), name)
    return out


def _owned(expr: ast.expr) -> str | None:
    """``x.tables``, ``x.generation``, ``x.config`` or ``x.tables[k]``, as written; else None."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    if isinstance(expr, ast.Attribute) and expr.attr in OWNED:
        return ast.unparse(expr)
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, (ast.Assign, ast.Delete)):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            flat.append(target.value if isinstance(target, ast.Starred) else target)
    return flat


def changes_to_owned_state(tree: ast.Module) -> list[str]:
    """Each place ``tree`` assigns, deletes or mutates in place what only the registry may change, or makes a
    TableState: "line: what"."""
    found = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if _owned(target):
                found.append(f"{node.lineno}: {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS and _owned(node.func.value):
                found.append(f"{node.lineno}: {ast.unparse(node.func)}()")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "TableState":
            found.append(f"{node.lineno}: TableState()")
    return found


def holds_the_daemon(name: str, tree: ast.Module) -> list[str]:
    """Where a module other than lifecycle.py names the Daemon or imports lifecycle, where a constructor takes a
    ``daemon`` or stores one (``self.d = daemon``), and where the Daemon passes itself (``X(self)``)."""
    found = []
    for node in ast.walk(tree):
        if name != LIFECYCLE:
            if isinstance(node, ast.Name) and node.id == "Daemon":
                found.append(f"{node.lineno}: names Daemon")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip('"') == "Daemon":
                found.append(f"{node.lineno}: names Daemon in an annotation")
            if isinstance(node, ast.ImportFrom) and (node.module == "pled.daemon.lifecycle" or (
                    node.module == "pled.daemon" and any(a.name == "lifecycle" for a in node.names))):
                found.append(f"{node.lineno}: imports lifecycle")
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.arg in ("daemon", "d"):
                    found.append(f"{node.lineno}: __init__ takes {arg.arg}")
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == "daemon":
            found.append(f"{node.lineno}: stores a daemon")
        if isinstance(node, ast.ClassDef) and node.name == "Daemon":
            for call in ast.walk(node):
                builtin = (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                           and hasattr(builtins, call.func.id))
                if isinstance(call, ast.Call) and not builtin and any(
                        isinstance(a, ast.Name) and a.id == "self"
                        for a in call.args + [k.value for k in call.keywords]):
                    found.append(f"{call.lineno}: the Daemon hands itself to {ast.unparse(call.func)}")
    return found


def test_the_checks_find_what_they_look_for():
    reaching = ast.parse("d.tables['x'] = t\nt.generation += 1\nself.config = c\nd.registry.tables.pop('x')\n"
                         "a, (b.config, c) = 1, (2, 3)\ndel d.tables['x']\nt = TableState('x', s, m, 2)\n")
    assert len(changes_to_owned_state(reaching)) == 7, changes_to_owned_state(reaching)
    assert not changes_to_owned_state(ast.parse("x = d.tables['t']\nself._config = c\ntables = {}\n"))
    holding = ast.parse("class Handlers:\n    def __init__(self, daemon: 'Daemon'):\n        self.d = daemon\n")
    assert len(holds_the_daemon("pled/daemon/handlers.py", holding)) == 3
    handing = ast.parse("class Daemon:\n    def __init__(self):\n        self.reloader = Reloader(self)\n")
    assert holds_the_daemon(LIFECYCLE, handing) == ["3: the Daemon hands itself to Reloader"]


def test_only_the_registry_assigns_tables_generations_and_the_config():
    modules = sources()
    assert REGISTRY in modules and changes_to_owned_state(modules[REGISTRY])  # it is where they change
    elsewhere = {name: found for name, tree in modules.items() if name != REGISTRY
                 for found in [changes_to_owned_state(tree)] if found}
    assert not elsewhere, elsewhere


def test_no_daemon_object_holds_the_daemon():
    modules = sources("daemon")
    assert "class Daemon" in (PLED.parent / LIFECYCLE).read_text()
    found = {name: where for name, tree in modules.items() for where in [holds_the_daemon(name, tree)] if where}
    assert not found, found
