"""Importing the package must not start a JAX backend: ``launch/pretrain.py`` sets the CPU device
count after its imports, which JAX refuses once a backend is up (a module-level ``jnp`` constant
once broke every CPU launch)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib, pkgutil
import core
from jax._src import xla_bridge
names = [m.name for m in pkgutil.walk_packages(core.__path__, "core.")]
for name in names:
    importlib.import_module(name)
    assert not xla_bridge._backends, f"importing {name} started a JAX backend"
print(len(names))
"""


def test_importing_every_core_module_starts_no_backend():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) > 50  # the walk found the package's modules
