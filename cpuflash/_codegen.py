"""Machine code for a kernel's call chain generated once, in the kernel, not at every level.

Numba compiles each function into a library of its own, optimizes it and turns it into machine
code at once, then links its IR into every caller, which optimizes the whole again and turns it
into machine code again. A kernel's body sits at the bottom of a chain: the helpers, the
parallel loop's body (the parfor gufunc), that body's two wrappers (`_GufuncWrapper`,
``parallelgufuncwrapper``) and the kernel, each finalized on its own. Logged on a cold compile
of the decoding kernel, its body was optimized and emitted five times, LLVM took most of the
time, and only the kernel's machine code is ever run (docs/history.md, "Compile time").

Inside `deferred()` (`_jit.Kernel` compiles and loads its kernels there) a library finalized by
Numba links its callees and stops: optimization and machine code wait until something asks for
the address of a function it defines, which only Python's entry into the kernel does. Then the
whole linked module is optimized once, as a C compiler optimizes one translation unit (the
inliner works bottom-up, callees first), and emitted once. The parallel loop's body is compiled
without the wrappers only Python would call it through. A helper saved to the on-disk cache is
saved as IR (bitcode), not machine code, and a later compile that loads it links that IR.

What a kernel computes does not change, only how often its code is optimized: the kernels'
flags forbid reassociation, and their SIMD steps write each fused multiply-add explicitly. 167
outputs of every kernel and dtype came out bit-identical to Numba's own way, at the same speed
(docs/history.md, "Compile time"). Numba releases it was not checked against compile as Numba
does (`SUPPORTED`).
"""

import contextlib
import types as pytypes

import numba
from llvmlite import binding as llvm
from numba.core import codegen as numba_codegen, compiler
from numba.core.compiler_lock import global_compiler_lock, require_global_compiler_lock

try:
    from numba.parfors import parfor_lowering
except ImportError:  # pragma: no cover - every Numba release cpuflash supports has it
    parfor_lowering = None

_Library = numba_codegen.JITCodeLibrary
_NEEDED = [(_Library, name) for name in (
    "finalize", "get_pointer_to_function", "serialize_using_object_code", "_unserialize",
    "_finalize_final_module", "_optimize_final_module", "_optimize_functions",
    "_get_module_for_linking", "_raise_if_finalized")] + [
        (numba_codegen.JITCPUCodegen, name) for name in (
            "set_env", "_check_llvm_bugs", "_library_class", "_function_pass_manager")]
# the Numba releases whose finalize, linking and caching this was checked against; another
# release compiles the usual way until it is checked too
CHECKED_RELEASES = ((0, 68),)
SUPPORTED = (tuple(int(part) for part in numba.__version__.split(".")[:2]) in CHECKED_RELEASES
             and parfor_lowering is not None and hasattr(parfor_lowering, "compiler")
             and all(hasattr(owner, name) for owner, name in _NEEDED))

_depth = 0  # how many `deferred()` blocks are open (changed under Numba's compiler lock)


@contextlib.contextmanager
def deferred():
    """Compile (or load) under Numba's compiler lock with code generation deferred."""
    global _depth
    with global_compiler_lock:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1


class DeferredLibrary(_Library):
    """Numba's JIT code library, which inside `deferred()` optimizes and emits on demand."""

    def __init__(self, codegen, name, **options):
        super().__init__(codegen, name, **options)
        self._deferring = _depth > 0
        self._pending = False  # finalized, linked, neither optimized nor emitted

    def finalize(self):
        if not self._deferring:
            return super().finalize()
        require_global_compiler_lock()
        self._codegen._check_llvm_bugs()
        self._raise_if_finalized()
        seen = set()
        for library in self._linking_libraries:  # as Numba links them, without optimizing
            if library not in seen:
                self._reload_init.update(library._reload_init)
                seen.add(library)
                self._final_module.link_in(library._get_module_for_linking(), preserve=True)
        self._pending = True
        self._finalized = True

    def _optimize_functions(self, ll_module):
        """Numba's function passes, run with one pass manager for all of the module's functions
        instead of a new one for each (the same passes: the same code)."""
        ll_module.data_layout = self._codegen._data_layout
        passes, builder = self._codegen._function_pass_manager()
        for function in ll_module.functions:
            passes.run(function, builder)

    def _emit(self):
        """Optimize the linked module and turn it into machine code (what `finalize` left)."""
        self._pending = False
        self._optimize_final_module()
        self._final_module.verify()
        self._shared_module = None  # callers linking it from now on get the optimized IR
        self._finalize_final_module()

    def _finalize_final_module(self):
        super()._finalize_final_module()
        _set_pending_environments(self._codegen)

    def get_pointer_to_function(self, name):
        self._ensure_finalized()
        if self._pending:
            try:
                function = self._final_module.get_function(name)
            except NameError:
                function = None
            if function is None or function.is_declaration:
                # Numba asks each helper for a Python entry it was compiled without (the answer
                # is 0): no reason to emit it
                engine = self._codegen._engine
                return engine.get_function_address(name) if engine.is_symbol_defined(name) else 0
            with global_compiler_lock:
                if self._pending:
                    self._emit()
        return super().get_pointer_to_function(name)

    def serialize_using_object_code(self):
        self._ensure_finalized()
        if self._pending:  # a helper: its IR, which a kernel compiled later links
            return (self.name, "bitcode", self._final_module.as_bitcode())
        return super().serialize_using_object_code()

    @classmethod
    def _unserialize(cls, codegen, state):
        name, kind, data = state
        if kind != "bitcode":
            return super()._unserialize(codegen, state)
        self = codegen.create_library(name)
        self._final_module = llvm.parse_bitcode(data)
        self._pending = True
        self._finalized = True
        return self


# A library's environment (the Python objects its code may reference) is written into a global
# of its machine code once that exists; a deferred library's global exists only once a module
# that links it is emitted.
_pending_environments = {}  # global's name -> environment
_numba_set_env = numba_codegen.JITCPUCodegen.set_env


def _set_env(self, env_name, env):
    if self._engine.is_symbol_defined(env_name):
        _numba_set_env(self, env_name, env)
    else:
        _pending_environments[env_name] = env


def _set_pending_environments(codegen):
    engine = codegen._engine
    for name in [name for name in _pending_environments if engine.is_symbol_defined(name)]:
        _numba_set_env(codegen, name, _pending_environments.pop(name))


def _compile_ir(*args, **kwargs):
    """`numba.core.compiler.compile_ir` for the parfor lowering: inside `deferred()`, a parallel
    loop's body is compiled without the Python and C entries nothing calls it through (asking
    for their address would emit it)."""
    pipeline = kwargs.get("pipeline_class")
    if _depth and pipeline is not None and pipeline.__name__ == "ParforGufuncCompiler":
        args = list(args)
        flags = args[5] = args[5].copy()
        flags.no_cpython_wrapper = flags.no_cfunc_wrapper = True
    return compiler.compile_ir(*args, **kwargs)


def install():
    """Make Numba's JIT libraries `DeferredLibrary` (idempotent; nothing where unsupported)."""
    if not SUPPORTED or numba_codegen.JITCPUCodegen._library_class is DeferredLibrary:
        return
    numba_codegen.JITCPUCodegen._library_class = DeferredLibrary
    numba_codegen.JITCPUCodegen.set_env = _set_env
    proxy = pytypes.ModuleType(compiler.__name__)  # the module parfor_lowering sees
    proxy.__dict__.update(compiler.__dict__)
    proxy.compile_ir = _compile_ir
    parfor_lowering.compiler = proxy
