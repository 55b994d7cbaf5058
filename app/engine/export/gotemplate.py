"""A tiny renderer for the subset of Go's text/template that Ollama TEMPLATEs we write use.

Enough to check that a TEMPLATE renders a conversation as the model's Jinja template does:
text, `{{ .Field }}` / `{{ $.Field }}` / `{{ $var }}` / `{{ $var.Field }}` output, `{{ if X }} ... {{ else if Y }}
... {{ else }} ... {{ end }}`, `{{ range .Messages }}` and `{{ range $i, $m := .Messages }}`,
the functions eq, ne, and, or, not with parenthesised arguments, string and integer literals,
and `{{-` / `-}}` whitespace trimming. Anything else raises ValueError.
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"{{(-\s)?(.*?)(\s-)?}}", re.S)
_ATOM = re.compile(r'\s*(\(|\)|"(?:[^"\\]|\\.)*"|[^\s()]+)')


def _parse(template: str) -> list:
    """Tokens: ("text", s) and ("action", s), with Go's trimming applied to the text."""
    out: list = []
    pos = 0
    trim_next = False
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        out.append(("text", text))
        out.append(("action", m.group(2).strip()))
        trim_next = bool(m.group(3))
        pos = m.end()
    tail = template[pos:]
    out.append(("text", tail.lstrip() if trim_next else tail))
    return out


def _tree(tokens: list, i: int = 0, stop=("end",)) -> tuple[list, int, str]:
    """Nodes until a closing action in `stop`: (nodes, next index, the closing action)."""
    nodes: list = []
    while i < len(tokens):
        kind, value = tokens[i]
        i += 1
        if kind == "text":
            nodes.append(("text", value))
            continue
        word = value.split(None, 1)[0] if value else ""
        if value in stop or word == "else":
            return nodes, i, value
        if word == "if":
            branches = []
            cond = value[2:].strip()
            while True:
                body, i, closing = _tree(tokens, i, ("end",))
                branches.append((cond, body))
                if closing == "end":
                    break
                cond = closing[4:].strip()              # "else" or "else if X"
                cond = cond[2:].strip() if cond.startswith("if") else None
            nodes.append(("if", branches))
        elif word == "range":
            spec = value[5:].strip()
            names: list[str] = []
            if ":=" in spec:
                left, spec = spec.split(":=", 1)
                names = [n.strip() for n in left.split(",")]
            body, i, closing = _tree(tokens, i, ("end",))
            if closing != "end":
                raise ValueError("{{ else }} in a range is not supported")
            nodes.append(("range", spec.strip(), names, body))
        else:
            nodes.append(("out", value))
    if stop != ():
        raise ValueError("missing {{ end }}")
    return nodes, i, ""


def _atoms(expr: str) -> list[str]:
    atoms, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = _ATOM.match(expr, pos)
        if not m:
            raise ValueError(f"cannot read {expr!r}")
        atoms.append(m.group(1))
        pos = m.end()
    return atoms


def _truth(v) -> bool:
    return bool(v)


class _Eval:
    def __init__(self, root: dict):
        self.root = root

    def value(self, atoms: list[str], i: int, dot, names: dict):
        """(value, next index) of one argument."""
        a = atoms[i]
        if a == "(":
            args, i = self.command(atoms, i + 1, dot, names, until=")")
            return args, i + 1
        if a.startswith('"'):
            return bytes(a[1:-1], "utf-8").decode("unicode_escape"), i + 1
        if re.fullmatch(r"-?\d+", a):
            return int(a), i + 1
        if a.startswith("$."):
            return self.field(self.root, a[2:]), i + 1
        if a == "$":
            return self.root, i + 1
        if a.startswith("$"):
            var, _, rest = a.partition(".")
            if var not in names:
                raise ValueError(f"undefined variable {var}")
            return (self.field(names[var], rest) if rest else names[var]), i + 1
        if a == ".":
            return dot, i + 1
        if a.startswith("."):
            return self.field(dot, a[1:]), i + 1
        raise ValueError(f"unsupported term {a!r}")

    @staticmethod
    def field(obj, name: str):
        for part in name.split("."):
            if not isinstance(obj, dict) or part not in obj:
                raise ValueError(f"no field {part!r}")
            obj = obj[part]
        return obj

    def command(self, atoms: list[str], i: int, dot, names: dict, until=None):
        """Evaluate a function call or a single value starting at atoms[i]."""
        head = atoms[i]
        if head in ("eq", "ne", "and", "or", "not"):
            args, i = [], i + 1
            while i < len(atoms) and atoms[i] != until:
                v, i = self.value(atoms, i, dot, names)
                args.append(v)
            if head == "eq":
                return any(args[0] == b for b in args[1:]), i
            if head == "ne":
                return args[0] != args[1], i
            if head == "not":
                return not _truth(args[0]), i
            pick = next((a for a in args if not _truth(a)), args[-1]) if head == "and" else \
                next((a for a in args if _truth(a)), args[-1])
            return pick, i
        v, i = self.value(atoms, i, dot, names)
        if i < len(atoms) and atoms[i] != until:
            raise ValueError(f"unexpected {atoms[i]!r}")
        return v, i

    def expr(self, expr: str, dot, names: dict):
        atoms = _atoms(expr)
        v, i = self.command(atoms, 0, dot, names)
        if i != len(atoms):
            raise ValueError(f"unexpected {atoms[i]!r} in {expr!r}")
        return v

    def run(self, nodes: list, dot, names: dict, out: list[str]) -> None:
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "out":
                v = self.expr(node[1], dot, names)
                out.append("" if v is None else str(v))
            elif kind == "if":
                for cond, body in node[1]:
                    if cond is None or _truth(self.expr(cond, dot, names)):
                        self.run(body, dot, names, out)
                        break
            else:
                _, spec, var_names, body = node
                for index, item in enumerate(self.expr(spec, dot, names) or []):
                    scope = dict(names)
                    if len(var_names) == 2:
                        scope[var_names[0]], scope[var_names[1]] = index, item
                    elif var_names:
                        scope[var_names[0]] = item
                    self.run(body, item, scope, out)


def render_go(template: str, messages: list[dict]) -> str:
    """Render an Ollama TEMPLATE for a chat as Ollama's server does with a `.Messages`
    template: .System is the system messages' text, .Messages every message (system ones
    too) with .Role and .Content, .Prompt the last user message's text."""
    nodes, _, _ = _tree(_parse(template), stop=())
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    users = [m["content"] for m in messages if m["role"] == "user"]
    root = {"System": system, "Prompt": users[-1] if users else "", "Response": "",
            "Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]}
    out: list[str] = []
    _Eval(root).run(nodes, root, {}, out)
    return "".join(out)
