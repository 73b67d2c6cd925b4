"""Loaded by every Python process of a command run under tests/walk/setting_walk.py (this directory is put first on
PYTHONPATH): records, in order, the repository files whose functions are handed the value being followed (see
setting_walk.py), and writes them to $WALK_OUT/<pid>.json at exit. Nothing of the repository is imported here."""
import atexit
import json
import os
import sys
import threading

_ROOT, _OUT = os.environ["WALK_ROOT"], os.environ["WALK_OUT"]
_TYPES = set(os.environ["WALK_TYPES"].split(","))  # class names that carry the value (the Config, its section)
_SKIP = (os.sep + ".venv" + os.sep, os.sep + "tests" + os.sep)
_files: list[str] = []
_calls: list[str] = []  # (file:function, for reading the path; consecutive repeats collapsed)


def _carries(value) -> bool:
    if type(value).__name__ in _TYPES:
        return True
    attributes = getattr(value, "__dict__", None)  # (an object holding it: self.config)
    return isinstance(attributes, dict) and not isinstance(value, type) and type(value).__name__ != "module" and \
        any(type(v).__name__ in _TYPES for v in list(attributes.values())[:50])


def _profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    path = code.co_filename
    if not path.startswith(_ROOT) or any(s in path for s in _SKIP):
        return
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    local = frame.f_locals
    handed = [n for n in names if _carries(local.get(n))]
    if handed:
        # (a method of the carrier itself -- config.layout(), a section's check() -- is the value, not a hand-off)
        own = handed == ["self"] and type(local["self"]).__name__ in _TYPES
        relative = os.path.relpath(path, _ROOT) + ("#own" if own else "")
        if not _files or _files[-1] != relative:
            _files.append(relative)
        call = f"{relative}:{code.co_name}"
        if not _calls or _calls[-1] != call:
            _calls.append(call)


@atexit.register
def _write():
    if _files:
        with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "files": _files, "calls": _calls}, f)


sys.setprofile(_profile)
threading.setprofile(_profile)
