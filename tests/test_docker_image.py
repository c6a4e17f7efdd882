"""The Docker image runs SpecRoll on a Python it supports and on the torch its base image ships:
read from the Dockerfile and pyproject.toml, no Docker needed."""

import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
KEEP_TORCH = "/tmp/keep-torch.txt"
# What each base image ships (Python, torch), from its maker's release notes or build files.
BASE_IMAGES = {
    # PyTorch's docker.Makefile builds with PYTHON_VERSION 3.11 and pip-installs the release wheel.
    "pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime": ("3.11", "2.9.1"),
    # The base until 2026-12: a pre-release torch that pip replaced, and Python 3.10.
    "nvcr.io/nvidia/pytorch:24.10-py3": ("3.10", "2.5.0a0"),
}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def torch_requirement() -> str:
    (requirement,) = [r for r in pyproject()["dependencies"] if r.startswith("torch")]
    return requirement.removeprefix("torch")


def instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    return [i.strip() for i in "\n".join(lines).replace("\\\n", " ").splitlines() if i.strip()]


def image_problems(python: str, torch: str, requires_python: str, torch_spec: str) -> list[str]:
    """Why an image shipping `python` and `torch` cannot run SpecRoll on its own torch (none: it can)."""
    problems = []
    if not SpecifierSet(requires_python).contains(python):
        problems.append(f"Python {python} is outside requires-python {requires_python}")
    # Pre-releases fail a plain specifier: pip would install a PyPI torch over the image's.
    if not SpecifierSet(torch_spec).contains(torch):
        problems.append(f"torch {torch} does not satisfy torch{torch_spec}: pip would replace it")
    return problems


def test_the_base_image_runs_specroll_on_its_own_torch():
    (base,) = [i.split()[1] for i in instructions() if i.startswith("FROM ")]
    if base not in BASE_IMAGES:
        pytest.fail(f"record the Python and torch that {base} ships in BASE_IMAGES")
    assert image_problems(*BASE_IMAGES[base], pyproject()["requires-python"], torch_requirement()) == []


def test_the_earlier_base_image_is_refused_for_its_python_and_its_torch():
    problems = image_problems(*BASE_IMAGES["nvcr.io/nvidia/pytorch:24.10-py3"], ">=3.11", ">=2.5")
    assert problems == ["Python 3.10 is outside requires-python >=3.11",
                        "torch 2.5.0a0 does not satisfy torch>=2.5: pip would replace it"]


def test_no_python_before_3_11_is_allowed():
    # hashlib.file_digest, which hashes every checkpoint file, is new in 3.11.
    allowed = SpecifierSet(pyproject()["requires-python"])
    assert not any(allowed.contains(Version(f"3.{minor}")) for minor in range(11))
    assert allowed.contains("3.11")


def test_every_pip_install_keeps_the_images_torch():
    """The constraint pins the torch found before the first install; --no-deps installs resolve nothing."""
    steps = [s.strip() for i in instructions() if i.startswith("RUN ") for s in i.removeprefix("RUN ").split("&&")]
    installs = [k for k, step in enumerate(steps) if "pip install" in step]
    pins = [k for k, step in enumerate(steps) if step.endswith(f"> {KEEP_TORCH}") and "^torch==" in step]
    assert installs and pins and pins[0] < installs[0]
    for k in installs:
        assert f"-c {KEEP_TORCH}" in steps[k] or "--no-deps" in steps[k], steps[k]
    checks = [k for k, step in enumerate(steps) if step == f"pip freeze | grep -qxFf {KEEP_TORCH}"]
    assert checks and checks[-1] > installs[-1], "after the last install, the build checks that torch is unchanged"
