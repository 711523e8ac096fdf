"""Inside the reasoning-gym scorer sandbox: score one answer with its generator's ``score_answer``.

Runs under ``python -S`` (standard library only until it extends ``sys.path`` with the request's
``site`` folders). The request is JSON on stdin: a nonce, the generator's module, its config, the
answer and the item; the grade goes back as one line ``<nonce> <kind> <text>`` on a private copy of
the original stdout. See :mod:`evertrain.envs.reasoning_gym` for the protocol and why each guard
exists (the audit hook, the literal-only ``eval``, the two-phase symbolic grade).
"""
import ast
import builtins
import importlib
import json
import os
import sys
import types

_BLOCKED_NAMES = frozenset((
    "eval", "exec", "compile", "open", "input", "breakpoint", "globals", "locals", "vars", "getattr",
    "setattr", "delattr", "dir", "help", "exit", "quit", "print", "memoryview", "type", "super", "object",
    "os", "sys", "gc", "io", "posix", "ctypes", "subprocess", "signal", "socket", "shutil", "pathlib",
    "importlib", "builtins", "inspect", "types", "code", "codeop", "runpy", "pickle", "marshal", "threading",
    "multiprocessing", "mmap", "resource", "pty", "operator", "functools", "system", "popen", "spawn",
    "fork", "kill", "load_module", "get_objects", "modules", "f_back", "f_globals", "f_locals", "f_builtins",
    "gi_frame", "gi_code", "cr_frame", "ag_frame", "tb_frame", "tb_next", "co_code", "mro",
    "format", "format_map", "vformat", "Formatter", "Template", "attrgetter", "itemgetter", "methodcaller",
))
_BLOCKED_EVENTS = frozenset((
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "os.kill", "os.killpg", "signal.pthread_kill", "sys.settrace", "sys.setprofile", "sys._current_frames",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__",
    "function.__new__",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.addressof", "ctypes.cdata", "ctypes.call_function",
    "ctypes.string_at", "ctypes.wstring_at", "mmap.__new__", "_thread.start_new_thread", "socket.__new__",
    "builtins.input", "os.chmod", "os.remove", "os.rename", "os.truncate", "os.putenv",
))


def _names(code, seen):
    seen.add(id(code))
    yield from code.co_names
    yield from code.co_varnames
    for const in code.co_consts:
        if hasattr(const, "co_names") and id(const) not in seen:
            yield from _names(const, seen)
        elif isinstance(const, str) and "{" in const:
            # str.format fields walk attributes by name ("{0.gi_frame.f_back}") from inside a string
            # constant, where co_names never shows them: a brace in evaluated code is refused outright
            yield "_format_field"


def _arm(blocked):
    """From here on: refuse dangerous code compiled from strings (the answer) and dangerous events."""
    def hook(event, args):
        if event == "exec":
            code = args[0]
            if getattr(code, "co_filename", "<")[:1] != "<":
                return  # a module's own file (an import): trusted, read-only code
            for name in _names(code, set()):
                if name.startswith("_") or name in _BLOCKED_NAMES:
                    blocked.append("name " + name[:40])
                    raise RuntimeError("blocked name")
        elif event in _BLOCKED_EVENTS:
            blocked.append(event)
            raise RuntimeError("blocked event")
        elif event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
                (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
            hidden = not isinstance(path, (str, bytes)) or os.fsdecode(path).startswith(("/proc", "/dev", "/sandbox"))
            if writes or hidden:
                blocked.append("open " + str(path)[:60])
                raise RuntimeError("blocked open")
    sys.addaudithook(hook)


def _load(request):
    for key, value in (("OPENBLAS_NUM_THREADS", "1"), ("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"),
                       ("MPLBACKEND", "Agg"), ("MPLCONFIGDIR", "/tmp/matplotlib")):
        os.environ[key] = value
    sys.path.extend(request["site"])
    for name in request["lazy"]:  # imported at module level, used only to generate problems: load on first use
        stub = types.ModuleType(name)

        def load(attr, name=name):
            sys.modules.pop(name, None)
            return getattr(importlib.import_module(name), attr)

        stub.__getattr__ = load
        sys.modules[name] = stub
    base = request["package_dir"]
    module = "reasoning_gym." + request["module"]
    parts = module.split(".")
    # the package __init__ files import every generator: stand empty packages in for them
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [os.path.join(base, *parts[1:i])]
            sys.modules[name] = stub
    coaching = types.ModuleType("reasoning_gym.coaching")
    coaching.__path__ = [os.path.join(base, "coaching")]
    sys.modules["reasoning_gym.coaching"] = coaching
    for sub in ("attributes", "base_curriculum"):
        loaded = importlib.import_module("reasoning_gym.coaching." + sub)
        for key, value in vars(loaded).items():
            if not key.startswith("_"):
                setattr(coaching, key, value)
    importlib.import_module(module)
    # late: loaded after the stub packages above stand in for its heavy __init__ files
    from reasoning_gym.factory import DATASETS
    dataset_cls, config_cls = DATASETS[request["generator"]]
    return dataset_cls(config=config_cls(**request["config"]))


_MAX_NODES = 2000


def _reduce(request):
    """The answer parsed by sympy, as a plain-data tree: [type name, *children] or [kind, text]."""
    sys.path.extend(request["site"])
    # late: found on the request's site folders, added to sys.path just above
    import sympy
    symbols = {name: sympy.Symbol(name) for name in request["symbols"]}
    expr = sympy.parse_expr(request["answer"], local_dict=symbols)
    count = [0]

    def walk(node):
        count[0] += 1
        if count[0] > _MAX_NODES:
            raise ValueError("expression too large")
        if node.is_Integer:
            return ["Integer", str(int(node))]
        if node.is_Rational:
            return ["Rational", str(node.p), str(node.q)]
        if node.is_Float:
            return ["Float", str(node)]
        if node.is_Symbol:
            return ["Symbol", node.name]
        return [type(node).__name__] + [walk(arg) for arg in node.args]

    return walk(sympy.sympify(expr))


def _rebuild(tree, symbol_names):
    """The inverse of _reduce, from plain data only: an allowlist of sympy constructors, no parsing."""
    # late: found on the request's site folders, added to sys.path just above
    import sympy
    functions = {name: getattr(sympy, name) for name in (
        "Add", "Mul", "Pow", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot",
        "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "exp", "log", "Abs")}
    constants = {"Exp1": sympy.E, "Pi": sympy.pi, "ImaginaryUnit": sympy.I}
    count = [0]

    def build(node):
        count[0] += 1
        if count[0] > _MAX_NODES or not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise ValueError("not an expression tree")
        kind, args = node[0], node[1:]
        if kind in ("Integer", "Rational", "Float", "Symbol"):
            if not all(isinstance(arg, str) and len(arg) <= 400 for arg in args):
                raise ValueError("bad leaf")
            if kind == "Integer":
                return sympy.Integer(int(args[0]))
            if kind == "Rational":
                return sympy.Rational(int(args[0]), int(args[1]))
            if kind == "Float":
                return sympy.Float(args[0])
            if args[0] not in symbol_names:
                raise ValueError("unknown symbol")
            return sympy.Symbol(args[0])
        if kind in constants and not args:
            return constants[kind]
        if kind not in functions:
            raise ValueError("not allowed: " + kind[:40])
        return functions[kind](*[build(arg) for arg in args])

    return str(build(tree))


def _revive(entry, keys):
    meta = entry.get("metadata")
    for key in keys:
        if isinstance(meta, dict) and isinstance(meta.get(key), list):
            meta[key] = tuple(tuple(row) if isinstance(row, list) else row for row in meta[key])


def main():
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(0)
    request = json.loads(b"".join(chunks))
    chunks = None
    report_fd = os.dup(1)  # the only channel the grade is read from; the scorer's stdout goes nowhere
    devnull = os.open("/dev/null", os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    if request.get("mode") == "batch":
        _batch(request, report_fd)
        os._exit(0)
    nonce = request.pop("nonce")

    def report(kind, text):
        os.write(report_fd, f"{nonce} {kind} {text}\n".encode())
        os._exit(0)

    if request.get("mode") == "reduce":
        # Phase one of a symbolic grade: this process holds the answer and no oracle. It parses the
        # answer (already checked against a token allowlist by the parent) and reports it as a plain
        # data tree; the scoring process gets the tree, never the text.
        try:
            tree = _reduce(request)
        except BaseException as error:
            report("error", "answer_not_plain " + json.dumps(repr(error)[:300]))
        report("tree", json.dumps(tree))
    try:
        dataset = _load(request)
    except BaseException as error:
        report("error", "scorer_load_failed " + json.dumps(repr(error)[:300]))
    _score(dataset, request, report)


def _batch(request, report_fd):
    """Many answers to one generator's items (the project's own probes, never a policy's completions): the
    generator's module is loaded once, here, and each answer is scored in a process forked from this one, alone
    (its own audit hook, eval and exit), as a single request's would be. A child that ends without a clean exit
    gets a crash line for its nonce."""
    items = request.pop("items")
    try:
        dataset = _load(request)
    except BaseException as error:
        for item in items:
            os.write(report_fd, f"{item['nonce']} error scorer_load_failed {json.dumps(repr(error)[:300])}\n".encode())
        return
    for item in items:
        pid = os.fork()
        if pid == 0:
            nonce = item["nonce"]

            def report(kind, text, nonce=nonce):
                os.write(report_fd, f"{nonce} {kind} {text}\n".encode())
                os._exit(0)

            try:
                _score(dataset, {**request, "entry": item["entry"], "answer": item["answer"], "tree": None},
                       report)
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            os.write(report_fd, f"{item['nonce']} error scorer_crashed {status}\n".encode())


def _score(dataset, request, report):
    """Score ``request``'s answer with ``dataset``'s scorer and ``report`` it (which exits the process)."""
    try:
        entry, answer = request["entry"], request["answer"]
        _revive(entry, request["revive"])
        if request.get("tree") is not None:  # phase two: rebuild the answer from plain data, no eval
            answer = _rebuild(request["tree"], request["symbols"])
    except BaseException as error:
        report("error", "scorer_load_failed " + json.dumps(repr(error)[:300]))
    if request.get("literal_eval"):
        # Scorers that eval() the answer to read a list (binary_matrix, n_queens, spiral_matrix,
        # string_insertion) get a literal-only eval: the answer is decoded as data, never run.
        # Some eval their own trusted data (bitwise_arithmetic evals the item's problem): strings of the
        # item, collected before the answer is looked at, keep the real eval.
        trusted = set()

        def collect(value):
            if isinstance(value, str):
                trusted.add(value)
            elif isinstance(value, dict):
                for item in value.values():
                    collect(item)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    collect(item)

        collect(entry)
        trusted.discard(answer)
        real_eval = builtins.eval

        def literal_eval(text, *args):
            if type(text) is str and text in trusted:
                return real_eval(text)
            return ast.literal_eval(text)

        builtins.eval = literal_eval
    blocked = []
    _arm(blocked)
    try:
        score = dataset.score_answer(answer, entry)
    except BaseException as error:
        if blocked:
            report("blocked", json.dumps(blocked[:5]))
        report("error", "scorer_raised " + json.dumps(repr(error)[:300]))
    if blocked:
        report("blocked", json.dumps(blocked[:5]))
    try:
        value = float(score)
    except BaseException:
        report("error", "scorer_bad_score " + json.dumps(type(score).__name__))
    report("score", repr(value))


if __name__ == "__main__":
    main()
