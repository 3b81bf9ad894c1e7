"""`meshkit launch` on two machines, tried on this one: one launcher per "machine".

On two real machines you run, on each (R = 0 on the machine whose address is given):

    meshkit launch --nnodes 2 --node-rank R --coordinator node0:29500 -n 2 -d 4 hello_mesh.py

This file starts both launchers here, with 127.0.0.1 as machine 0's address, and runs the demo
(`hello_mesh.py`) across them: 4 processes, ids node-major (machine 0 runs 0-1, machine 1
runs 2-3). Then it runs the two machines with different ``-n``, which both refuse before any
process starts, naming both machines and both values.

    python examples/two_machines.py
"""

import concurrent.futures
import subprocess
import sys
from pathlib import Path

from meshkit.testing import free_ports

HERE = Path(__file__).resolve().parent
# Machine 0 serves PORT (the launchers meet there) and PORT+1 (JAX's coordinator): two free
# ports in a row. A port the OS hands out for the asking is no good for PORT: the next one may be
# any connection's (these runs make many).
port = free_ports(2)


def launchers(per_machine: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Start one launcher per entry ("machine"), together; wait for all; their outcomes."""
    common = [
        "--nnodes", str(len(per_machine)), "--coordinator", f"127.0.0.1:{port}",
        "--join-timeout", "60",
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "meshkit", "launch", *common, "--node-rank", str(r), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, args in enumerate(per_machine)
    ]
    # Every launcher's pipes are read together (none may wait on a full pipe), and the wait is
    # bounded: whatever happens, every launcher has ended when this returns.
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        waits = [pool.submit(p.communicate, timeout=180) for p in procs]
        try:
            outs = [w.result() for w in waits]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            said = [p.communicate() for p in procs]
            said_text = f"a launcher ran past 180 s; all were killed. They said: {said}"
            raise SystemExit(said_text) from None
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]


demo = ["--timeout", "120", "-n", "2", "-d", "4", str(HERE / "hello_mesh.py")]
for r, out in enumerate(launchers([demo, demo])):
    print(f"--- machine {r}: exit status {out.returncode}")
    print(out.stdout.rstrip())
    assert out.returncode == 0, out.stderr

print("--- the machines disagree on -n:")
different = [["-n", "2", str(HERE / "hello_mesh.py")], ["-n", "1", str(HERE / "hello_mesh.py")]]
for r, out in enumerate(launchers(different)):
    print(f"machine {r}: exit status {out.returncode}: {out.stderr.strip()}")
    assert out.returncode == 2
    assert "the machines differ in -n" in out.stderr
