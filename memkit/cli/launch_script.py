"""memkit launch-script: a shell script that starts `accelerate launch` on every node of a plan.

--slurm: an sbatch script; `srun` starts one launcher per node with machine rank
$SLURM_NODEID and rendezvous at the first node of the allocation.
--hostfile FILE: a bash script for hosts reached over ssh (one host per line, optional
`slots=N` as in DeepSpeed hostfiles); host i gets machine rank i, host 0 is the rendezvous.
Run `bash run.sh` to start every node, or `MACHINE_RANK=i bash run.sh --node` on node i.
Ctrl-C or SIGTERM to `bash run.sh` reaches every node: each node writes its launcher's pid to
/tmp/memkit-RUN.rankI.pid and the script's trap signals those pids over ssh (a dropped ssh
client alone leaves a remote process running: without a tty no SIGHUP reaches it).

The nodes run this interpreter by its absolute path (sys.executable; --python to change it):
non-interactive ssh does not activate the virtual environment that `python` would need.

Every node runs torchrun through Accelerate's standard multi-node DeepSpeed launcher
(`--deepspeed_multinode_launcher standard`, static rendezvous), so no pdsh is needed. Split
plans (tp/pp) get the same script: the world is dp x pp x tp with tp innermost
(memkit.plan.parallel.RankLayout), so a TP group stays on one node when the processes per node are a
multiple of tp (checked); pipeline stages may span nodes.
"""
from __future__ import annotations

import argparse
import os
import shlex
import stat
import sys
from pathlib import Path

from memkit.train.supervise import TORCHELASTIC_SIGNALS
from memkit.errors import MemkitError

HELP = "write a Slurm or hostfile script that starts accelerate launch on every node of a plan"
DEFAULT_PORT = 29500
DEFAULT_SIGNAL_LEAD_S = 660
"""--signal-lead: the time-limit warning comes this long before Slurm's SIGTERM + KillWait (30 s
default): 600 s of TORCH_ELASTIC_SHUTDOWN_TIMEOUT for the save plus a minute for the step in flight."""
SHUTDOWN_LINE = ("# On SIGTERM torchrun gives workers this long to write their checkpoint before SIGKILL\n"
                 "# (torch/distributed/launcher/api.py; its default is 30 s).\n"
                 'export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"')
def alloc_line(alloc_conf: str = "expandable") -> str:
    """The CUDA allocator the plan was priced with (TrainingPlan.alloc_conf, plan/plan.py ALLOC_CONF_ENV),
    exported for every rank; a value already set is kept (the runner then says it differs)."""
    from memkit.plan.plan import ALLOC_CONF_ENV

    env = ALLOC_CONF_ENV[alloc_conf]
    if not env:
        return "# The plan was priced with torch's default allocator segments: PYTORCH_CUDA_ALLOC_CONF stays unset."
    return (f"# The CUDA allocator configuration the plan was priced with (--alloc-conf {alloc_conf});\n"
            "# a value already set is kept.\n"
            f'export PYTORCH_CUDA_ALLOC_CONF="${{PYTORCH_CUDA_ALLOC_CONF:-{env}}}"')


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan.json written by `memkit suggest --out DIR`")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--slurm", action="store_true", help="write an sbatch script")
    how.add_argument("--hostfile", help="file with one host per line (host [slots=N])")
    p.add_argument("--config-file", help="accelerate config (default: accelerate.yaml beside plan.json)")
    p.add_argument("--out", default="run.sh", help="script to write (default run.sh)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="rendezvous port on node 0")
    p.add_argument("--num-machines", type=int, help="nodes (default: the plan's hardware)")
    p.add_argument("--gpus-per-node", type=int, help="processes per node (default: the plan's hardware)")
    p.add_argument("--python", default=sys.executable,
                   help=f"python on the nodes (default: this interpreter, {sys.executable}; the same path must "
                        "exist on every node)")
    p.add_argument("--cpus-per-node", type=int,
                   help="--slurm: CPUs for each node's launcher and its ranks (default: all of the node's, "
                        "$SLURM_CPUS_ON_NODE of the exclusive allocation)")
    p.add_argument("--signal-lead", type=int, default=DEFAULT_SIGNAL_LEAD_S, metavar="SECONDS",
                   help=f"--slurm: SIGUSR1 this long before the time limit (checkpoint, exit, requeue; default "
                        f"{DEFAULT_SIGNAL_LEAD_S})")
    p.add_argument("finetune_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for launch/finetune.py (--data, --output-dir, ...)")


def run(args: argparse.Namespace) -> int:
    from memkit.cli.launching import finetune_entry
    from memkit.train.config import read_plan_file

    from memkit.validate import check_launch_files

    plan, doc = read_plan_file(args.plan)
    config_file, acc, ds_path, _ = check_launch_files(plan, plan_path=args.plan, config_file=args.config_file)
    if config_file is None:
        raise MemkitError(f"no accelerate config beside {args.plan}; pass --config-file")
    hardware = doc.get("hardware") or {}
    num_machines = args.num_machines or hardware.get("num_nodes") or int(acc.get("num_machines", 1))
    per_node = args.gpus_per_node or hardware.get("num_gpus_per_node") or \
        int(acc.get("num_processes", 1)) // max(1, int(acc.get("num_machines", 1)))
    hosts: list[str] = []
    if args.hostfile:
        hosts, slots = read_hostfile(args.hostfile)
        if slots is not None and args.gpus_per_node is None:
            per_node = slots
        if len(hosts) != num_machines:
            raise MemkitError(f"--hostfile {args.hostfile} lists {len(hosts)} hosts but the plan needs "
                              f"{num_machines} machines; list {num_machines} hosts or pass --num-machines")
    if per_node * num_machines != plan.num_gpus:
        raise MemkitError(f"{num_machines} machines x {per_node} processes = {per_node * num_machines}, but the "
                          f"plan uses {plan.num_gpus} GPUs (dp*tp*pp); fix --num-machines/--gpus-per-node")
    from memkit.plan.parallel import tp_spans_nodes

    if tp_spans_nodes(plan.tp, per_node):  # memkit.plan.parallel states the rule
        raise MemkitError(f"tp={plan.tp} with {per_node} processes per node: a TP group would span nodes; "
                          f"use --gpus-per-node a multiple of {plan.tp}")
    finetune_args = list(args.finetune_args)
    if finetune_args[:1] == ["--"]:
        finetune_args = finetune_args[1:]
    if "--plan" not in finetune_args:
        finetune_args = ["--plan", str(Path(args.plan).resolve()), *finetune_args]
    if args.slurm and "--resume" not in finetune_args:  # a requeued job continues from its checkpoint
        finetune_args.append("--resume")
    if args.cpus_per_node is not None and (args.cpus_per_node < per_node or not args.slurm):
        raise MemkitError(f"--cpus-per-node {args.cpus_per_node}: give it with --slurm, at least one CPU per "
                          f"process ({per_node})")
    entry = finetune_entry()
    # ds_path is absolute (memkit.cli.launching.deepspeed_file): every node launches from its own cwd
    body = dict(config=str(Path(config_file).resolve()), num_machines=num_machines, per_node=per_node,
                port=args.port, python=args.python, entry=entry, finetune_args=finetune_args,
                ds_config=str(ds_path) if ds_path is not None else None, alloc_conf=plan.alloc_conf)
    text = (slurm_script(**body, cpus_per_node=args.cpus_per_node, signal_lead_s=args.signal_lead) if args.slurm
            else hostfile_script(hosts=hosts, **body))
    from memkit.fileio import temp_beside

    out = Path(args.out)
    tmp = temp_beside(out)  # written whole, then renamed: a failure never leaves half a script
    try:
        tmp.write_text(text)
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    how = f"sbatch {shlex.quote(str(out))}" if args.slurm else f"bash {shlex.quote(str(out))}"
    split = f" (dp {plan.dp} x tp {plan.tp} x pp {plan.pp})" if plan.tp > 1 or plan.pp > 1 else ""
    print(f"wrote {out}: {num_machines} nodes x {per_node} processes{split}; start it with `{how}`")
    return 0


def read_hostfile(path: str) -> tuple[list[str], int | None]:
    """Hosts in order, and their common slots=N if the file gives it."""
    from memkit.fileio import read_text

    hosts, slots = [], set()
    for line_no, line in enumerate(read_text(path, what="--hostfile").splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        from memkit.plan.plan_schema import check_host

        hosts.append(check_host(parts[0], what=f"--hostfile {path}: line {line_no}: host"))
        for part in parts[1:]:
            key, _, value = part.partition("=")
            if key == "slots":
                if not value.isdigit() or int(value) < 1:
                    raise MemkitError(f"--hostfile {path}: line {line_no}: slots={value!r} must be a positive integer")
                slots.add(int(value))
    if not hosts:
        raise MemkitError(f"--hostfile {path} lists no hosts")
    if len(slots) > 1:
        raise MemkitError(f"--hostfile {path}: hosts have different slots {sorted(slots)}; "
                          "memkit plans one process count per node")
    return hosts, (slots.pop() if slots else None)


def _launch_line(*, python: str, config: str, num_machines: int, per_node: int, rank: str, addr: str,
                 port: str, entry: list[str], ds_config: str | None, args_expr: str = '"${ARGS[@]}"') -> str:
    """The per-node command (bash); rank/addr/port/args_expr are shell expressions. The DeepSpeed
    file is passed by its absolute path (accelerate launch's --deepspeed_config_file overrides
    the YAML's, which may be relative to another directory)."""
    ds = f"--deepspeed_config_file {shlex.quote(ds_config)} " if ds_config else ""
    return (f"exec {shlex.quote(python)} -m accelerate.commands.launch --config_file {shlex.quote(config)} {ds}"
            f"--num_machines {num_machines} --num_processes {num_machines * per_node} "
            f"--machine_rank {rank} --main_process_ip {addr} --main_process_port {port} "
            "--deepspeed_multinode_launcher standard --rdzv_backend static --same_network "
            f"{' '.join(shlex.quote(e) for e in entry)} {args_expr}")


def _args_array(finetune_args: list[str]) -> str:
    return "ARGS=(" + " ".join(shlex.quote(a) for a in finetune_args) + ")"


def slurm_script(*, config: str, num_machines: int, per_node: int, port: int, python: str,
                 entry: list[str], finetune_args: list[str], ds_config: str | None = None,
                 cpus_per_node: int | None = None, signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S,
                 alloc_conf: str = "expandable") -> str:
    """The sbatch script. Stops (memkit.train.loop.StopFlag): scancel / preemption SIGTERM every
    process of the job at once (the ranks ignore the repeats and save once); SIGUSR1 comes
    signal_lead_s before the time limit to the batch shell only (`B:`, sbatch man page, --signal),
    which relays it to the job's steps (`scancel --signal=USR1`: without --batch/--full, the steps
    only) and, once they have checkpointed and exited, requeues the job (`scontrol requeue`;
    `--requeue` lets Slurm requeue it after a preemption or node failure too). The run resumes from
    its newest checkpoint on every start (`--resume`; none yet: step 0)."""
    inner = _launch_line(python=python, config=config, num_machines=num_machines, per_node=per_node,
                         rank='"$SLURM_NODEID"', addr='"$MEMKIT_MASTER_ADDR"', port='"$MEMKIT_MASTER_PORT"',
                         entry=entry, ds_config=ds_config, args_expr='"$@"')
    # One task per node runs the launcher and all its ranks: without --cpus-per-task srun binds it to
    # one CPU (Slurm's default is 1 CPU per task; srun does not inherit sbatch's --cpus-per-task since
    # Slurm 22.05, sbatch/srun man pages), and every rank and data worker would share that CPU.
    cpus = str(cpus_per_node) if cpus_per_node else '"$SLURM_CPUS_ON_NODE"'
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --job-name=memkit",
        f"#SBATCH --nodes={num_machines}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --cpus-per-task={cpus_per_node}"] if cpus_per_node else []),
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --exclusive",
        "# SIGUSR1 to this shell before the time limit: the ranks checkpoint and exit, the job requeues.",
        f"#SBATCH --signal=B:USR1@{signal_lead_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "# Written by `memkit launch-script --slurm`. One accelerate launcher per node.",
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        SHUTDOWN_LINE,
        alloc_line(alloc_conf),
        'export MEMKIT_MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f"export MEMKIT_MASTER_PORT={port}",
        # torchrun relays SIGUSR1 to the ranks instead of dying of it (memkit.train.supervise.launcher_env).
        f'export TORCHELASTIC_SIGNALS_TO_HANDLE="${{TORCHELASTIC_SIGNALS_TO_HANDLE:-{TORCHELASTIC_SIGNALS}}}"',
        'export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-$TORCHELASTIC_SIGNALS_TO_HANDLE}"  # torchrun\'s flag',
        _args_array(finetune_args),
        "REQUEUE=0",
        "on_usr1() {",
        '  REQUEUE=1',
        '  echo "memkit: SIGUSR1 (time limit near): the ranks checkpoint and exit; then requeue" >&2',
        '  scancel --signal=USR1 "$SLURM_JOB_ID"',
        "}",
        "trap on_usr1 USR1",
        "trap 'echo \"memkit: SIGTERM: the ranks checkpoint and exit\" >&2' TERM  # the shell waits for them",
        f"srun --kill-on-bad-exit=1 --ntasks={num_machines} --ntasks-per-node=1 --cpus-per-task={cpus} "
        f"bash -c {shlex.quote(inner)} memkit-node \"${{ARGS[@]}}\" &",
        "SRUN=$!",
        "status=0",
        '# `wait` returns early when a trapped signal arrives; wait again until srun has exited.',
        'while kill -0 "$SRUN" 2>/dev/null; do wait "$SRUN" && status=0 || status=$?; done',
        'wait "$SRUN" && status=0 || status=$?',
        'if [[ "$REQUEUE" == 1 ]]; then',
        '  echo "memkit: requeueing job $SLURM_JOB_ID; it resumes from its newest checkpoint" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$status"',
        "",
    ])


def hostfile_script(*, hosts: list[str], config: str, num_machines: int, per_node: int, port: int,
                    python: str, entry: list[str], finetune_args: list[str], ds_config: str | None = None,
                    alloc_conf: str = "expandable") -> str:
    node = _launch_line(python=python, config=config, num_machines=num_machines, per_node=per_node,
                        rank='"$MACHINE_RANK"', addr='"$MASTER_ADDR"', port='"$MASTER_PORT"', entry=entry,
                        ds_config=ds_config)
    return "\n".join([
        "#!/bin/bash",
        "# Written by `memkit launch-script --hostfile`.",
        "#   bash run.sh                          start every host over ssh (host i = machine rank i)",
        "#   MACHINE_RANK=i bash run.sh --node     run machine rank i on this host",
        "# Ctrl-C / SIGTERM: every host's launcher gets the signal (its ranks checkpoint and stop).",
        "set -euo pipefail",
        "HOSTS=(" + " ".join(shlex.quote(h) for h in hosts) + ")",
        f'MASTER_ADDR="${{MEMKIT_MASTER_ADDR:-{hosts[0]}}}"',  # a checked host name (read_hostfile)
        f'MASTER_PORT="${{MEMKIT_MASTER_PORT:-{port}}}"',
        'RUN_ID="${MEMKIT_RUN_ID:-$(date +%s)-$$}"',
        f"WORKDIR={shlex.quote(os.getcwd())}",
        SHUTDOWN_LINE,
        alloc_line(alloc_conf),
        _args_array(finetune_args),
        'if [[ "${1:-}" == "--node" ]]; then',
        '  : "${MACHINE_RANK:?set MACHINE_RANK to the index of this host in HOSTS}"',
        '  cd "$WORKDIR"',
        '  echo $$ > "/tmp/memkit-$RUN_ID.rank$MACHINE_RANK.pid"  # exec keeps the pid: the launcher\'s',
        f"  {node}",
        "fi",
        'SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"',
        "pids=()",
        "stop_all() {  # $1: the signal; each host's launcher relays it to its ranks",
        "  trap '' INT TERM",
        '  echo "memkit: SIG$1: stopping the launcher on every host" >&2',
        '  for i in "${!HOSTS[@]}"; do',
        '    ssh -o BatchMode=yes "${HOSTS[$i]}" "f=/tmp/memkit-$RUN_ID.rank$i.pid; '
        '[ -f \\$f ] && kill -$1 \\$(cat \\$f) 2>/dev/null; rm -f \\$f" || true',
        "  done",
        '  for pid in "${pids[@]}"; do wait "$pid" || true; done',
        '  [[ "$1" == INT ]] && exit 130 || exit 143',
        "}",
        "trap 'stop_all INT' INT",
        "trap 'stop_all TERM' TERM",
        'for i in "${!HOSTS[@]}"; do',
        '  ssh -o BatchMode=yes "${HOSTS[$i]}" "MACHINE_RANK=$i MEMKIT_RUN_ID=$RUN_ID MEMKIT_MASTER_ADDR=$(printf %q "$MASTER_ADDR") '
        'MEMKIT_MASTER_PORT=$(printf %q "$MASTER_PORT") bash $(printf %q "$SCRIPT") --node" &',
        '  pids+=($!)',
        "done",
        "status=0",
        'for pid in "${pids[@]}"; do wait "$pid" || status=$?; done',
        'exit "$status"',
        "",
    ])
