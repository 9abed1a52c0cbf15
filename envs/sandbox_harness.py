"""The launcher that runs inside the sandbox (``envs/sandbox.py``); standard library only.

``python -s /sandbox/harness.py CPU_S AS_BYTES NPROC FSIZE_BYTES NOFILE`` with ``/sandbox`` holding
``program.py``, ``mode`` ("stdio" or "call") and, for "call", ``func_name`` and ``args`` (a Python
literal list, read with ``ast.literal_eval``).

It first lowers its own hard and soft limits (the program cannot raise them again: that needs
CAP_SYS_RESOURCE in the host's user namespace), then:
  - stdio: runs the program as ``__main__``; the program's stdin and stdout are the test's.
  - call: defines the program under the module name "solution" (so a ``__main__`` block does not
    run), calls ``Solution().<func_name>(*args)`` when it defines ``Solution``, else ``<func_name>(*args)``
    (RAGEN's DeepCoder harness), with the program's own prints discarded, and writes one last stdout
    line: ``{"str": str(result), "json": <the result as JSON, absent when not encodable>}``.
The expected outputs never enter the sandbox: the host compares, so a program cannot read them.
"""

import ast
import io
import json
import resource
import runpy
import sys
from contextlib import redirect_stdout

SANDBOX = "/sandbox"


def set_limits(cpu: int, address_space: int, nproc: int, fsize: int, nofile: int) -> None:
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (address_space,) * 2),
                         (resource.RLIMIT_NPROC, (nproc,) * 2), (resource.RLIMIT_FSIZE, (fsize,) * 2),
                         (resource.RLIMIT_NOFILE, (nofile,) * 2), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(limit, value)


def read(name: str) -> str:
    with open(f"{SANDBOX}/{name}", encoding="utf-8") as f:
        return f.read()


def call_mode() -> None:
    func_name, args = read("func_name"), ast.literal_eval(read("args"))
    real_stdout = sys.stdout
    with redirect_stdout(io.StringIO()):
        scope = runpy.run_path(f"{SANDBOX}/program.py", run_name="solution")
        if "Solution" in scope and hasattr(scope["Solution"], func_name):
            target = getattr(scope["Solution"](), func_name)
        elif func_name in scope:
            target = scope[func_name]
        else:
            print(f"function {func_name!r} not found", file=sys.stderr)
            sys.exit(3)
        result = target(*args)
    report = {"str": str(result)}
    try:
        report["json"] = json.loads(json.dumps(result))
    except (TypeError, ValueError):
        pass  # not JSON-encodable: only the str comparison applies
    real_stdout.write("\n" + json.dumps(report) + "\n")
    real_stdout.flush()


def main() -> None:
    set_limits(*(int(x) for x in sys.argv[1:6]))
    sys.argv = ["program.py"]
    if read("mode") == "call":
        call_mode()
    else:
        runpy.run_path(f"{SANDBOX}/program.py", run_name="__main__")


if __name__ == "__main__":
    main()
