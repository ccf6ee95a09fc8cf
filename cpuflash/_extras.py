"""The error an adapter raises when its optional dependencies are missing.

cpuflash is not on PyPI: it is installed from a clone, so the extra that brings an adapter's
dependencies is installed with ``pip install -e ".[extra]"`` in that clone (``pip install
"cpuflash[extra]"`` would look for a package that does not exist).
"""


def missing(module, needs, extra):
    """The ImportError for `module` when `needs` cannot be imported; raise it ``from`` the
    original error."""
    return ImportError(f"{module} needs {needs}: in your clone of cpuflash, "
                       f"pip install -e \".[{extra}]\" (the rest of cpuflash works without "
                       f"them)")
