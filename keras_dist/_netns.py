"""A local job in its own network namespace (the default where one can be
made; `private_network=True` requires it, `False` opts out).

TensorFlow's gRPC server listens on every interface (`[::]:PORT`) whatever
host `TF_CONFIG` names (`GrpcServer::Init` in
tensorflow/core/distributed_runtime/rpc/grpc_server_lib.cc passes a
wildcard address to `AddListeningPort`; TensorFlow 2.21 has no setting for
it). A local job can still be kept off the network: the launcher re-runs
itself under `unshare --net` (with `--map-root-user` when not root), where
the only interface is a private loopback, so the workers' servers and the
tuner's oracle cannot be reached from outside, and the workers cannot reach
the network either.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

ENV = "KERAS_DIST_PRIVATE_NETWORK"

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def _unshare() -> list[str]:
    flags = ["--net"] if os.geteuid() == 0 else ["--net", "--map-root-user"]
    return ["unshare", *flags]


_reason_cache: list = []


def unavailable() -> str | None:
    """Why no private network namespace can be made here, or None."""
    if _reason_cache:
        return _reason_cache[0]
    reason = None
    if not sys.platform.startswith("linux"):
        reason = f"network namespaces are a Linux feature (this is {sys.platform})"
    elif shutil.which("unshare") is None:
        reason = "the `unshare` command (util-linux) is not installed"
    else:
        probe = subprocess.run(
            [*_unshare(), "--", "true"], capture_output=True, text=True
        )
        if probe.returncode != 0:
            reason = f"`unshare --net` failed here: {probe.stderr.strip()}"
    _reason_cache.append(reason)
    return reason


def check() -> None:
    """Raises ValueError, naming why, where a private network cannot be made."""
    reason = unavailable()
    if reason:
        raise ValueError(
            "Invalid value for argument `private_network`: True needs a "
            f"private network namespace, and {reason}. Received: "
            "private_network=True. Run without it and keep the workers' ports "
            "behind a firewall (see the launch guide, 'Network exposure')."
        )


def wanted(private_network, *, local: bool, received: str) -> bool:
    """Whether this launcher should re-run itself in a private network.

    `private_network`: True (required: refused where it cannot be made or
    for a multi-host job), None (the default: a local job gets one where it
    can be made) or False. `received`: the job's cluster options, for the
    error message.
    """
    if private_network not in (True, False, None):
        raise ValueError(
            "Invalid value for argument `private_network`. Expected True, "
            f"False or None (the default). Received: private_network={private_network!r}."
        )
    if inside() or private_network is False:
        return False
    if private_network is None:
        return local and unavailable() is None
    if not local:
        raise ValueError(
            "Invalid value for argument `private_network`: it isolates a "
            "local job (num_workers=N); a multi-host job needs the network. "
            f"Received: private_network=True with {received}. Keep multi-host "
            "jobs on a private network or behind a firewall."
        )
    check()
    return True


def exposure(*, local: bool, private_network) -> str:
    """One console line: who can reach the job's servers (their ports are
    on the start line)."""
    if inside():
        return ("private network: only this job's processes can reach its "
                "workers, and the workers reach no network (--no-private-network "
                "gives them this host's network)")
    if not local:
        return ("this host's worker listens on every interface: reachable from any "
                "host that can route to this one; keep the job's ports behind a "
                "firewall (docs/launch.md, 'Network exposure')")
    why = ("--no-private-network was given" if private_network is False
           else f"no private network here: {unavailable()}")
    return (f"the workers listen on every interface of this host ({why}): "
            "reachable from the network; keep their ports behind a firewall "
            "(docs/launch.md, 'Network exposure')")


def run_inside(cli_args: list[str]) -> int:
    """Runs `keras-dist CLI_ARGS` in a new network namespace; its exit status.

    Output goes straight through; SIGINT/SIGTERM are passed on.
    """
    env = dict(os.environ, **{ENV: "1"})
    proc = subprocess.Popen(
        [*_unshare(), "--", sys.executable, "-m", "keras_dist.cli", *cli_args],
        env=env,
        # Out of the terminal's process group: a Ctrl-C reaches it once,
        # passed on from here (twice would mean "stop at once").
        start_new_session=True,
    )
    previous = {}

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[signum] = signal.signal(signum, forward)
        except ValueError:  # not the main thread
            pass
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def inside() -> bool:
    return bool(os.environ.get(ENV))


def relaunch(command: list[str], script: str, script_args, *, port, log_dir,
             grace_period, module, verbose, start_timeout, hang_timeout) -> int:
    """Runs `keras-dist COMMAND [shared options] SCRIPT -- SCRIPT_ARGS` in a
    new network namespace (`wanted` said so); its exit status."""
    args = list(command) + [
        "--grace-period", repr(float(grace_period)),
        "--start-timeout", repr(float(start_timeout or 0)),
        "--hang-timeout", repr(float(hang_timeout or 0)),
    ]
    if port is not None:
        args += ["--port", str(port)]
    if log_dir:
        args += ["--log-dir", os.fspath(log_dir)]
    if module:
        args.append("--module")
    if verbose:
        args.append("--verbose")
    return run_inside([*args, script, "--", *script_args])


def set_up_if_inside() -> None:
    """In the launcher that `run_inside` started: bring the loopback up, and
    end when the launcher outside is gone (SIGKILL, the OOM killer): its
    workers then find their own launcher gone and stop (`_liveness`)."""
    if inside():
        bring_up_loopback()
        threading.Thread(target=_stop_with, args=(os.getppid(),),
                         name="keras-dist-parent-watch", daemon=True).start()


def _stop_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    with contextlib.suppress(OSError, ValueError):  # its terminal or pipe may be gone too
        sys.stderr.write(f"[keras-dist] the launcher (pid {parent}) is gone: stopping\n")
        sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def bring_up_loopback() -> None:
    """A new network namespace starts with its loopback interface down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)  # struct ifreq: 40 bytes
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(
                sock, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP)
            )
