"""A non-editable install into a read-only folder: kernels compile, and their cache goes where
the user may write (Numba's user-wide cache folder, then the temporary folder), never next to
the package. (The cache folder's choice on its own: test_first_call.py.)"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO_DIR, explain, last_json_line, run_python

CHECK_SCRIPT = """
    import json, sys
    import numpy as np
    import cpuflash
    from cpuflash.reference import attention_reference

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 37, 24)).astype(np.float32) for _ in range(3))
    out = cpuflash.attention(q, k, v, causal=True)
    err = float(np.abs(out - attention_reference(q, k, v, causal=True)).max())
    print(json.dumps(dict(file=cpuflash.__file__, err=err)))
"""


def file_states(root):
    """{path: (size, mtime_ns)} of every file under `root`."""
    states = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            st = os.stat(path)
            states[path] = (st.st_size, st.st_mtime_ns)
    return states


def set_writable(root, writable):
    for base, dirs, files in os.walk(root):
        for name in [*dirs, *files, None]:
            path = base if name is None else os.path.join(base, name)
            mode = os.stat(path).st_mode
            os.chmod(path, mode | 0o200 if writable else mode & ~0o222)


@pytest.mark.slow
def test_read_only_install_caches_elsewhere(tmp_path):
    """The second interpreter reuses the cache under HOME; with HOME read-only too, the cache
    goes to TMPDIR."""
    prefix = []
    if os.geteuid() == 0:  # root ignores file permissions unless it drops CAP_DAC_OVERRIDE
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: a read-only directory is writable")
        caps = "-dac_override,-dac_read_search"
        prefix = [setpriv, "--bounding-set", caps, f"--inh-caps={caps}"]
    source, target = tmp_path / "src", tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "*.pyc", "*.egg-info")
    shutil.copytree(REPO_DIR / "cpuflash", source / "cpuflash", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_DIR / name, source / name)
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
           "--disable-pip-version-check", "--target", str(target), str(source)]
    result = subprocess.run([*pip[:5], "--no-build-isolation", *pip[5:]], capture_output=True,
                            text=True, timeout=300)
    if result.returncode != 0:
        result = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "setuptools" in result.stdout + result.stderr:
        # no build backend offline (a bare virtual environment): cpuflash is pure Python, so
        # an install is its package folder on the path
        shutil.copytree(source / "cpuflash", target / "cpuflash")
    elif result.returncode != 0:
        pytest.fail(explain(result))
    assert (target / "cpuflash" / "__init__.py").exists()

    home, tmp, locked = tmp_path / "home", tmp_path / "tmp", tmp_path / "locked"
    for path in (home, tmp, locked):
        path.mkdir()
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("NUMBA_") and name not in ("XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(PYTHONPATH=str(target), HOME=str(home), TMPDIR=str(tmp))
    installed = file_states(target)
    set_writable(target, False)
    set_writable(locked, False)
    try:
        runs = []
        for run in range(3):
            # third run: HOME is read-only too, so the cache must go to TMPDIR
            run_env = dict(env, HOME=str(locked)) if run == 2 else env
            result = run_python(CHECK_SCRIPT, env=run_env, prefix=prefix, cwd=str(tmp),
                                timeout=300)
            assert result.returncode == 0, f"run {run}: {explain(result)}"
            runs.append(last_json_line(result))
            if run == 0:
                home_cache = file_states(home)
        assert file_states(target) == installed, "files were created or changed in the install"
        assert file_states(locked) == {}
    finally:
        set_writable(target, True)
        set_writable(locked, True)
    for run, info in enumerate(runs):
        assert Path(info["file"]).resolve().is_relative_to(target.resolve()), info
        assert info["err"] < 1e-5, info
    cached = [p for p in home_cache if p.endswith((".nbi", ".nbc"))]
    assert cached, f"no Numba cache under HOME: {sorted(home_cache)}"
    assert file_states(home) == home_cache, "the second run did not reuse the cache under HOME"
    assert any(p.endswith(".nbc") for p in file_states(tmp)), \
        f"with HOME read-only, no cache under TMPDIR: {sorted(file_states(tmp))}"


@pytest.mark.slow
def test_editable_install_imports_from_the_folder_that_holds_the_clone(tmp_path):
    """Cloned into ``~/cpuflash`` and used from ``~``: the clone's folder (no __init__.py) is a
    namespace package there, and `import cpuflash` must still find the installed package."""
    clone = tmp_path / "cpuflash"
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "*.pyc", "*.egg-info")
    shutil.copytree(REPO_DIR / "cpuflash", clone / "cpuflash", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_DIR / name, clone / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # the fresh venv sees this one's packages (numba, setuptools) after its own
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    here = subprocess.run([sys.executable, "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz_this_venv.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
           "--disable-pip-version-check", "--no-deps", "-e", str(clone)]
    # with this venv's build backend where it can build an editable wheel (setuptools and
    # wheel), else with the one pip fetches (`pip install -e .` as a user runs it)
    result = subprocess.run([*pip, "--no-build-isolation", "--no-index"], capture_output=True,
                            text=True, timeout=300)
    if result.returncode != 0:
        result = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, explain(result)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run([str(python), "-m", "cpuflash", "info"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "CPU:" in result.stdout, explain(result)
    result = subprocess.run([str(python), "-c", "import cpuflash; print(cpuflash.__file__)"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert Path(result.stdout.strip()) == clone / "cpuflash" / "__init__.py", explain(result)
