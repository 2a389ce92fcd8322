"""Stand-in workers for `llama-fp8 launch` (cluster/launch/elastic.py): a few lines of Python that report a step in
their progress file and exit as told, so that each restart decision is tested in seconds with real torchrun
agents, one launcher (``--standalone``) or two on localhost (``launch_nodes``: a c10d rendezvous hosted by the
first, as on two Slurm nodes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import REPO, cli_env

# The worker appends "attempt rank" to attempts.txt, writes its progress file, then acts on the plan
# {attempt: {rank: action}}. An action is an exit code, "kill" (SIGKILL itself), "wait" (sleep until killed,
# 0.5 s steps), or a dict:
#   exit      code | "kill" | "wait" | "segv" | "stop" (SIGSTOP itself) (default 0)
#   phase     progress phase written ("step"; "startup", "finished"; None: no progress file at all)
#   step      step written (default plan["steps"][attempt], else 5); step_s: the previous step's seconds
#   seq       collectives issued per process group ({"0": 41}); ckpt: the latest complete checkpoint; error: the
#             failure the rank reports ({"kind": "io", "line": "..."})
#   age       seconds the progress record is made older by
#   after     seconds to sleep before acting (default 0.3)
#   on_term   keep running on SIGTERM, leaving sigterm.<attempt>.<rank> (a worker that starts saving)
#   on_usr1   the exit code on SIGUSR1 (a worker that saves and exits)
#   usr1_s    seconds it takes to exit on SIGUSR1 (2), or by node ({"1": 4}: SLURM_NODEID 1's worker saves for 4 s)
#   wait_for  a file name (in the test folder) to wait for before acting
#   peer_gone a rank whose process must have died before acting (its pid from started.<attempt>.<rank>)
#   mark      leave exited.<attempt>.<rank> just before exiting as told (a worker that got to its end)
# Each worker also leaves swaps.<attempt> with LLAMA_FP8_SWAPS when its launcher passed swaps to a spare on.
WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    here = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    with open(here / "attempts.txt", "a") as f:
        f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {rank}\\n")
    attempt = sum(1 for line in open(here / "attempts.txt") if line.split()[1] == str(rank)) - 1
    # a worker killed before it got here (its peer's failure seen first) wrote no line: its launcher's restart count
    # says which attempt this is (a spare's launcher starts at 0 in a later attempt: the lines say it)
    attempt = max(attempt, int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
    plan = json.loads((here / "plan.json").read_text())
    todo = plan.get(str(attempt), {}).get(str(rank), 0)
    if not isinstance(todo, dict):
        todo = {"exit": todo, **({"step_s": 0.5} if todo == "wait" else {})}
    step = todo.get("step", plan.get("steps", {}).get(str(attempt), 5))
    if todo.get("on_term"):
        signal.signal(signal.SIGTERM, lambda *_: (here / f"sigterm.{attempt}.{rank}").touch())
    if "on_usr1" in todo:
        saving = todo.get("usr1_s", 0)
        saving = saving.get(os.environ.get("SLURM_NODEID", ""), 0) if isinstance(saving, dict) else saving
        signal.signal(signal.SIGUSR1, lambda *_: (time.sleep(saving), os._exit(todo["on_usr1"])))
    folder = os.environ.get("LLAMA_FP8_PROGRESS_DIR")
    if folder and todo.get("phase", "step") is not None:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "step": step, "phase": todo.get("phase", "step"),
             "time": time.time() - todo.get("age", 0), "pid": os.getpid(), "step_s": todo.get("step_s"),
             "step_max_s": todo.get("step_s"), "ckpt": todo.get("ckpt"), "seq": todo.get("seq", {}),
             **({"error": todo["error"]} if "error" in todo else {})}))
    (here / f"started.{attempt}.{rank}").write_text(f"{os.getpid()} {os.getppid()}")
    if os.environ.get("LLAMA_FP8_SWAPS"):
        (here / f"swaps.{attempt}").write_text(os.environ["LLAMA_FP8_SWAPS"])
    while todo.get("wait_for") and not (here / todo["wait_for"]).exists():
        time.sleep(0.05)
    peer = todo.get("peer_gone")
    if peer is not None:
        while not (here / f"started.{attempt}.{peer}").exists():
            time.sleep(0.01)
        pid = int((here / f"started.{attempt}.{peer}").read_text().split()[0])
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
    action = todo.get("exit", 0)
    time.sleep(todo.get("after", 0.3 if action not in ("kill", "segv") else 0))
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if action == "wait":
        deadline = time.time() + 120
        while time.time() < deadline:
            time.sleep(0.1)
    if todo.get("mark"):
        (here / f"exited.{attempt}.{rank}").touch()
    sys.exit(action)
""")


def prepare(tmp_path: Path, plan: dict) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "attempts.txt").write_text("")


def launch(tmp_path: Path, plan: dict, max_restarts: int = 3, nproc: int = 2, wait: bool = True,
           python: list[str] | None = None, monitor_interval: float = 0.1, **env):
    """One launcher (``--standalone``) with ``nproc`` stand-in workers; (exit code, stderr), or the Popen."""
    prepare(tmp_path, plan)
    cmd = [*(python or [sys.executable, "-m", "llama_fp8"]), "launch", "--standalone", f"--nproc_per_node={nproc}",
           f"--max_restarts={max_restarts}", f"--monitor_interval={monitor_interval}", str(tmp_path / "worker.py"),
           str(tmp_path)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         env=cli_env(LLAMA_FP8_OUTCOME_DIR=str(tmp_path / "outcome"), **env))
    if not wait:
        return p
    _, err = p.communicate(timeout=120)
    return p.returncode, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(tmp_path: Path, plan: dict, max_restarts: int = 3, nodes: int = 2, port: int | None = None,
                 conf: str = "", started: int | None = None, nproc: int = 1, names: bool = False, spares: int = 0,
                 **env) -> list[subprocess.Popen]:
    """``nodes`` launchers on localhost (the first ``started`` of them: a node whose launcher never starts), one
    worker each, as 1.train_llama.sbatch starts them on Slurm nodes: a c10d rendezvous hosted by the first
    (``is_host=1``), node ids in SLURM_NODEID (the outcome files); ``nproc`` workers each; with ``names`` each
    launcher has its own Slurm node name (SLURMD_NODENAME n1, n2, ...: the node a failure is charged to); ``spares``
    more launchers after them wait as spare nodes (LLAMA_FP8_SPARE=1, the same --nnodes)."""
    prepare(tmp_path, plan)
    port = port or free_port()
    procs = []
    for node in range(nodes + spares if started is None else started):
        extra = {"LLAMA_FP8_SPARE": "1"} if node >= nodes else {}
        cmd = [sys.executable, "-m", "llama_fp8", "launch", f"--nnodes={nodes}", f"--nproc_per_node={nproc}",
               f"--max_restarts={max_restarts}", "--monitor_interval=0.1", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=standin",
               f"--rdzv_conf={conf}is_host={int(node == 0)}", str(tmp_path / "worker.py"), str(tmp_path)]
        with open(tmp_path / f"node{node}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=REPO,
                                          env=cli_env(LLAMA_FP8_OUTCOME_DIR=str(tmp_path / "outcome"),
                                                      SLURM_NODEID=str(node), **env, **extra,
                                                      **({"SLURMD_NODENAME": f"n{node + 1}"} if names else {}))))
    return procs


def finish(tmp_path: Path, procs: list[subprocess.Popen], timeout: float = 120) -> tuple[list[int | None], str]:
    """Wait for every launcher (killing what is left after ``timeout``): their codes (None: still running at the
    deadline) and their stderr, node by node."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes, "\n".join(f"--- node{n}\n" + (tmp_path / f"node{n}.err").read_text() for n in range(len(procs)))


def attempts(tmp_path: Path, rank: int | None = None) -> int:
    """The attempts ``rank`` ran; without a rank, the attempts the job ran (the most any rank ran: a rank killed
    before its first line, its peer's failure seen first on a loaded machine, left none for that attempt)."""
    lines = (tmp_path / "attempts.txt").read_text().split("\n")
    ranks = {ln.split()[1] for ln in lines if ln.strip()} if rank is None else {str(rank)}
    return max((sum(1 for ln in lines if ln.endswith(f" {r}")) for r in ranks), default=0)


def outcome_fields(tmp_path: Path, node: str | None = None) -> dict:
    """The outcome file (``node<N>``; the only one when ``node`` is None) as a dict: code, action, checkpoint,
    failed (``node@round`` list), exclude (list), line."""
    files = [tmp_path / "outcome" / node] if node else list((tmp_path / "outcome").iterdir())
    (f,) = files
    code, action, ckpt, failed, exclude, line = f.read_text().strip().split(" ", 5)
    return {"code": int(code), "action": action, "checkpoint": None if ckpt == "-" else int(ckpt),
            "failed": [] if failed == "-" else failed.split(","), "exclude": [] if exclude == "-" else exclude.split(","),
            "line": line}


def outcome(tmp_path: Path, node: str | None = None) -> tuple[int, str, str]:
    """(code, action, line) of the outcome file (``node<N>``; the only one when ``node`` is None)."""
    got = outcome_fields(tmp_path, node)
    return got["code"], got["action"], got["line"]
