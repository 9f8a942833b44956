"""The `keras-dist` command line."""

from __future__ import annotations

import argparse
import json
import sys

from keras_dist.launcher import launch, planned_tf_configs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-dist", description="keras_dist command line tools."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "launch",
        help="start and supervise the workers of a multi-worker job",
        description=(
            "Start and supervise the workers of a multi-worker job. Local: "
            "--num-workers N. Multi-host: --hosts h1:port,h2:port --rank I, "
            "once per host. Inside Slurm: neither (srun keras-dist launch ...)."
        ),
    )
    run.add_argument("--num-workers", type=int, help="local workers on 127.0.0.1")
    run.add_argument("--hosts", help="host1:port,host2:port (multi-host)")
    run.add_argument("--rank", type=int, help="this host's index in --hosts")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restart the worker group after a failure, up to K times")
    run.add_argument("--log-dir", help="write worker-<rank>.log files here")
    run.add_argument("--grace-period", type=float, default=5.0,
                     help="seconds workers get to exit after SIGTERM (default 5)")
    run.add_argument("--print-tf-config", action="store_true",
                     help="print each worker's TF_CONFIG (one JSON line each) and exit")
    run.add_argument("script", nargs="?", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER,
                     help="arguments for the script")
    tune = commands.add_parser(
        "tune",
        help="run a distributed keras-tuner search on this machine",
        description=(
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
                      help="processes that train each trial together (default 1)")
    tune.add_argument("--port", type=int, help="the oracle's port (default: a free one)")
    tune.add_argument("--log-dir", help="write <label>.log files here")
    tune.add_argument("--grace-period", type=float, default=5.0,
                      help="seconds processes get to exit after SIGTERM (default 5)")
    tune.add_argument("--finish-timeout", type=float, default=300.0,
                      help="seconds the chief gets to finish after the last "
                      "worker exited (default 300)")
    tune.add_argument("script", help="the search script")
    tune.add_argument("script_args", nargs=argparse.REMAINDER,
                      help="arguments for the script")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if args.script == "--" and script_args:
        args.script, script_args = script_args[0], script_args[1:]
    if args.command == "tune":
        from keras_dist.search_launcher import launch_search

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
            )
        except (ValueError, TypeError) as e:
            print(f"keras-dist tune: error: {e}", file=sys.stderr)
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
        return launch(
            args.script,
            script_args,
            num_workers=args.num_workers,
            hosts=args.hosts,
            rank=args.rank,
            max_restarts=args.max_restarts,
            log_dir=args.log_dir,
            grace_period=args.grace_period,
        )
    except (ValueError, TypeError) as e:
        print(f"keras-dist launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
