"""Hot inner kernels compiled once per process and called by symbol from every kernel.

Why: numba compiles a function that another kernel calls into the caller's module, inlined
or not: the callee's LLVM IR is linked in, optimized again and turned into machine code
again, once for each caller and each of their callers. The block dots (`lane_ir`,
`block_ir`) are most of a quantized kernel's code, every format in one function, and with
the team kernels calling them three levels deep a cold test run spent most of its minutes
recompiling them (docs/BENCHMARKS.md "Test suite time"). Here such a dot is compiled once as a C
function (`numba.cfunc`, cached on disk like the kernels) and registered under a symbol with
LLVM's JIT, the way numba's own runtime functions are; a kernel's IR then holds only the call,
which a cached kernel resolves again when it is loaded in another process (the symbol is
registered when this package's modules are imported, before any kernel is loaded).

The calling convention is plain C: integers as int64, floats as float or double, a tuple of
integers as a pointer to its items, and results (float32) through a pointer passed last.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernel_cache import package_cache_dir

_I64 = ir.IntType(64)


def export(symbol: str, compiled) -> None:
    """Register a compiled `numba.cfunc` under `symbol` for `symbol_call`s to resolve."""
    llvm.add_symbol(symbol, compiled.address)


_KEPT: list = []  # the C functions `c_function` made, alive while their addresses are registered


def c_function(symbol: str, body, sig, results: int = 0, **options):
    """Compile `body` as a C function of signature `sig` (cached on disk; `options` as numba's
    cfunc takes them), register it under `symbol` and return its `symbol_call`. `body` must be
    a module-level function: numba does not cache a C function made from a closure."""
    from numba import cfunc

    compiled = cfunc(sig, cache=True, **options)(body)
    export(symbol, compiled)
    _KEPT.append(compiled)
    return symbol_call(symbol, results)


@contextlib.contextmanager
def compile_lock(name: str) -> Iterator[None]:
    """Hold an exclusive file lock while the C functions of `name` are compiled or loaded, so
    that processes starting together (the test suite's two workers) compile them once: the
    second waits and loads the first one's cache. Without fcntl, no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    folder = package_cache_dir()  # beside the kernels, wherever numba keeps them
    try:
        if folder is None:
            raise OSError("numba's cache folder for ops/ is unknown")
        folder.mkdir(parents=True, exist_ok=True)
        f = open(folder / f"{name}.compile.lock", "ab")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def symbol_call(symbol: str, results: int = 0):
    """An intrinsic f(args) calling the C function registered as `symbol` with the items of
    the tuple `args`: integers and booleans as int64, floats as they are (float32 a C float,
    float64 a double), tuples of integers as a pointer to their items (as int64). With
    `results` > 0 a pointer to that many float32 goes last, and f returns them as a tuple."""
    ret = types.UniTuple(types.float32, results) if results else types.none

    @intrinsic
    def call(typingctx, args):
        if not isinstance(args, types.BaseTuple):
            return None
        for t in args.types:
            ok = isinstance(t, (types.Integer, types.Boolean, types.Float)) or (
                isinstance(t, types.BaseTuple) and all(isinstance(e, types.Integer) for e in t.types))
            if not ok:
                return None

        def codegen(context, builder, signature, llargs):
            tup_t, tup = signature.args[0], llargs[0]
            values, params = [], []
            for k, t in enumerate(tup_t.types):
                v = builder.extract_value(tup, k)
                if isinstance(t, (types.Integer, types.Boolean)):
                    values.append(context.cast(builder, v, t, types.int64))
                    params.append(_I64)
                elif isinstance(t, types.Float):  # as it is: float32 a C float, float64 a double
                    values.append(v)
                    params.append(context.get_value_type(t))
                else:
                    items = cgutils.alloca_once(builder, _I64, size=len(t.types))
                    for j, item_t in enumerate(t.types):  # mixed widths too (a uint64 prange index)
                        item = context.cast(builder, builder.extract_value(v, j), item_t, types.int64)
                        builder.store(item, builder.gep(items, [ir.Constant(ir.IntType(32), j)]))
                    values.append(items)
                    params.append(_I64.as_pointer())
            out = None
            if results:
                out = cgutils.alloca_once(builder, ir.FloatType(), size=results)
                values.append(out)
                params.append(ir.FloatType().as_pointer())
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), params), symbol)
            builder.call(fn, values)
            if not results:
                return context.get_dummy_value()
            items = [builder.load(builder.gep(out, [ir.Constant(ir.IntType(32), j)])) for j in range(results)]
            return context.make_tuple(builder, signature.return_type, items)

        return ret(args), codegen

    return call
