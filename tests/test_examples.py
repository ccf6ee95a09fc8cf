"""Every script in examples/ runs with ``--small`` and exits 0.

The scripts are found by glob, so a new example is tested as soon as it exists (it must accept
``--small``). Each runs in its own interpreter, as a user would run it; examples that import torch
are skipped where torch is not installed.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.py"))
IMPORTS_TORCH = re.compile(r"^\s*(import|from)\s+torch\b", re.MULTILINE)


def test_examples_are_found():
    names = {path.name for path in EXAMPLES}
    assert {"quickstart.py", "long_context.py", "fa1_vs_fa2.py", "torch_interop.py"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.name)
def test_example_runs_small(script):
    if IMPORTS_TORCH.search(script.read_text()) and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    result = subprocess.run([sys.executable, str(script), "--small"], cwd=EXAMPLES_DIR.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{script.name} --small exited {result.returncode}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
