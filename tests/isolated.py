"""Running snippets of Python each in a process of its own, so that a crash (a segfault, an abort)
fails only the case that caused it, with its signal and stderr, instead of killing the test run.

One helper interpreter imports torch, runs a prelude once (imports, shared inputs), then forks one
child per snippet: a fork costs milliseconds where a fresh interpreter importing torch costs
seconds. Every child starts from the prelude's state, never from another snippet's. Used by the
bad-input matrix (tests/test_bad_inputs.py) and the large-shape sweep (tests/test_large_shapes.py).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

# The helper interpreter: runs the prelude, then forks one child per call. A child runs its call
# and writes what it raised to <outdir>/<i>.json, its stderr to <i>.stderr. The helper prints
# each child's exit code (negative: the signal that killed it; None: killed after the timeout).
# The parent keeps torch to one thread: an OpenMP thread pool does not survive a fork, so a child
# that wants threads (torch.set_num_threads) starts its own.
_FORK_SERVER = """
import json, os, sys, time, traceback
spec = json.load(sys.stdin)
sys.path.insert(0, spec["tests"])  # the prelude may import the tests' helpers (conftest)
import torch
torch.set_num_threads(1)  # no worker threads in the parent of the forks
ns = {}
exec(spec["prelude"], ns)
assert torch.get_num_threads() == 1, "the prelude must leave torch on one thread (see above)"
exit_codes = []
for i, call in enumerate(spec["calls"]):
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fd = os.open(os.path.join(spec["outdir"], f"{i}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            try:
                exec(call, ns)
            except Exception as e:
                report = {"raised": True, "type": type(e).__qualname__, "message": str(e),
                          "mro": [c.__qualname__ for c in type(e).__mro__], "traceback": traceback.format_exc()}
            else:
                report = {"raised": False}
            with open(os.path.join(spec["outdir"], f"{i}.json"), "w") as f:
                json.dump(report, f)
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + spec["timeout"]
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.001)
    if done[0]:
        exit_codes.append(os.waitstatus_to_exitcode(done[1]))
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        exit_codes.append(None)
print(json.dumps(exit_codes))
"""


class Outcome(NamedTuple):
    exit_code: int | None  # None: did not finish within the timeout
    report: dict | None  # what the call raised, if the child got to write it
    stderr: str


def run_isolated(prelude: str, calls: list[str], outdir, timeout_s: float = 60) -> list[Outcome]:
    """Runs each call after `prelude` in a process of its own, killed after timeout_s seconds;
    one Outcome per call."""
    spec = {"prelude": prelude, "calls": calls, "outdir": str(outdir), "timeout": timeout_s,
            "tests": str(Path(__file__).parent)}
    proc = subprocess.run([sys.executable, "-c", _FORK_SERVER], input=json.dumps(spec), capture_output=True,
                          text=True, timeout=60 + timeout_s * len(calls))
    assert proc.returncode == 0, f"the fork server failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    outcomes = []
    for i, code in enumerate(json.loads(proc.stdout.splitlines()[-1])):
        report_path, stderr_path = outdir / f"{i}.json", outdir / f"{i}.stderr"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        outcomes.append(Outcome(code, report, stderr_path.read_text() if stderr_path.exists() else ""))
    return outcomes


def run_collected(request, test_name: str, prelude: str, calls: dict[str, str], outdir,
                  timeout_s: float = 60) -> dict[str, Outcome]:
    """name -> Outcome of every collected case of `test_name` (parametrized by "name") in the requesting
    test module, all run by one fork server: the body of such a module's module-scoped fixture.
    `calls` maps each case name to its call."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == test_name and item.module is request.module]
    return dict(zip(names, run_isolated(prelude, [calls[n] for n in names], outdir, timeout_s), strict=True))


def how_it_ended(out: Outcome) -> str:
    """'was killed by SIGSEGV', 'exited with 3', 'did not finish in time'."""
    if out.exit_code is None:
        return "did not finish in time"
    if out.exit_code < 0:
        return f"was killed by {signal.Signals(-out.exit_code).name}"
    return f"exited with {out.exit_code}"
