"""The GPU machine's offline install, as documented (docs/gpus.md): `make gpu-bundle-install gpu-smoke`
in a fresh venv whose base holds what the GPU image holds (torch, Lightning, transformers, peft, ...) and
lacks what it lacks (Ray, vLLM, jsonargparse, math-verify, `datasets`), with no package index in reach
(`--no-index`); then the smoke's CPU dry run.

The base is this test's `.venv` seen through a folder of links to its site-packages, less those
packages (a `.pth` file in the fresh venv points at it: pip sees those distributions as installed, and
never touches them, being outside its environment). Making the bundle needs the index (`make
gpu-bundle`, what a user runs before going offline); everything after it runs with `--no-index`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# top-level names (modules and dist-infos, normalised) the GPU image does not have
ABSENT = (
    "ray",
    "vllm",
    "jsonargparse",
    "math_verify",
    "datasets",
    "latex2sympy2_extended",
    "typeshed_client",
    "docstring_parser",
    "antlr4",
    "antlr4_python3_runtime",
)
PRESENT = ("torch", "lightning", "transformers", "peft")


def normalised(entry: str) -> str:
    return re.split(r"[-.]", entry, maxsplit=1)[0].lower().replace("-", "_")


def image_like_base(folder: Path) -> Path:
    """Links to this interpreter's site-packages entries, less ``ABSENT`` and this project's own."""
    site = Path(sysconfig.get_paths()["purelib"])
    base = folder / "image-site"
    base.mkdir()
    for entry in site.iterdir():
        name = normalised(entry.name)
        if name in ABSENT or name.startswith(("unirl_lightning", "__editable__")) or entry.suffix == ".pth":
            continue
        (base / entry.name).symlink_to(entry)
    return base


def importable(python: Path, modules: tuple[str, ...]) -> dict[str, bool]:
    code = f"import importlib.util as u, json; print(json.dumps({{m: u.find_spec(m) is not None for m in {modules!r}}}))"
    return json.loads(run([str(python), "-c", code]).stdout)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    print("$", " ".join(cmd), f"-> exit {proc.returncode}\n", proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


@pytest.mark.slow
def test_the_documented_offline_install_runs_the_smoke(tmp_path):
    bundle = tmp_path / "gpu-bundle"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    made = run(
        [
            "make",
            "-C",
            str(REPO),
            "gpu-bundle",
            f"GPU_BUNDLE={bundle}",
            f"GPU_BUNDLE_PYTHON={version}",
            f"PYTHON={sys.executable}",
        ]
    )
    if made.returncode != 0 and "Could not" in made.stderr + made.stdout:
        pytest.skip("the package index is out of reach: the bundle cannot be made here")
    assert made.returncode == 0
    wheels = sorted(p.name for p in bundle.iterdir())
    assert any(w.startswith("jsonargparse") for w in wheels) and any(
        w.startswith("math_verify") for w in wheels
    )

    env_dir = tmp_path / "image-venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=True).create(env_dir)
    python = env_dir / "bin" / "python"
    own_site = run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    (Path(own_site) / "image_base.pth").write_text(str(image_like_base(tmp_path)) + "\n")
    assert importable(python, PRESENT + ABSENT[:5]) == {m: m in PRESENT for m in PRESENT + ABSENT[:5]}, (
        "the base must hold torch & co. and lack Ray, vLLM, jsonargparse, math-verify and datasets"
    )

    out = tmp_path / "smoke.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_NO_INDEX"] = "1"  # besides the line's own --no-index: nothing may reach a registry
    # the exact documented line, on the fresh venv's Python
    proc = run(
        [
            "make",
            "-C",
            str(REPO),
            "gpu-bundle-install",
            "gpu-smoke",
            f"GPU_PY={python}",
            f"GPU_BUNDLE={bundle}",
            f"GPU_SMOKE_ARGS=--cpu --out {out}",
        ],
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert importable(python, ABSENT[:5]) == {
        "ray": False,
        "vllm": False,
        "jsonargparse": True,
        "math_verify": True,
        "datasets": False,
    }
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}))
    print({name: check["ok"] for name, check in report["checks"].items()})
    assert report["ok"] and report["imported"] == ["jsonargparse", "math_verify"]
    assert not report["ray_initialized"]
    assert set(report["checks"]) == {
        "mixed_precision",
        "logprob_memory",
        "hf_generate",
        "weight_push",
        "on_policy_pin",
        "fsdp2_fit",
        "hybrid_fit",
        "real_size",
    }


def test_without_cuda_the_smoke_fails_with_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    proc = run([sys.executable, "-m", "benchmarks.gpu.gpu_smoke"], cwd=REPO)
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_smoke: no CUDA device")
    assert "--cpu" in proc.stderr
