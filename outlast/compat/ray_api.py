"""Ray Train's public API, read from Ray's source files with `ast` (nothing of Ray is imported).

For `ray.train`, `ray.train.torch` and the framework integrations: the names of `__all__` (with Ray Train V2 enabled, its
default), each followed through its imports to where it is defined, with its arguments (a
function's parameters, a class's constructor or dataclass fields) and, for classes, its public
methods and properties. Defaults are kept as source text.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

_V2_SWITCH = "is_v2_enabled"


@dataclass(frozen=True)
class Param:
    name: str
    default: str | None  # source text; None when required
    keyword_only: bool = False


@dataclass
class ApiName:
    name: str
    kind: str  # "class", "function", "method", "property", "constant", "enum"
    params: list[Param] = field(default_factory=list)
    members: list["ApiName"] = field(default_factory=list)
    deprecated: bool = False
    value: str | None = None  # a constant's value, as source


class RaySource:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._modules: dict[str, dict[str, ast.AST | tuple[str, str]]] = {}

    # -- modules and their bindings ------------------------------------------------

    def _file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.exists():
                return candidate
        return None

    def bindings(self, module: str) -> dict[str, ast.AST | tuple[str, str]]:
        """Module-level names: a definition node, or (module, name) for an import; later bindings win."""
        if module in self._modules:
            return self._modules[module]
        found: dict[str, ast.AST | tuple[str, str]] = {}
        self._modules[module] = found
        path = self._file(module)
        if path is None:
            return found
        is_package = path.name == "__init__.py"
        self._walk(ast.parse(path.read_text()).body, module, is_package, found)
        return found

    def _walk(self, body: list[ast.stmt], module: str, is_package: bool, found: dict) -> None:
        for node in body:
            if isinstance(node, ast.If):
                # Ray Train V2 is on by default in this release: its branch is the one that counts.
                test = ast.unparse(node.test)
                if _V2_SWITCH in test and not test.startswith("not "):
                    self._walk(node.body, module, is_package, found)
            elif isinstance(node, ast.Try):
                self._walk(node.body, module, is_package, found)
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(node, module, is_package)
                for alias in node.names:
                    found[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found[target.id] = node
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                call = node.value  # __all__.extend([...])
                if ast.unparse(call.func) == "__all__.extend" and "__all__" in found:
                    existing = found["__all__"]
                    extra = ast.literal_eval(call.args[0])
                    found["__all__"] = ast.Assign(targets=[ast.Name("__all__")], value=ast.Constant(
                        [*ast.literal_eval(existing.value), *extra]))

    @staticmethod
    def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        base = parts if is_package else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, node.module] if node.module else base)

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        binding = self.bindings(module).get(name)
        if binding is None and self._file(f"{module}.{name}") is not None:
            return None  # a submodule
        if isinstance(binding, tuple) and depth < 20:
            return self.resolve(binding[0], binding[1], depth + 1)
        return (module, binding) if binding is not None else None

    def exported(self, module: str) -> list[str]:
        node = self.bindings(module).get("__all__")
        return list(ast.literal_eval(node.value)) if isinstance(node, ast.Assign) else []

    # -- what a definition looks like ------------------------------------------------

    def describe(self, module: str, name: str) -> ApiName:
        resolved = self.resolve(module, name)
        if resolved is None:
            return ApiName(name, "unknown")
        where, node = resolved
        if isinstance(node, ast.FunctionDef):
            return ApiName(name, "function", _params(node), deprecated=_deprecated(node))
        if isinstance(node, ast.ClassDef):
            return self._class(where, node, name)
        if isinstance(node, ast.Assign):
            return ApiName(name, "constant", value=ast.unparse(node.value))
        return ApiName(name, "unknown")

    def _class(self, module: str, node: ast.ClassDef, name: str) -> ApiName:
        chain = self._class_chain(module, node)
        bases = {ast.unparse(b).rsplit(".", 1)[-1] for _, c in chain for b in c.bases}
        if bases & {"Enum", "IntEnum", "str"} and any(b in ("Enum", "IntEnum") for b in bases):
            members = [ApiName(t.id, "constant") for _, c in chain for s in c.body if isinstance(s, ast.Assign)
                       for t in s.targets if isinstance(t, ast.Name) and not t.id.startswith("_")]
            return ApiName(name, "enum", members=members)
        params = self._constructor(chain)
        members: dict[str, ApiName] = {}
        for _, cls in chain:  # base classes first: a subclass's definition wins
            for item in cls.body:
                if isinstance(item, ast.FunctionDef) and (not item.name.startswith("_")):
                    decorators = {ast.unparse(d) for d in item.decorator_list}
                    kind = "property" if "property" in decorators else "method"
                    members[item.name] = ApiName(item.name, kind, [] if kind == "property" else _params(item),
                                                 deprecated=_deprecated(item))
        return ApiName(name, "class", params, sorted(members.values(), key=lambda m: m.name),
                       deprecated=_deprecated(node))

    def _class_chain(self, module: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class and the bases Ray defines, the farthest base first."""
        chain: list[tuple[str, ast.ClassDef]] = []
        for base in node.bases:
            resolved = self.resolve(module, ast.unparse(base)) if isinstance(base, ast.Name) else None
            if resolved is not None and isinstance(resolved[1], ast.ClassDef):
                chain.extend(self._class_chain(*resolved))
        return [*chain, (module, node)]

    @staticmethod
    def _constructor(chain: list[tuple[str, ast.ClassDef]]) -> list[Param]:
        for _, cls in reversed(chain):
            for item in cls.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return _params(item)
        fields: dict[str, Param] = {}
        for _, cls in chain:
            if not any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
                continue
            for item in cls.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if "ClassVar" in ast.unparse(item.annotation) or item.target.id.startswith("_"):
                        continue
                    default = ast.unparse(item.value) if item.value is not None else None
                    fields[item.target.id] = Param(item.target.id, default)
        return list(fields.values())


def _params(fn: ast.FunctionDef) -> list[Param]:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    out = [Param(a.arg, d) for a, d in zip(positional, defaults) if a.arg not in ("self", "cls")]
    out += [Param(a.arg, ast.unparse(d) if d is not None else None, keyword_only=True)
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return out


def _deprecated(node: ast.FunctionDef | ast.ClassDef) -> bool:
    if any("Deprecated" in ast.unparse(d) for d in node.decorator_list):
        return True
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "Deprecat" in ast.unparse(body[0])


def ray_train_api(root: Path, modules: tuple[str, ...] = ("ray.train", "ray.train.torch")) -> dict[str, list[ApiName]]:
    """{'ray.train': [...], 'ray.train.torch': [...], ...}, in `__all__` order."""
    src = RaySource(root)
    return {module: [src.describe(module, name) for name in src.exported(module)] for module in modules}
