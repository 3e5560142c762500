"""moejax imports on a JAX without Pallas's Triton lowering or Mosaic GPU (a JAX that removed them, or a build without
them): every kernel module imports, and those backends say why they are unavailable instead of failing the import.
The kernel modules import each other at their tops, so one unguarded import of either package would break `import
moejax` everywhere."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CODE = """
import importlib.abc, sys
class Without(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("jax.experimental.pallas.triton", "jax.experimental.pallas.mosaic_gpu"):
            raise ImportError(f"no {name} in this JAX")
sys.meta_path.insert(0, Without())
import pkgutil, importlib, moejax, moejax.kernels
for m in pkgutil.walk_packages(moejax.kernels.__path__, "moejax.kernels."):
    importlib.import_module(m.name)
from moejax.kernels.grouped_matmul.mosaic_plan import mosaic_unavailable
from moejax.kernels.platform import pallas_unavailable
print(pallas_unavailable())
print(mosaic_unavailable())
"""


@pytest.mark.slow  # a fresh interpreter: the backends must be missing before anything imports them
def test_moejax_imports_without_triton_or_mosaic_gpu():
    run = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    pallas, mosaic = run.stdout.splitlines()[-2:]
    assert "no Pallas Triton backend" in pallas and "no Pallas Mosaic GPU backend" in mosaic
