"""The fault table: each fault injected into a real 2-process job, whether the job survived, the
steps lost and the seconds to recover.

    python bench/faults.py [--only NAME ...] [--markdown]

The job: a small MLP (13 -> 64 -> 3, AdamW, StepLR) on 2 CPU processes under `phalanx run`,
checkpointing every 5 steps into --checkpoint-dir, 0.15 s per step so faults land mid-training,
30 steps. Faults hit at step 12 (between the checkpoints of steps 10 and 15):

| fault | how |
|---|---|
| SIGTERM / SIGUSR1 | sent to `phalanx run`; then the same command is run again, as a scheduler or a requeue would |
| kill -9 of a rank | rank 1 SIGKILLs itself; `--max-restarts 1` |
| kill -9 of a node | two "nodes" (network namespaces, 1 process each, `--nnodes 1:2`, c10d): every process of node B |
| kill -9 of the store's host | the same two nodes: node A's launcher, which hosts the c10d store, and its worker |
| disk full | checkpoint_dir is a 2 MiB tmpfs, filled after the step-10 checkpoint; `--max-restarts 1` |
| corrupt latest checkpoint | rank 1 flips bytes in the step-10 checkpoint's shard, then dies; `--max-restarts 1` |
| a stalled rank | rank 1 sleeps forever inside its step; `--watchdog-timeout 10 --max-restarts 1` |
| kill -9 of a rank, checkpoints in S3 | as kill -9 of a rank, with `--checkpoint-dir s3://...` (moto's S3 server on loopback) |
| an interrupted upload (S3) | rank 0 SIGKILLs itself inside the step-15 save: its shards uploaded, the manifest not |
| bad S3 credentials | `phalanx run` with an access key the store does not know |
| the first node lost, etcd | the two nodes with `--rdzv-backend etcd-v2` (etcd beside node B): node A's launcher and worker |

steps lost = the last step completed before the fault minus the step the job resumed from;
seconds to recover = the fault -> the first step completed after it (for signals: including the
rerun, started as soon as the job exited); "stopped in" = the fault -> the job's exit.
Node faults need root and iproute2 (namespaces px-f-a/px-f-b, 10.252.0.1/2); tmpfs needs root;
the S3 rows moto[server] and s3fs; the etcd row etcd (scripts/ci-etcd-deps) and python-etcd.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
NETNS = ROOT / "tests" / "multinode" / "netns.sh"
NODES = {"a": ("px-f-a", "10.252.0.1"), "b": ("px-f-b", "10.252.0.2")}
AT = 12
STEPS = 30

WORKLOAD = """\
import json, os, signal, sys, time
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from phalanx import Phalanx

args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
out, fault, at = Path(args["--out"]), args.get("--fault", ""), int(args.get("--at", "12"))
steps, every = int(args.get("--steps", "30")), int(args.get("--every", "5"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
px = Phalanx()
(out / f"pid-{px.rank}").write_text(str(os.getpid()))
if fault == "upload" and attempt == 0:  # rank 0 dies inside the step-15 save, after its shards are written
    from phalanx.checkpoint.manager import Checkpointer
    _finalize = Checkpointer._finalize
    def _die_in_upload(self, save, managed):
        if save.step == 15 and px.rank == 0:
            (out / "faulted").write_text(json.dumps({"t": time.time(), "step": 15}))
            os.kill(os.getpid(), signal.SIGKILL)
        return _finalize(self, save, managed)
    Checkpointer._finalize = _die_in_upload
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(480, 13, generator=g), torch.randint(0, 3, (480,), generator=g))
model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
loader = DataLoader(data, batch_size=24 // px.world_size, shuffle=True)  # global batch 24 on any world size
model, optimizer, loader, scheduler = px.prepare(model, optimizer, loader, scheduler)

def note(event):
    if px.is_main_process:
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "world": px.world_size, "t": time.time(), **event}) + "\\n")

def fill(directory):
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    for size in (1 << 16, 1):
        try:
            while True:
                os.write(fd, b"\\0" * size)
        except OSError:
            pass
    os.close(fd)

note({"event": "resumed" if px.load_state() else "started", "step": px.global_step})
first = attempt == 0 and not (out / "faulted").exists()
while px.global_step < steps:
    for x, y in loader:
        optimizer.zero_grad()
        px.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        scheduler.step()
        note({"event": "step", "step": px.global_step})
        if px.global_step % every == 0:
            px.save_state()
            if fault == "disk" and px.global_step == 10 and px.is_main_process:
                fill(Path(px.config.checkpoint_dir))
        if first and px.global_step == at:
            if px.is_main_process:
                (out / "at").write_text(str(time.time()))
            if px.rank == 1 and fault in ("kill", "corrupt", "stall"):
                (out / "faulted").write_text(json.dumps({"t": time.time(), "step": px.global_step}))
                if fault == "corrupt":
                    latest = Path(px.config.checkpoint_dir) / "step-00000010"
                    shard = sorted(latest.glob("*.distcp"))[0]
                    data_ = bytearray(shard.read_bytes()); data_[len(data_) // 2] ^= 0xFF; shard.write_bytes(bytes(data_))
                if fault == "stall":
                    time.sleep(10**6)
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.15)
        if px.global_step >= steps:
            break
note({"event": "done", "step": px.global_step})
"""


@dataclass
class Row:
    fault: str
    survived: str
    steps_lost: str
    recover_s: str
    stopped_s: str = ""
    note: str = ""


def events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def phalanx_run(out: Path, *flags: str, fault: str = "", prefix: tuple[str, ...] = ()) -> list[str]:
    return [
        *prefix,
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--checkpoint-dir",
        str(out / "ckpt"),
        "--run-dir",
        str(out / "run"),
        *flags,
        str(out.parent / "workload.py"),
        "--out",
        str(out),
        "--fault",
        fault,
        "--at",
        str(AT),
        "--steps",
        str(STEPS),
    ]


EXTRA_ENV: dict[str, str] = {}  # AWS_* of the S3 server, once started


def env() -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "PHALANX_", "SLURM_"))}
    return {**keep, "OMP_NUM_THREADS": "1", **EXTRA_ENV}


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended ({proc.returncode}) before {path.name}: {proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {path.name} after {timeout} s")
        time.sleep(0.05)
    return float(path.read_text()) if path.name == "at" else time.time()


def summarize(fault: str, out: Path, t0: float, exited: float | None, rc: int, done_note: str = "") -> Row:
    found = events(out)
    resumed = [e for e in found if e["event"] == "resumed" and e["t"] > t0]
    until = resumed[0]["t"] if resumed else float("inf")
    before = [e["step"] for e in found if e["event"] == "step" and e["t"] < until]
    after = [e for e in found if e["event"] == "step" and e["t"] > until]
    done = any(e["event"] == "done" for e in found)
    if resumed and before:
        lost = f"{max(before) - resumed[0]['step']}"
    else:  # not resumed: what a rerun from the latest checkpoint would redo
        latest = (out / "ckpt" / "latest").read_text().strip() if (out / "ckpt" / "latest").exists() else ""
        lost = f"{max(before) - int(latest[5:])} on a rerun" if before and latest.startswith("step-") else "-"
    recover = f"{after[0]['t'] - t0:.1f}" if done and after else "-"
    worlds = [e["world"] for e in found]
    survived = ("yes" if done else f"no (exit {rc})") + (f", {done_note}" if done_note else "")
    if worlds and worlds[-1] != worlds[0]:
        survived += f", world {worlds[0]} -> {worlds[-1]}"
    stopped = f"{exited - t0:.1f}" if exited is not None else ""
    return Row(fault, survived, lost, recover, stopped)


def inject_signal(tmp: Path, sig: signal.Signals) -> Row:
    out = tmp / sig.name
    out.mkdir()
    command = phalanx_run(out, "--nproc-per-node", "2")
    proc = subprocess.Popen(command, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(out / "at", proc)
    t0 = time.time()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    exited = time.time()
    line = next((x for x in err.splitlines() if x.startswith("phalanx: preempted")), "(no line)")
    rerun = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=300)
    row = summarize(sig.name, out, t0, exited, rerun.returncode, f"exit {proc.returncode}, then the rerun resumed")
    row.note = line.replace(str(out) + "/", "")
    return row


def inject_in_script(tmp: Path, name: str, fault: str, *flags: str) -> Row:
    out = tmp / fault
    out.mkdir()
    proc = subprocess.run(
        phalanx_run(out, "--nproc-per-node", "2", "--max-restarts", "1", *flags, fault=fault),
        env=env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    exited = time.time()
    faulted = json.loads((out / "faulted").read_text())
    row = summarize(
        name,
        out,
        faulted["t"],
        exited if proc.returncode else None,
        proc.returncode,
        "restarted" if proc.returncode == 0 else "",
    )
    restart = next((x for x in proc.stderr.splitlines() if x.startswith("phalanx: restart")), "")
    row.note = restart.replace(str(out) + "/", "")[:160]
    return row


def inject_disk_full(tmp: Path) -> Row:
    out = tmp / "disk"
    (out / "ckpt").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(out / "ckpt")], check=True)
    try:
        started = time.time()
        proc = subprocess.run(
            phalanx_run(out, "--nproc-per-node", "2", "--max-restarts", "1", fault="disk"),
            env=env(),
            capture_output=True,
            text=True,
            timeout=400,
        )
        exited = time.time()
    finally:
        subprocess.run(["umount", str(out / "ckpt")], check=True)
    found = events(out)
    saved_fail = [e["t"] for e in found if e["event"] == "step" and e["step"] == 15]
    t0 = saved_fail[0] if saved_fail else started
    row = summarize("disk full", out, t0, exited, proc.returncode)
    row.steps_lost = "5 (steps 11-15: the step-15 save failed)"
    message = next((x for x in proc.stderr.splitlines() if "CheckpointWriteError: saving" in x), "")
    row.note = message.split("CheckpointWriteError: ", 1)[-1].replace(str(out) + "/", "")
    return row


def inject_node(tmp: Path, name: str, victim: str, etcd: str | None = None) -> Row:
    out = tmp / name.replace(" ", "-").replace("'", "").replace(",", "")
    out.mkdir()
    rendezvous = (
        ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd, "--rdzv-id", "faults"]
        if etcd
        else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{NODES['a'][1]}:29711"]
    )
    flags = ["--nnodes", "1:2", "--nproc-per-node", "1", *rendezvous, "--max-restarts", "1", "--rdzv-timeout", "60"]
    procs = {}
    for node, (ns, _) in NODES.items():
        procs[node] = subprocess.Popen(
            phalanx_run(out, *flags, prefix=("ip", "netns", "exec", ns)),
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    wait_for(out / "at", procs["a"])
    os.killpg(procs[victim].pid, signal.SIGKILL)  # the node's launcher and its worker at once
    t0 = time.time()
    survivor = procs["b" if victim == "a" else "a"]
    _, err = survivor.communicate(timeout=400)
    exited = time.time()
    procs[victim].communicate()
    row = summarize(name, out, t0, exited if survivor.returncode else None, survivor.returncode)
    said = next(
        (x for x in err.splitlines() if x.startswith(("phalanx: restart", "phalanx watchdog", "phalanx: rank"))),
        err.strip().splitlines()[-1] if err.strip() else "",
    )
    row.note = said.replace(str(out) + "/", "")[:200]
    return row


def inject_in_s3(tmp: Path, name: str, fault: str, url: str) -> Row:
    row = inject_in_script(tmp, name, fault, "--checkpoint-dir", url)
    if fault == "upload":
        row.note = "the restart line; the uncommitted step-15 prefix was never loaded, and the next save removed it"
    return row


def inject_bad_credentials(tmp: Path, url: str) -> Row:
    out = tmp / "credentials"
    out.mkdir()
    t0 = time.time()
    proc = subprocess.run(
        phalanx_run(out, "--nproc-per-node", "2", "--checkpoint-dir", url),
        env={**env(), "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG1", "AWS_SECRET_ACCESS_KEY": "wrong"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    return Row(
        "bad S3 credentials",
        f"refused before launch (exit {proc.returncode})",
        "0 (nothing started)",
        "-",
        f"{time.time() - t0:.1f}",
        said[:220],
    )


def why_not_root(what: str) -> str | None:
    if os.geteuid() != 0:
        return f"{what} needs root"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="fault names to run (default: all)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args()
    faults: dict[str, Callable[[Path], Row]] = {
        "SIGTERM": lambda tmp: inject_signal(tmp, signal.SIGTERM),
        "SIGUSR1": lambda tmp: inject_signal(tmp, signal.SIGUSR1),
        "kill -9 of a rank": lambda tmp: inject_in_script(tmp, "kill -9 of a rank", "kill"),
        "kill -9 of a node": lambda tmp: inject_node(tmp, "kill -9 of a node", "b"),
        "kill -9 of the store's host": lambda tmp: inject_node(tmp, "kill -9 of the store's host", "a"),
        "disk full": inject_disk_full,
        "corrupt latest checkpoint": lambda tmp: inject_in_script(tmp, "corrupt latest checkpoint", "corrupt"),
        "a stalled rank": lambda tmp: inject_in_script(tmp, "a stalled rank", "stall", "--watchdog-timeout", "10"),
        "kill -9 of a rank, checkpoints in S3": lambda tmp: inject_in_s3(
            tmp, "kill -9 of a rank, checkpoints in S3", "kill", S3["url"] + "/kill"
        ),
        "an interrupted upload (S3)": lambda tmp: inject_in_s3(
            tmp, "an interrupted upload (S3)", "upload", S3["url"] + "/upload"
        ),
        "bad S3 credentials": lambda tmp: inject_bad_credentials(tmp, S3["url"] + "/credentials"),
        "the first node lost, etcd": lambda tmp: inject_node(tmp, "the first node lost, etcd", "a", S3["etcd"]),
    }
    needs = {
        "kill -9 of a node": "network namespaces",
        "kill -9 of the store's host": "network namespaces",
        "disk full": "mounting a tmpfs",
    }
    needs.update({"the first node lost, etcd": "network namespaces"})
    chosen = [name for name in faults if args.only is None or name in args.only]
    rows: list[Row] = []
    netns_up = False
    with tempfile.TemporaryDirectory(prefix="phalanx-faults-") as name, contextlib.ExitStack() as services:
        tmp = Path(name)
        (tmp / "workload.py").write_text(WORKLOAD)
        try:
            for fault in chosen:
                if ("S3" in fault or "etcd" in fault) and not S3:
                    start_services(services, tmp, [f for f in chosen if "S3" in f or "etcd" in f])
                    netns_up = netns_up or "etcd" in S3  # etcd lives in node B's namespace: keep it
                reason = why_not_root(needs[fault]) if fault in needs else None
                if reason is None and needs.get(fault) == "network namespaces" and not netns_up:
                    if shutil.which("ip") is None:
                        reason = "iproute2 is not installed (scripts/ci-netns-deps)"
                    else:
                        subprocess.run([str(NETNS), "down", NODES["a"][0], NODES["b"][0]])
                        subprocess.run(
                            [str(NETNS), "up", NODES["a"][0], NODES["b"][0], NODES["a"][1], NODES["b"][1]], check=True
                        )
                        netns_up = True
                if reason is None and ("S3" in fault and "url" not in S3 or "etcd" in fault and "etcd" not in S3):
                    reason = S3.get("why", "its service did not start")
                if reason:
                    rows.append(Row(fault, f"not run: {reason}", "-", "-"))
                    continue
                started = time.monotonic()
                rows.append(faults[fault](tmp))
                print(f"# {fault}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        finally:
            if netns_up:
                subprocess.run([str(NETNS), "down", NODES["a"][0], NODES["b"][0]])
    print(f"load average {os.getloadavg()[0]:.1f}; faults at step {AT} of {STEPS}, checkpoints every 5 steps")
    header = ("fault", "survived", "steps lost", "seconds to recover", "stopped in (s)", "what phalanx said")
    table = [header] + [(r.fault, r.survived, r.steps_lost, r.recover_s, r.stopped_s, r.note) for r in rows]
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in table[1:]:
            print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    else:
        for row in table:
            print("  ".join(row))


S3: dict[str, str] = {}  # "url" of the S3 server's bucket, "etcd" endpoint, or "why" not


def start_services(services: contextlib.ExitStack, tmp: Path, chosen: list[str]) -> None:
    """moto's S3 server on loopback (the tests' fixture), and etcd in node B's namespace, as the rows need."""
    sys.path.insert(0, str(ROOT))
    S3["started"] = "1"
    if any("S3" in f for f in chosen):
        try:
            from tests.checkpoint.s3_server import s3_server

            server = services.enter_context(s3_server(tmp))
            EXTRA_ENV.update(server.env)
            S3["url"] = server.url("faults")
        except ImportError as error:
            S3["why"] = f"{error} (pip install -e '.[test]')"
    if any("etcd" in f for f in chosen) and os.geteuid() == 0 and shutil.which("ip"):
        from tests.multinode.etcd_server import why_no_etcd

        if why_no_etcd():
            S3["why"] = why_no_etcd() or ""
            return
        subprocess.run([str(NETNS), "down", NODES["a"][0], NODES["b"][0]])
        subprocess.run([str(NETNS), "up", NODES["a"][0], NODES["b"][0], NODES["a"][1], NODES["b"][1]], check=True)
        services.callback(subprocess.run, [str(NETNS), "down", NODES["a"][0], NODES["b"][0]])
        from tests.multinode.etcd_server import etcd_server

        S3["etcd"] = services.enter_context(etcd_server(tmp, NODES["b"][1], 23791, 23792, netns=NODES["b"][0]))


if __name__ == "__main__":
    main()
