"""Inside the candidate's sandbox: load the candidate's code, then answer calls to its functions.

Usage (in the sandbox): ``main.py READ_FD WRITE_FD`` with the code in ``candidate.py`` beside it.
The first message says how loading went: ``("names", [top-level callable names])``,
``("syntax_error", message)`` or ``("load_error", type_name, message)``. Then each request
``("call", name, args, kwargs)`` gets one reply: ``("ok", value)``, ``("raised", type_name, message)``,
``("non_plain", type_name)`` or ``("missing", name)``.

Nothing here is trusted by the grader: once the candidate's code has run, it owns this process and can
write anything to the channel. This script is the honest path, whose job is to report plainly (so that
a value that is not plain data is named as such rather than failing somewhere obscure).
Standard library only, plus ``plain.py`` beside it.
"""

import builtins
import os
import sys

import plain

# A process that ran out of memory or processes is not fit to go on serving; the first is RLIMIT_AS,
# the second (fork failing with EAGAIN) RLIMIT_NPROC.
_FATAL = (MemoryError, BlockingIOError)


def _text(error: BaseException) -> str:
    try:
        return str(error)[:1000]
    except Exception:  # a candidate's exception whose __str__ itself fails
        return "<unprintable>"


def main() -> int:
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    send, recv, not_plain = plain.send, plain.recv, plain.NotPlain  # bound before the candidate runs
    with open(os.path.join(os.path.dirname(__file__), "candidate.py"), encoding="utf-8") as file:
        source = file.read()
    try:
        code = compile(source, "candidate.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        send(write_fd, ("syntax_error", f"{type(error).__name__}: {_text(error)}"))
        return 3
    # not "__main__": a completion's `if __name__ == "__main__":` demo block should not run
    namespace = {"__name__": "candidate", "__builtins__": builtins}
    try:
        exec(code, namespace)
    except _FATAL:
        raise  # die of it, with the traceback on stderr: the audit record then names the limit
    except Exception as error:
        send(write_fd, ("load_error", type(error).__name__, _text(error)))
        return 4
    names = sorted(name for name, value in list(namespace.items())
                   if type(name) is str and not name.startswith("__") and callable(value))
    send(write_fd, ("names", names))
    while True:
        try:
            request = recv(read_fd)
        except EOFError:
            return 0  # the test process is done
        _, name, args, kwargs = request
        function = namespace.get(name)
        if not callable(function):
            send(write_fd, ("missing", name))
            continue
        try:
            result = function(*args, **kwargs)
        except _FATAL:
            raise
        except Exception as error:
            send(write_fd, ("raised", type(error).__name__, _text(error)))
            continue
        try:
            send(write_fd, ("ok", result))
        except not_plain as error:
            send(write_fd, ("non_plain", error.type_name))


sys.exit(main())
