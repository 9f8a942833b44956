"""The `keras-dist` command line."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap

from keras_dist.launchers.config import LaunchConfig
from keras_dist.launchers.train import planned_tf_configs
from keras_dist.launchers.train import run as run_job


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks and shows each option's set default."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = not any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


_LAUNCH_EXAMPLES = """\
examples:
  keras-dist launch --num-workers 2 train.py --epochs 3
      2 workers on 127.0.0.1; everything after the script goes to it
  keras-dist launch --num-workers 2 -m mypackage.train -- --epochs 3
      run a module (python -m); "--" ends keras-dist's own options
  keras-dist launch --num-workers 2 --max-restarts 3 --log-dir logs train.py
      restart the group after a failure (resume with BackupAndRestore);
      per-worker logs in logs/worker-<rank>.log
  keras-dist launch --num-workers 3 --min-workers 1 --log-dir logs train.py
      elastic: a failed or preempted worker is left out (down to 1 worker),
      the job goes on from its BackupAndRestore backup and grows back later
  keras-dist launch --hosts n1:2222,n2:2222 --rank 0 train.py
      multi-host: run once per host with its --rank
  keras-dist launch --hosts n1:2222,n2:2222,n3:2222 --rank 0 --min-workers 2 \\
      --rendezvous /shared/job/rendezvous train.py
      elastic multi-host: run on every host; lost hosts are left out and
      hosts that come back rejoin
  srun keras-dist launch train.py
      inside a Slurm allocation: the cluster comes from Slurm
  keras-dist launch --num-workers 4 train.py
      on a host with 8 GPUs: each worker gets 2 (CUDA_VISIBLE_DEVICES)
  keras-dist launch --kubernetes --num-workers 4 train.py
      in each pod of an Indexed Job or JobSet of 4 pods (the cluster is
      read from the pod; keras-dist manifest kubernetes prints the job)
  keras-dist launch --num-workers 2 --print-tf-config
      each worker's TF_CONFIG, one JSON line each
"""

_MANIFEST_EXAMPLES = """\
examples:
  keras-dist manifest kubernetes --num-workers 4 --image registry/train:1 \\
      train.py --epochs 10 | kubectl apply -f -
      a headless Service and an Indexed Job of 4 pods
  keras-dist manifest kubernetes --kind jobset --num-workers 2 \\
      --gpus-per-worker 8 --backup-claim backups --image registry/train:1 \\
      train.py
      a JobSet of 2 pods with 8 GPUs each, a volume for the backups
"""

_TUNE_EXAMPLES = """\
examples:
  keras-dist tune --num-workers 2 search.py
      a keras-tuner script (keras_tuner or keras_dist.tuner tuners):
      a chief serving the oracle and 2 tuner workers, one trial each
  keras-dist tune --num-workers 4 --workers-per-trial 2 search.py -- --epochs 5
      2 trial groups of 2 workers (keras_dist.tuner tuners), each trial
      trained by MultiWorkerMirroredStrategy across its group
"""


def _in_flags(error: Exception, args) -> str:
    """An argument error as the command line says it: `--num-workers -1`
    where the Python API says `num_workers=-1`."""
    text = str(error)
    for name in sorted(vars(args), key=len, reverse=True):
        if name in ("command", "script", "script_args"):
            continue
        flag = "--" + name.replace("_", "-")
        text = text.replace(f"argument `{name}`", f"option {flag}")
        text = text.replace(f"Argument `{name}`", f"Option {flag}")
        text = text.replace(f"`{name}`", flag)
        text = re.sub(rf"(?<![\w-]){name}=(\S+?)(?=[.,;)]?(?:\s|$))",
                      lambda m, flag=flag: _flag_value(flag, m.group(1)), text)
        if "_" in name:  # a bare Python name (a word with "_" is no prose)
            text = re.sub(rf"(?<![\w`-]){name}(?![\w=`])", flag, text)
    # "--min-workers K (--min-workers K)": said once.
    return re.sub(r"(--[\w-]+(?: [^\s()]+)?) \(\1\)", r"\1", text)


def _flag_value(flag: str, value: str) -> str:
    if value == "True":
        return flag
    if value in ("None", "False"):
        return f"no {flag}"
    return f"{flag} {value}"


def _fill(text: str) -> str:
    return textwrap.fill(text, break_on_hyphens=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-dist", description="keras_dist command line tools."
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "launch",
        help="start and supervise the workers of a multi-worker job",
        formatter_class=_Formatter,
        epilog=_LAUNCH_EXAMPLES,
        description=_fill(
            "Start and supervise the workers of a multi-worker job. Local: "
            "--num-workers N. Multi-host: --hosts h1:port,h2:port --rank I, "
            "once per host. Inside Slurm: neither (srun keras-dist launch ...)."
        ),
    )
    run.add_argument("--num-workers", type=int, help="local workers on 127.0.0.1")
    run.add_argument("--hosts", help="host1:port,host2:port (multi-host)")
    run.add_argument("--rank", type=int, help="this host's index in --hosts")
    run.add_argument("--kubernetes", action="store_true",
                     help="in a pod of an Indexed Job or JobSet of --num-workers "
                     "pods: start this pod's worker; the cluster is read from "
                     "the pod (worker i listens on --port + i, default 2222)")
    run.add_argument("--port", type=int,
                     help="local mode: worker i listens on 127.0.0.1:PORT+i "
                     "(default: free ports)")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restart the worker group after a failure, up to K times")
    run.add_argument("--min-workers", type=int, metavar="K",
                     help="local mode, elastic: when a worker fails after the "
                     "restarts are used up, or is preempted (exit 42), go on "
                     "from the last backup with one worker fewer, down to K")
    run.add_argument("--rejoin-after", type=float, default=60.0, metavar="SECONDS",
                     help="with --min-workers: grow back to --num-workers "
                     "after training this long on fewer (the group saves and "
                     "exits first)")
    run.add_argument("--rendezvous", metavar="DIR|etcd://HOST:PORT/PREFIX",
                     help="multi-host with --min-workers: where the launchers "
                     "agree on who runs: a directory every host sees, or a key "
                     "prefix of an etcd cluster")
    run.add_argument("--gpus-per-worker", type=int, metavar="K",
                     help="GPUs each worker on this host gets (through "
                     "CUDA_VISIBLE_DEVICES; 0: none, train on the CPUs) "
                     "(default: this host's GPUs split evenly)")
    run.add_argument("--log-dir", help="write worker-<rank>.log files here "
                     "(default: prefixed lines on standard output)")
    run.add_argument("--grace-period", type=float, default=5.0,
                     help="seconds workers get to exit after SIGTERM")
    run.add_argument("--print-tf-config", action="store_true",
                     help="print each worker's TF_CONFIG (one JSON line each) and exit")
    _common(run, "training")
    tune = commands.add_parser(
        "tune",
        help="run a distributed keras-tuner search on this machine",
        formatter_class=_Formatter,
        epilog=_TUNE_EXAMPLES,
        description=_fill(
            "Start a keras-tuner search script as a chief (keras-tuner's gRPC "
            "oracle, on 127.0.0.1 only) and --num-workers tuner workers, and "
            "supervise them. --workers-per-trial M groups the workers into "
            "MultiWorkerMirroredStrategy clusters of M, each running one "
            "trial at a time."
        ),
    )
    tune.add_argument("--num-workers", type=int, required=True,
                      help="tuner worker processes (besides the chief)")
    tune.add_argument("--workers-per-trial", type=int, default=1,
                      help="processes that train each trial together")
    tune.add_argument("--port", type=int, help="the oracle's port (default: a free one)")
    tune.add_argument("--gpus-per-worker", type=int, metavar="K",
                      help="GPUs each tuner worker gets (through "
                      "CUDA_VISIBLE_DEVICES; 0: none) (default: this machine's "
                      "GPUs split evenly; the chief gets none)")
    tune.add_argument("--log-dir", help="write <label>.log files here "
                      "(default: prefixed lines on standard output)")
    tune.add_argument("--grace-period", type=float, default=5.0,
                      help="seconds processes get to exit after SIGTERM")
    tune.add_argument("--finish-timeout", type=float, default=300.0,
                      help="seconds the chief gets to finish after the last "
                      "worker exited")
    _common(tune, "search")
    manifest = commands.add_parser(
        "manifest",
        help="print the manifests that run a job on a cluster scheduler",
        formatter_class=_Formatter,
        epilog=_MANIFEST_EXAMPLES,
        description=_fill(
            "Print what runs a training script as a job of --num-workers "
            "workers on Kubernetes: a headless Service and an Indexed Job "
            "(--kind job) or a JobSet (--kind jobset), each pod running "
            "keras-dist launch --kubernetes. Pods that exit 42 (a "
            "BackupAndRestore preemption save) are replaced without counting "
            "as failures."
        ),
    )
    manifest.add_argument("scheduler", choices=["kubernetes"])
    manifest.add_argument("--num-workers", type=int, required=True,
                          help="pods, one worker each")
    manifest.add_argument("--image", required=True,
                          help="container image with the script and keras_dist")
    manifest.add_argument("--name", default="keras-dist",
                          help="name of the job, its Service and its pods' hosts")
    manifest.add_argument("--kind", choices=["job", "jobset"], default="job",
                          help="an Indexed Job with a headless Service, or a JobSet")
    manifest.add_argument("--port", type=int, default=2222,
                          help="worker i listens on PORT + i")
    manifest.add_argument("--gpus-per-worker", type=int, default=0,
                          help="GPUs each pod requests (nvidia.com/gpu)")
    manifest.add_argument("--max-restarts", type=int, default=0,
                          help="failures of the whole group to retry")
    manifest.add_argument("--backup-claim", metavar="PVC",
                          help="a PersistentVolumeClaim mounted on every pod "
                          "(for BackupAndRestore's backup_dir)")
    manifest.add_argument("--backup-mount", default="/backups",
                          help="where --backup-claim is mounted")
    manifest.add_argument("script", help="the training script, in the image")
    manifest.add_argument("script_args", nargs=argparse.REMAINDER,
                          help="arguments for the script ('--' first is optional)")
    return parser


def _common(command, kind: str) -> None:
    command.add_argument("-m", "--module", action="store_true",
                         help=f"the {kind} script is a module name (python -m)")
    command.add_argument("-v", "--verbose", action="store_true",
                         help="show TensorFlow's start-up lines and C++ INFO logs")
    command.add_argument("--private-network", action=argparse.BooleanOptionalAction,
                         default=None,
                         help="run a local job in its own network namespace "
                         "(only a private loopback: nothing outside can reach "
                         "the workers, nor can they reach the network); the "
                         "default where the machine can make one (Linux); "
                         "--no-private-network gives the workers this host's "
                         "network")
    command.add_argument("--start-timeout", type=float, default=300.0,
                         metavar="SECONDS",
                         help="stop the job when a worker of a multi-worker "
                         "group has not joined its cluster after this long "
                         "(0: no limit)")
    command.add_argument("--hang-timeout", type=float, default=900.0,
                         metavar="SECONDS",
                         help="stop the job when a worker makes no step for "
                         "this long after it joined"
                         + (" (inside a trial)" if kind != "training" else "")
                         + " (0: no limit); a stopped or silent process is "
                         "reported after 15 s")
    nargs = "?" if kind == "training" else None
    command.add_argument("script", nargs=nargs, help=f"the {kind} script (or module)")
    command.add_argument("script_args", nargs=argparse.REMAINDER,
                         help="arguments for the script ('--' first is optional)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("keras-dist")
    except PackageNotFoundError:  # pragma: no cover - source tree, not installed
        return "unknown (not installed)"


def parse(argv: list[str] | None = None, parser=None):
    """(options, the script's arguments) of a `keras-dist` command line."""
    args = (parser or _parser()).parse_args(argv)
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if args.script == "--" and script_args:
        args.script, script_args = script_args[0], script_args[1:]
    return args, script_args


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, script_args = parse(argv, parser)
    if args.command == "manifest":
        from keras_dist.launchers import kubernetes

        try:
            print(kubernetes.to_yaml(kubernetes.manifests(
                args.name, args.image, args.num_workers, [args.script, *script_args],
                port=args.port, gpus_per_worker=args.gpus_per_worker,
                max_restarts=args.max_restarts, backup_claim=args.backup_claim,
                backup_mount=args.backup_mount, kind=args.kind,
            )), end="")
        except ValueError as e:
            print(f"keras-dist manifest: error: {_in_flags(e, args)}", file=sys.stderr)
            return 2
        return 0
    if args.command == "tune":
        from keras_dist.launchers.search import launch_search

        try:
            return launch_search(
                args.script,
                script_args,
                num_workers=args.num_workers,
                workers_per_trial=args.workers_per_trial,
                port=args.port,
                log_dir=args.log_dir,
                grace_period=args.grace_period,
                finish_timeout=args.finish_timeout,
                module=args.module,
                verbose=args.verbose,
                start_timeout=args.start_timeout or None,
                hang_timeout=args.hang_timeout or None,
                private_network=args.private_network,
                gpus_per_worker=args.gpus_per_worker,
            )
        except (ValueError, TypeError) as e:
            print(f"keras-dist tune: error: {_in_flags(e, args)}", file=sys.stderr)
            return 2
    try:
        if args.print_tf_config:
            for rank, config in enumerate(
                planned_tf_configs(num_workers=args.num_workers, hosts=args.hosts)
            ):
                print(json.dumps({"rank": rank, "TF_CONFIG": json.loads(config)}))
            return 0
        if args.script is None:
            parser.error("the following arguments are required: script")
        return run_job(LaunchConfig.from_cli(args, script_args))
    except (ValueError, TypeError) as e:
        print(f"keras-dist launch: error: {_in_flags(e, args)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
