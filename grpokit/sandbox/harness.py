"""The program `code_tests` runs in the sandbox: a judge process and the candidate it forks.

The candidate's code can reach everything in its own process (frames, gc, memory, descriptors),
so nothing that decides the score lives there:

    judge (main.py)                              candidate (forked before the tests are read)
      opens tests.json, unlinks it, forks  ──▶     closes every descriptor but two pipes,
      non-dumpable: no ptrace, no /proc fds        its stdout to stderr; runs solution.py
      reads the tests, runs them; each             answers requests with plain data:
      solution name is a Remote: calling it  ◀──▶  {"call", "getattr", "iter", "next", "len",
      sends the arguments, gets plain data          "getitem", "bool", "names"}
      compares, counts; writes the verdict
      line to fd 1 (the only writer on it)

The expected values never enter the candidate's process, and the candidate's answers cross as
JSON with exact types (int, float, str, bytes, list, tuple, dict, set, ...; anything else
becomes an opaque Remote, equal only to itself), so an object whose __eq__ is always true, or
a forged summary, scores nothing. The candidate can kill the judge: then there is no verdict and
the score is 0. This file imports nothing from grpokit: `code.py` sends its source as main.py.
"""

import builtins
import ctypes
import importlib
import json
import os
import signal
import struct
import sys

MAX_DEPTH = 100
_HEADER = struct.Struct("!I")


# -- plain data across the pipes -------------------------------------------------------------


def encode(value, make_ref, depth=0):
    """JSON-able form of `value` with exact types; objects that are not plain data go through
    make_ref(obj) -> {"ref": ...}. Subclasses (a str with its own __eq__) are not plain data."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested more than {MAX_DEPTH} deep")
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return (
            value if value == value and value not in (float("inf"), float("-inf")) else {"float": repr(value)}
        )
    if kind in (list, tuple, set, frozenset):
        items = [encode(v, make_ref, depth + 1) for v in value]
        return {kind.__name__: items}
    if kind is dict:
        return {
            "dict": [
                [encode(k, make_ref, depth + 1), encode(v, make_ref, depth + 1)] for k, v in value.items()
            ]
        }
    if kind in (bytes, bytearray):
        return {kind.__name__: value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    return make_ref(value)


def decode(data, from_ref, depth=0):
    """The value `encode` wrote, built from builtins only; {"ref": ...} goes through from_ref."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested more than {MAX_DEPTH} deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict:
        raise ValueError("malformed value")
    if "ref" in data:
        return from_ref(data)
    if len(data) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = data.items()
    if tag == "float":
        return float(body)
    if tag in ("list", "tuple", "set", "frozenset"):
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](
            decode(v, from_ref, depth + 1) for v in body
        )
    if tag == "dict":
        return {decode(k, from_ref, depth + 1): decode(v, from_ref, depth + 1) for k, v in body}
    if tag in ("bytes", "bytearray"):
        return (bytes if tag == "bytes" else bytearray).fromhex(body)
    if tag == "complex":
        return complex(body[0], body[1])
    raise ValueError(f"unknown tag {tag!r}")


def send(fd, message, limit):
    data = json.dumps(message).encode()
    if len(data) > limit:
        data = json.dumps({"raise": ["ValueError"], "message": f"answer over {limit} bytes"}).encode()
    data = _HEADER.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def receive(fd, limit):
    """The next message, or None at end of file (or a message over `limit` bytes)."""
    head = _read_exactly(fd, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > limit:
        return None
    body = _read_exactly(fd, size)
    return None if body is None else json.loads(body)


def _read_exactly(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


# -- the candidate ------------------------------------------------------------------------------


def candidate(requests, answers, limit):
    """Run solution.py, then answer the judge until it closes the pipe. Never returns."""
    os.dup2(2, 1)  # its prints go to the sandbox's stderr (capped too); stdout is the judge's alone
    keep = {0, 1, 2, requests, answers}
    for fd in range(3, os.sysconf("SC_OPEN_MAX")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    with open("solution.py") as f:
        source = f.read()
    namespace = {"__name__": "solution", "__builtins__": builtins}
    status = "ok"
    try:
        code = compile(source, "solution.py", "exec")
    except BaseException:
        code, status = None, "syntax_error"
    if code is not None:
        try:
            exec(code, namespace)
        except BaseException as e:
            status = "exception:" + "_".join(type(e).__name__.split())
            if isinstance(e, OSError):  # which one: EFBIG is the file size limit, ENOSPC the disk
                status += ":" + (errno_name(e.errno) if type(e.errno) is int else "?")
    send(answers, {"status": status}, limit)
    objects = []

    def make_ref(obj):
        objects.append(obj)
        ref = {"ref": len(objects) - 1, "type": type(obj).__name__}
        if isinstance(obj, type) and issubclass(obj, BaseException):
            ref["exception"] = [c.__name__ for c in obj.__mro__]
        elif type(obj) is type(os):  # a module: the judge imports its own copy
            ref["module"] = obj.__name__
        return ref

    while True:
        request = receive(requests, limit)
        if request is None:
            os._exit(0)
        try:
            send(answers, serve(request, namespace, objects, make_ref), limit)
        except BaseException as e:  # an answer that cannot be encoded, or a broken pipe
            send(answers, {"raise": [c.__name__ for c in type(e).__mro__], "message": str(e)[:500]}, limit)


def serve(request, namespace, objects, make_ref):
    op = request["op"]
    if op == "names":  # the solution's values of the names the tests use
        return {"ok": encode({n: namespace[n] for n in request["names"] if n in namespace}, make_ref)}
    args = [decode(a, lambda r: objects[r["ref"]]) for a in request.get("args", [])]
    kwargs = {k: decode(v, lambda r: objects[r["ref"]]) for k, v in request.get("kwargs", {}).items()}
    target = objects[request["ref"]]
    try:
        if op == "call":
            result = target(*args, **kwargs)
        elif op == "getattr":
            result = getattr(target, request["name"])
        elif op in ("iter", "next", "len", "bool"):
            result = {"iter": iter, "next": next, "len": len, "bool": bool}[op](target)
        elif op == "getitem":
            result = target[args[0]]
        else:
            raise ValueError(f"unknown request {op!r}")
    except BaseException as e:
        return {"raise": [c.__name__ for c in type(e).__mro__], "message": str(e)[:500]}
    after = {
        str(i): encode(a, make_ref) for i, a in enumerate(args) if type(a) in (list, dict, set, bytearray)
    }
    return {"ok": encode(result, make_ref), "args": after}


def errno_name(number):
    import errno

    return errno.errorcode.get(number, "?")


# -- the judge ----------------------------------------------------------------------------------


class CandidateGone(BaseException):
    """The candidate died or broke the protocol: this test and every later one fail."""


class Remote:
    """A solution object the judge holds by reference. Equal only to itself: comparisons never
    reach the candidate, so it never sees an expected value."""

    __slots__ = ("_ref", "_type", "_link")

    def __init__(self, ref, type_name, link):
        self._ref, self._type, self._link = ref, type_name, link

    def _ask(self, op, *args, **fields):
        return self._link.ask(dict(op=op, ref=self._ref, **fields), args)

    def __call__(self, *args, **kwargs):
        return self._link.ask({"op": "call", "ref": self._ref}, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __len__(self):
        return self._ask("len")

    def __bool__(self):
        return self._ask("bool") is True

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __repr__(self):
        return f"<solution {self._type} object>"


class Link:
    """The judge's end of the pipes: requests out, plain data (or an exception to raise) back."""

    def __init__(self, requests, answers, limit):
        self.requests, self.answers, self.limit = requests, answers, limit
        self.gone = False
        self.exceptions = {}  # the solution's exception classes, mirrored here by name

    def receive(self):
        try:
            message = None if self.gone else receive(self.answers, self.limit)
        except (OSError, ValueError):  # a broken pipe, or bytes that are not our JSON
            message = None
        if type(message) is not dict:
            self.gone = True
            raise CandidateGone()
        return message

    def ask(self, request, args=(), kwargs=None):
        request["args"] = [encode(a, self._ref_out) for a in args]
        request["kwargs"] = {k: encode(v, self._ref_out) for k, v in (kwargs or {}).items()}
        if self.gone:
            raise CandidateGone()
        try:
            send(self.requests, request, self.limit)
        except OSError:
            self.gone = True
            raise CandidateGone() from None
        answer = self.receive()
        if type(answer.get("raise")) is list:
            raise self.exception(answer["raise"], str(answer.get("message", "")))
        try:
            result = self.decode(answer["ok"])
            for i, value in answer.get("args", {}).items():  # arguments the call changed in place
                original, new = args[int(i)], self.decode(value)
                if type(original) is type(new) and type(new) in (list, bytearray):
                    original[:] = new
                elif type(original) is type(new) and type(new) in (dict, set):
                    original.clear()
                    original.update(new)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):  # not our protocol
            self.gone = True
            raise CandidateGone() from None
        return result

    def decode(self, data):
        return decode(data, self._ref_in)

    def _ref_in(self, data):
        if "module" in data:  # the real module, imported here: never a door into the candidate
            try:
                return importlib.import_module(str(data["module"]))
            except Exception:
                pass
        if "exception" in data:  # a class the tests may name in `except`
            names = [str(n) for n in data["exception"]]
            if names[0] not in self.exceptions:
                self.exceptions[names[0]] = type(names[0], (self._builtin_exception(names),), {})
            return self.exceptions[names[0]]
        return Remote(data["ref"], str(data.get("type")), self)

    @staticmethod
    def _ref_out(obj):
        if type(obj) is Remote:
            return {"ref": obj._ref}
        raise TypeError(f"cannot pass a {type(obj).__name__} to the solution")

    @staticmethod
    def _builtin_exception(names):
        for name in names:
            cls = getattr(builtins, name, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                return cls
        return RuntimeError

    def exception(self, names, message):
        names = [str(n) for n in names]
        for name in names:
            if name in self.exceptions:
                return self.exceptions[name](message)
        return self._builtin_exception(names)(message)


def test_names(tests):
    """Every identifier the tests use that is not a builtin: what to ask the solution for."""
    import ast

    names = set()
    for source, _ in tests:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name):
                names.add(node.id)
    return sorted(n for n in names if not hasattr(builtins, n))


def judge(limit):
    """Fork the candidate, run the tests against it, write the verdict line to fd 1."""
    tests_fd = os.open("tests.json", os.O_RDONLY)
    os.remove("tests.json")
    # Non-dumpable: the candidate (same uid) may not ptrace us or open our descriptors via /proc.
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            candidate(requests_r, answers_w, limit)
        finally:
            os._exit(0)
    for fd in (requests_r, answers_w):
        os.close(fd)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    with os.fdopen(tests_fd) as f:
        tests = json.load(f)
    link = Link(requests_w, answers_r, limit)
    verdict = {"status": "ok", "passed": 0, "total": sum(1 for _, counted in tests if counted)}
    namespace = {"__name__": "tests", "__builtins__": builtins}
    try:
        verdict["status"] = str(link.receive()["status"])
        wanted = test_names(tests)
        names = link.ask({"op": "names", "ref": None, "names": wanted})
        namespace.update({k: v for k, v in names.items() if k in wanted})  # never a builtin
    except (CandidateGone, Exception):
        link.gone = True
    for source, counted in tests:
        ok = False
        if not link.gone:
            try:
                exec(compile(source, "tests.py", "exec"), namespace)
                ok = not link.gone
            except BaseException:
                pass
        verdict["passed"] += bool(counted and ok)
    verdict["lost"] = link.gone
    os.close(requests_w)
    verdict["candidate"] = end(pid)
    sys.stdout.flush()
    os.write(1, ("\n" + json.dumps({"grpokit_verdict": verdict}) + "\n").encode())


def end(pid):
    """Stop the candidate; how it ended: "running" (we stopped it), "exit:N" or "signal:NAME"."""
    done, status = os.waitpid(pid, os.WNOHANG)
    how = "running"
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    elif os.WIFSIGNALED(status):
        how = "signal:" + signal.Signals(os.WTERMSIG(status)).name
    else:
        how = f"exit:{os.WEXITSTATUS(status)}"
    return how


if __name__ == "__main__":
    judge(1 << 20)
