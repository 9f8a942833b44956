"""Kubernetes: the manifests validate offline, and the in-pod path reads its
cluster from what a pod has.

The manifests are checked against the Kubernetes OpenAPI schemas shipped by
`kubernetes-validate` (the Service and the Indexed Job as they are; the
JobSet's Job template as a Job, the one part of a JobSet those schemas
cover). The in-pod reading is checked on the environments an Indexed Job
and a JobSet give their pods; tests/multi_worker/test_kubernetes_pods.py
runs it in processes that have them.
"""

import argparse

import kubernetes_validate
import pytest
import yaml

from keras_dist import cli
from keras_dist.launchers import kubernetes
from keras_dist.launchers.config import LaunchConfig

VERSION = kubernetes_validate.latest_version()
DOMAIN = "train.research.svc.cluster.local"


def validate(obj):
    kubernetes_validate.validate(obj, VERSION, strict=True)


@pytest.mark.parametrize("options", [
    {},
    {"gpus_per_worker": 8, "max_restarts": 3, "backup_claim": "backups",
     "backup_mount": "/mnt/b", "port": 30000},
])
def test_the_service_and_indexed_job_validate(options):
    objects = kubernetes.manifests("train", "registry.example/train:1", 4,
                                   ["train.py", "--epochs", "3"], **options)
    assert [o["kind"] for o in objects] == ["Service", "Job"]
    for obj in objects:
        validate(obj)
    service, job = objects
    pod = job["spec"]["template"]["spec"]
    # The pods' host names <job>-<index> live under the Service's domain,
    # and the Service selects exactly the job's pods.
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"][
        "labels"].items()
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "Ignore" and rule["onExitCodes"]["values"] == [42]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    container = pod["containers"][0]
    if options:
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert job["spec"]["backoffLimit"] == 12
        assert container["volumeMounts"] == [{"name": "backups", "mountPath": "/mnt/b"}]
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "backups"
    # The pod's command is one keras-dist reads back to the same job.
    assert container["command"][0] == "keras-dist"
    args, script_args = cli.parse(container["command"][1:])
    config = LaunchConfig.from_cli(args, script_args)
    assert (config.kubernetes, config.num_workers, config.script, config.script_args) == (
        True, 4, "train.py", ("--epochs", "3"))
    assert config.port == options.get("port", 2222)


def test_the_jobsets_job_template_validates():
    (jobset,) = kubernetes.manifests("train", "registry.example/train:1", 2, ["train.py"],
                                     kind="jobset", gpus_per_worker=1, max_restarts=2)
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 2}
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1  # one numbering of the pods
    validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
              "spec": replicated["template"]["spec"]})


def test_a_broken_manifest_does_not_validate():
    """The validator is strict: the checks above can fail."""
    _, job = kubernetes.manifests("train", "img", 2, ["train.py"])
    job["spec"]["completionMode"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(job)
    _, job = kubernetes.manifests("train", "img", 2, ["train.py"])
    job["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(job)


def test_the_printed_yaml_is_the_manifest(capsys):
    argv = ["manifest", "kubernetes", "--num-workers", "3", "--image", "r.example/t:2",
            "--name", "digits", "--backup-claim", "ckpt", "train.py", "--", "--lr", "0.1",
            "--name", "yes"]
    assert cli.main(argv) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert printed == kubernetes.manifests("digits", "r.example/t:2", 3,
                                           ["train.py", "--lr", "0.1", "--name", "yes"],
                                           backup_claim="ckpt")
    # Strings YAML would read as something else stay strings.
    assert printed[1]["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "yes"
    assert printed[0]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("args, message", [
    (["--name", "Train_1"], "option --name. Expected a lowercase DNS label"),
    (["--num-workers", "0"], "option --num-workers. Expected a positive integer. Received: --num-workers 0."),
    (["--port", "70000"], "option --port. Expected an integer from 1024 to 65534"),
    (["--gpus-per-worker", "-1"], "option --gpus-per-worker. Expected a non-negative integer"),
    (["--image", " "], "option --image. Expected a container image reference"),
    (["--backup-mount", "rel"], "option --backup-mount. Expected an absolute path"),
])
def test_manifest_arguments_are_checked(args, message, capsys):
    base = {"--num-workers": "2", "--image": "img"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["manifest", "kubernetes", *[x for kv in base.items() for x in kv], "train.py"]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


# -- inside a pod ---------------------------------------------------------------


def test_an_indexed_job_pod_names_every_worker():
    workers, rank = kubernetes.pod_cluster(
        3, 2222, environ={"JOB_COMPLETION_INDEX": "2"}, hostname="train-2",
        fqdn=f"train-2.{DOMAIN}")
    assert rank == 2
    assert workers == [f"train-{i}.{DOMAIN}:{2222 + i}" for i in range(3)]


def test_a_jobset_pod_names_every_worker():
    environ = {"JOB_COMPLETION_INDEX": "1", "JOB_INDEX": "0", "JOBSET_NAME": "train",
               "REPLICATED_JOB_NAME": "workers"}
    workers, rank = kubernetes.pod_cluster(
        2, 3000, environ=environ, hostname="train-workers-0-1",
        fqdn="train-workers-0-1.train.default.svc.cluster.local")
    assert rank == 1
    assert workers == ["train-workers-0-0.train.default.svc.cluster.local:3000",
                       "train-workers-0-1.train.default.svc.cluster.local:3001"]


@pytest.mark.parametrize("environ, hostname, fqdn, message", [
    ({}, "train-0", f"train-0.{DOMAIN}", "JOB_COMPLETION_INDEX is not set"),
    ({"JOB_COMPLETION_INDEX": "x"}, "train-0", f"train-0.{DOMAIN}", "JOB_COMPLETION_INDEX is 'x'"),
    ({"JOB_COMPLETION_INDEX": "0", "JOB_INDEX": "1"}, "t-1-0", f"t-1-0.{DOMAIN}",
     "the JobSet has several Jobs in its replicated job"),
    ({"JOB_COMPLETION_INDEX": "4"}, "train-4", f"train-4.{DOMAIN}",
     "this pod's JOB_COMPLETION_INDEX is 4, so the job has more than 2 pods"),
    ({"JOB_COMPLETION_INDEX": "1"}, "mypod", f"mypod.{DOMAIN}", "does not end with -1"),
    ({"JOB_COMPLETION_INDEX": "1"}, "train-1", "train-1", "has no domain"),
])
def test_a_pod_without_what_it_needs_is_refused(environ, hostname, fqdn, message):
    with pytest.raises(ValueError, match=message):
        kubernetes.pod_cluster(2, 2222, environ=environ, hostname=hostname, fqdn=fqdn)


def test_launch_kubernetes_refuses_what_does_not_apply(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    for args, message in [
        (["--kubernetes"], "Option --kubernetes needs --num-workers N"),
        (["--kubernetes", "--num-workers", "2", "--min-workers", "1"],
         "Option --min-workers does not apply with --kubernetes"),
    ]:
        assert cli.main(["launch", *args, str(script)]) == 2
        assert message in capsys.readouterr().err


def test_the_round_trip_of_the_flag():
    config = LaunchConfig("train.py", ("--x",), num_workers=4, kubernetes=True, port=3000)
    args, script_args = cli.parse(config.command_line())
    assert isinstance(args, argparse.Namespace)
    assert LaunchConfig.from_cli(args, script_args) == config
    assert not config.local
