"""Every ```python block of README.md runs and exits 0.

Each block runs on its own in a fresh interpreter (``sys.executable``), from the repository root,
as a reader who pastes it would run it. A block that imports an optional package (torch,
transformers, mpi4py, or the cpuflash adapters that need them) is skipped where that package is
not installed. Other fenced blocks (``bash``, signatures, drawings) are not run.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parent.parent
README = REPO_DIR / "README.md"
TIMEOUT_S = 300  # a cold kernel cache compiles for tens of seconds; a warm one takes about 1 s

# module a block imports -> the package it needs
OPTIONAL = {"torch": "torch", "transformers": "transformers", "mpi4py": "mpi4py",
            "cpuflash.torch": "torch", "cpuflash.transformers": "transformers",
            "cpuflash.distributed": "mpi4py"}
IMPORT = re.compile(r"^\s*(?:import|from)\s+([\w.]+)", re.MULTILINE)
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text):
    """``(line number of the opening fence, code)`` for each ```python block of `text`."""
    return [(text.count("\n", 0, match.start()) + 1, match.group(1))
            for match in FENCE.finditer(text)]


def missing_packages(code):
    """The optional packages that `code` imports and this environment lacks."""
    needed = set()
    for module in IMPORT.findall(code):
        for name, package in OPTIONAL.items():
            if module == name or module.startswith(name + "."):
                needed.add(package)
    return sorted(p for p in needed if importlib.util.find_spec(p) is None)


def run_block(code):
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_DIR, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_blocks_are_found():
    assert len(BLOCKS) >= 2, "README.md should have its quick start as a ```python block"


@pytest.mark.slow
@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code):
    missing = missing_packages(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    result = run_block(code)
    assert result.returncode == 0, (
        f"the python block at README.md:{line} exited {result.returncode}\n"
        f"--- code\n{code}--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")


@pytest.mark.slow
def test_a_failing_block_is_caught():
    """The check above would see a block that raises."""
    # the legacy np.random.standard_normal has no dtype argument: this block raises
    text = ("intro\n```python\nimport numpy as np\n"
            "np.random.standard_normal(3, dtype=np.float32)\n```\n")
    [(line, code)] = python_blocks(text)
    assert line == 2
    assert run_block(code).returncode != 0


def test_optional_imports_are_detected():
    assert missing_packages("import numpy as np\n") == []
    code = "import cpuflash.torch\nfrom mpi4py import MPI\n"
    expected = sorted(p for p in ("torch", "mpi4py") if importlib.util.find_spec(p) is None)
    assert missing_packages(code) == expected


def test_compile_times_are_quoted_from_one_figure():
    """The README, docs/flex.md and the compile notice quote one measured range
    (`_jit.COMPILE_TIME`, from docs/performance.md's "Compile time" table), not each its own."""
    from cpuflash import _jit

    seconds = re.compile(r"\d+(?:\.\d+)?-\d+(?:\.\d+)? s\b")  # a range: what to expect
    for path in (README, REPO_DIR / "docs" / "flex.md",
                 REPO_DIR / "examples" / "flex_attention.py"):
        text = path.read_text(encoding="utf-8")
        quoted = [line for line in text.splitlines() if "compile" in line.lower()
                  and seconds.search(line) and "warmup" not in line]
        assert quoted, f"{path.name} says nothing of compile times"
        for line in quoted:
            assert _jit.COMPILE_TIME in line, f"{path.name}: {line.strip()!r}"
    table = (REPO_DIR / "docs" / "performance.md").read_text(encoding="utf-8")
    assert f"`_jit.COMPILE_TIME`, \"{_jit.COMPILE_TIME}\"" in table
