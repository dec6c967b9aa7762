"""infra/: the cluster manifests, the image and the local cluster script agree with the project.

Fast and offline: parses the files and compares them with each other, with the pins in
infra/requirements-lock.txt and infra/setup.sh, with the installed Ray, and with jobs/.
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"


# --- reading the files ------------------------------------------------------------------------

def read_lock() -> dict[str, Requirement]:
    """infra/requirements-lock.txt as {normalised name: requirement}."""
    reqs = {}
    for line in (INFRA / "requirements-lock.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            reqs[norm(req.name)] = req
    return reqs


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(req: Requirement) -> str:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{req} in the lock is not pinned with =="
    return specs[0].version


def setup_sh_torch_pin() -> str:
    text = (INFRA / "setup.sh").read_text()
    match = re.search(r"\$\{TORCH_SPEC:-torch==([^}\s\"]+)\}", text)
    assert match, "infra/setup.sh no longer has a ${TORCH_SPEC:-torch==X} default"
    return match.group(1)


def dockerfile_args() -> dict[str, str]:
    text = (INFRA / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG\s+(\w+)=(\S*)", text, flags=re.M))


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((INFRA / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return yaml.safe_load((INFRA / "rayjob.yaml").read_text())


def cluster_gpu_type(cluster: dict) -> dict:
    workers = [t for name, t in cluster["available_node_types"].items()
               if name != cluster["head_node_type"]]
    assert len(workers) == 1, "cluster.yaml: expected exactly one worker node type"
    return workers[0]


def rayjob_worker_group(rayjob: dict) -> dict:
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert len(groups) == 1, "rayjob.yaml: expected exactly one worker group"
    return groups[0]


def entrypoints(cluster: dict, rayjob: dict) -> dict[str, str]:
    return {"cluster.yaml": cluster["metadata"]["hybrid_ray_job"]["entrypoint"],
            "rayjob.yaml": rayjob["spec"]["entrypoint"]}


def parse_entrypoint(command: str) -> argparse.Namespace:
    """`python jobs/X.py --config C --min-workers A --max-workers B` -> script, config, limits."""
    words = shlex.split(command)
    assert words[0] in ("python", "python3"), f"entrypoint does not start with python: {command}"
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("script")
    parser.add_argument("--config", required=True)
    parser.add_argument("--min-workers", type=int, required=True)
    parser.add_argument("--max-workers", type=int, required=True)
    args, _ = parser.parse_known_args(words[1:])
    return args


def containers(rayjob: dict) -> dict[str, dict]:
    spec = rayjob["spec"]["rayClusterSpec"]
    out = {"head": spec["headGroupSpec"]["template"]["spec"]["containers"][0]}
    for group in spec["workerGroupSpecs"]:
        out[group["groupName"]] = group["template"]["spec"]["containers"][0]
    return out


# --- the files parse --------------------------------------------------------------------------

def test_manifests_parse(cluster, rayjob):
    assert isinstance(cluster, dict) and cluster["provider"]["type"] == "aws"
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    runtime_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict)


def test_cluster_yaml_passes_rays_own_schema(cluster):
    # What `ray up` runs before touching the cloud: fill in the provider defaults, then check
    # against ray/autoscaler/ray-schema.json (unknown keys are errors there).
    from ray.autoscaler._private.util import prepare_config, validate_config
    validate_config(prepare_config(copy.deepcopy(cluster)))


def test_local_cluster_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(INFRA / "local_cluster.sh")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- versions ---------------------------------------------------------------------------------

def test_lock_pins_the_installed_ray_and_setup_sh_torch():
    lock = read_lock()
    assert pinned(lock["ray"]) == importlib.metadata.version("ray"), (
        "infra/requirements-lock.txt pins another ray than the one installed in this environment")
    assert pinned(lock["torch"]) == setup_sh_torch_pin(), (
        "infra/requirements-lock.txt and infra/setup.sh (TORCH_SPEC) pin different torch versions")
    assert {"default"} <= lock["ray"].extras, "the lock's ray needs the 'default' extra (job API)"


def test_lock_pins_every_pyproject_dependency_within_its_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lock = read_lock()
    for line in project["dependencies"]:
        want = Requirement(line)
        name = norm(want.name)
        assert name in lock, f"pyproject.toml depends on {want.name}; pin it in infra/requirements-lock.txt"
        version = pinned(lock[name])
        assert want.specifier.contains(version, prereleases=True), (
            f"lock pins {want.name}=={version}, outside pyproject.toml's {want}")
        assert want.extras <= lock[name].extras, f"lock's {lock[name]} lacks extras of {want}"


def test_dockerfile_is_pinned_to_the_lock():
    args, lock = dockerfile_args(), read_lock()
    text = (INFRA / "Dockerfile").read_text()
    assert args["RAY_VERSION"] == pinned(lock["ray"])
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-", text, flags=re.M), (
        "the base image must be Ray's image at RAY_VERSION")
    assert re.search(r"pip install[^\n]*(\\\n[^\n]*)*-r infra/requirements-lock.txt", text), (
        "the Dockerfile must install infra/requirements-lock.txt")
    assert "COPY --chown=ray:users infra/requirements-lock.txt" in text


def test_manifests_use_one_image_tagged_with_the_pinned_versions(cluster, rayjob):
    lock, args = read_lock(), dockerfile_args()
    image = cluster["docker"]["image"]
    for name, container in containers(rayjob).items():
        assert container["image"] == image, f"rayjob.yaml {name} runs another image than cluster.yaml"
    tag = image.rsplit(":", 1)[1]
    for part in (f"ray{pinned(lock['ray'])}", f"torch{pinned(lock['torch'])}", args["PYTHON_TAG"]):
        assert part in tag.split("-"), f"image tag {tag!r} does not say {part}"
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"] == pinned(lock["ray"])


# --- the job ----------------------------------------------------------------------------------

@pytest.mark.parametrize("manifest", ["cluster.yaml", "rayjob.yaml"])
def test_entrypoint_script_and_config_exist(manifest, cluster, rayjob):
    args = parse_entrypoint(entrypoints(cluster, rayjob)[manifest])
    config = REPO / args.config
    assert config.is_file(), f"{manifest} names {args.config}, which does not exist"
    assert isinstance(json.loads(config.read_text()), dict)
    script = REPO / args.script
    assert script.parent == REPO / "jobs", f"{manifest}: the entrypoint should be in jobs/"
    assert script.is_file(), f"{args.script} (named by infra/{manifest}) does not exist"


def test_train_lm_accepts_the_flags_the_manifests_pass(cluster, rayjob):
    scripts = {parse_entrypoint(cmd).script for cmd in entrypoints(cluster, rayjob).values()}
    assert len(scripts) == 1
    script = REPO / scripts.pop()
    assert script.is_file(), f"{script.relative_to(REPO)} does not exist"
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    missing = [flag for flag in ("--config", "--min-workers", "--max-workers")
               if flag not in result.stdout]
    assert not missing, f"{script.relative_to(REPO)} does not accept {' '.join(missing)}"


def test_worker_limits_agree_everywhere(cluster, rayjob):
    node_type, group = cluster_gpu_type(cluster), rayjob_worker_group(rayjob)
    limits = {
        "cluster.yaml node type": (node_type["min_workers"], node_type["max_workers"]),
        "rayjob.yaml worker group": (group["minReplicas"], group["maxReplicas"]),
    }
    for manifest, command in entrypoints(cluster, rayjob).items():
        args = parse_entrypoint(command)
        limits[f"{manifest} entrypoint"] = (args.min_workers, args.max_workers)
    assert len(set(limits.values())) == 1, f"worker limits disagree: {limits}"
    low, high = limits["cluster.yaml node type"]
    assert 1 <= low <= high
    assert cluster["max_workers"] >= high, "cluster.yaml: global max_workers below the node type's"
    assert low <= group.get("replicas", low) <= high


def test_one_gpu_per_worker_none_on_the_head(cluster, rayjob):
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert cluster_gpu_type(cluster)["resources"].get("GPU") == 1
    assert not head["resources"].get("GPU")
    for name, container in containers(rayjob).items():
        resources = container["resources"]
        gpus = [int(resources[kind].get("nvidia.com/gpu", 0)) for kind in ("requests", "limits")]
        assert gpus == ([0, 0] if name == "head" else [1, 1]), f"rayjob.yaml {name}: GPUs {gpus}"


def test_rayjob_autoscales_and_cleans_up(rayjob):
    spec = rayjob["spec"]
    assert spec["rayClusterSpec"]["enableInTreeAutoscaling"] is True
    assert spec["shutdownAfterJobFinishes"] is True


# --- authentication and tracking --------------------------------------------------------------

def test_token_auth_on_every_node(cluster, rayjob):
    # Ray only sends and checks tokens where RAY_AUTH_MODE=token is set: a worker node's
    # `ray start --address` never turns it on by itself, so head and workers must both say so.
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cluster[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token" in c for c in starts), key
    assert any("RAY_AUTH_MODE=token" in opt for opt in cluster["docker"]["run_options"])
    assert cluster["file_mounts"].get("/home/ray/.ray/auth_token") == "~/.ray/auth_token"
    assert rayjob["spec"]["rayClusterSpec"]["authOptions"]["mode"] == "token"


def test_mlflow_tracking_uri_reaches_the_job(cluster, rayjob):
    runtime_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert runtime_env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http")
    assert cluster["metadata"]["hybrid_ray_job"]["mlflow_tracking_uri"].startswith("http")


def test_the_manifests_entrypoints_place_the_run_outside_rays_working_dir_copy(cluster, rayjob):
    """Both manifests submit with a working_dir, so the entrypoint runs in Ray's temporary copy:
    its run folder must be given as a URI or absolute path (hybrid_ray/lm/placement.py)."""
    from hybrid_ray.lm.launch import edited_job, parser
    from hybrid_ray.lm.placement import place
    under_job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"working_dir": "x"}}),
                 "MLFLOW_TRACKING_URI": "http://mlflow:5000"}
    for manifest, command in entrypoints(cluster, rayjob).items():
        args = parser().parse_args(shlex.split(command)[2:])
        raw = place(edited_job(str(REPO / args.config), args.overrides, args.steps), args.storage,
                    args.run_name, environ=under_job)
        assert raw["train"]["out_dir"].startswith("s3://"), (manifest, raw["train"]["out_dir"])
