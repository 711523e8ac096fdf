"""Inside the test sandbox: run a problem's tests against stubs of the candidate's functions.

Usage (in the sandbox): ``main.py READ_FD WRITE_FD`` with ``spec`` beside it, a plain-data dict of
``nonce``, ``tests`` (Python snippets that raise on failure), ``setup``, ``entry_point`` and
``referenced`` (the names the tests and setup use, found by the parent with ``ast``: importing ``ast``
here would cost every grade 4 ms).

This process never imports or executes the candidate's code. The candidate's top-level names become
stubs that send plain-data arguments over the channel and decode plain-data results (see
``plain.py``), so every comparison a test makes is between built-in values, in a process the
candidate never touched. A value that is not plain data, a broken channel, or a garbled reply raises
an exception derived from BaseException, so a test's own ``except Exception`` cannot swallow it, and
it is also remembered, so that even a bare ``except:`` cannot turn it into a pass.

Results go to the parent as lines on the original stdout, each starting with the nonce (which only
this process and the parent know); the tests' own prints go to stderr. The parent grants reward only
on the final line ``<nonce> ok <number of tests>``. Standard library only, plus ``plain.py``.
"""

import builtins
import os
import sys

import plain


class CandidateGone(BaseException):
    """The candidate's process died or closed the channel."""


class NonPlainValue(BaseException):
    """The candidate answered with something that is not plain data (or not a valid reply)."""


class NonPlainArgument(BaseException):
    """The tests tried to pass a value that cannot travel as plain data."""


class CandidateError(Exception):
    """An exception the candidate raised whose type is not a built-in exception."""


class Channel:
    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.trouble: list[str] = []  # every non-plain value or broken channel, whoever caught it

    def hello(self) -> tuple:
        try:
            message = plain.recv(self.read_fd)
        except (EOFError, OSError):
            return ("gone",)
        except plain.DecodeError:
            return ("garbled",)
        return message if type(message) is tuple and message and type(message[0]) is str else ("garbled",)

    def call(self, name: str, args: tuple, kwargs: dict) -> object:
        if "candidate_crashed" in self.trouble:
            raise CandidateGone(name)
        try:
            plain.send(self.write_fd, ("call", name, args, kwargs))
        except plain.NotPlain as error:
            self.trouble.append("non_plain_argument")
            raise NonPlainArgument(f"{name}() was passed a {error.type_name}") from None
        except OSError:
            self.trouble.append("candidate_crashed")
            raise CandidateGone(name) from None
        try:
            reply = plain.recv(self.read_fd)
        except (EOFError, OSError):
            self.trouble.append("candidate_crashed")
            raise CandidateGone(name) from None
        except plain.DecodeError as error:
            self.trouble.append("non_plain_value")
            raise NonPlainValue(str(error)) from None
        kind = reply[0] if type(reply) is tuple and reply else None
        if kind == "ok" and len(reply) == 2:
            return reply[1]
        if kind == "raised" and len(reply) == 3 and type(reply[1]) is str and type(reply[2]) is str:
            raise _exception(reply[1], reply[2])
        if kind == "missing" and len(reply) == 2:
            raise NameError(f"the candidate has no function {name!r}")
        self.trouble.append("non_plain_value")
        if kind == "non_plain" and len(reply) == 2 and type(reply[1]) is str:
            raise NonPlainValue(f"{name}() returned a {reply[1]}")
        raise NonPlainValue(f"{name}() sent a malformed reply")


# Exceptions that steer control flow rather than report an error: StopIteration raised by a candidate
# called under map(), zip(), all() or any() in a test would silently end that iterator, so a failing
# `assert all(map(f, xs))` would pass. They come back as an ordinary error instead (as PEP 479 does for
# generators), which the test cannot mistake for the end of its loop.
_CONTROL_FLOW = frozenset(("StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt",
                           "SystemExit"))


def _exception(type_name: str, message: str) -> Exception:
    """The candidate's exception, rebuilt here: a built-in type by name, else CandidateError."""
    if type_name in _CONTROL_FLOW:
        return CandidateError(f"{type_name} raised by the candidate: {message}")
    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # a built-in type whose constructor wants other arguments
            pass
    return CandidateError(f"{type_name}: {message}")


def _stub(channel: Channel, name: str):
    def stub(*args, **kwargs):
        return channel.call(name, args, kwargs)

    stub.__name__ = stub.__qualname__ = name
    return stub


def main() -> None:
    here = os.path.dirname(__file__)
    with open(os.path.join(here, "spec"), "rb") as file:
        spec = plain.decode(file.read())
    nonce, tests, entry, setup = spec["nonce"], spec["tests"], spec["entry_point"], spec["setup"]
    report_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def report(*words: str) -> None:
        os.write(report_fd, (" ".join([nonce, *words]) + "\n").encode())

    channel = Channel(int(sys.argv[1]), int(sys.argv[2]))
    hello = channel.hello()
    if hello[0] == "syntax_error":
        return report("abort", "syntax_error", plain.quote(str(hello[1:])[:500]))
    if hello[0] == "load_error":
        return report("abort", "candidate_crashed", plain.quote(str(hello[1:])[:500]))
    names = hello[1] if hello[0] == "names" and len(hello) == 2 and type(hello[1]) is list else None
    if names is None or not all(type(name) is str for name in names):
        return report("abort", "candidate_crashed", plain.quote(f"no function list ({hello[0]})"))
    if entry and entry not in names:
        return report("abort", "missing_function", plain.quote(entry))
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    shadowable = set(dir(builtins)) - {entry}
    referenced = set(spec["referenced"])
    for name in set(names) & referenced:
        if name.isidentifier() and name not in shadowable:
            namespace[name] = _stub(channel, name)
    # Harnesses that run tests in the candidate's namespace let tests use modules the solution
    # imported (MBPP task 596 calls sys.getsizeof). Here such names are the standard library's own.
    for name in referenced - set(namespace) - set(dir(builtins)):
        if name not in sys.stdlib_module_names:
            continue
        try:
            module = __import__(name)
        except ImportError:
            continue
        namespace[name] = module
    passed = 0
    try:
        exec(compile(setup, "<test setup>", "exec"), namespace)
    except BaseException as error:
        trouble = channel.trouble[-1] if channel.trouble else "setup_failed"
        return report("abort", trouble, plain.quote(f"{type(error).__name__}: {error}"[:500]))
    for index, test in enumerate(tests):
        before = len(channel.trouble)
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)
        except BaseException as error:
            reason = channel.trouble[-1] if len(channel.trouble) > before else "tests_failed"
            report("test", str(index), "fail", reason, plain.quote(f"{type(error).__name__}: {error}"[:300]))
            continue
        if len(channel.trouble) > before:  # the test swallowed a broken reply with a bare except
            report("test", str(index), "fail", channel.trouble[-1], plain.quote("caught by the test"))
            continue
        report("test", str(index), "pass")
        passed += 1
    if passed == len(tests) and not channel.trouble:
        report("ok", str(len(tests)))
    else:
        report("fail", str(passed))


main()
