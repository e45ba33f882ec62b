"""SASS instruction counts of the CUDA kernels' hot loops, without a GPU.

Each variant's fp32 instantiations are compiled with NVRTC for one architecture (with
CuPy's options and the variant's -D geometry, as at run time; :func:`compile_variant`,
cached, so the compile and SASS tests share one compile) and the cubin disassembled with
``nvdisasm`` (pip package ``nvidia-cuda-nvdisasm``). A kernel's hot loop is, of its loops
(backward branches), the one with the most floating-point instructions of its own (nested
loops' instructions not counted; :func:`hot_loop_ops` names the exceptions). Instructions
per term: one ``|x - y|``/``(x - y)^2`` accumulation of a kernel tile (TK x rows/thread x
columns/thread terms per iteration, :func:`terms_per_iteration`).
``benchmarks/cuda_sass.py`` prints the table (docs/cuda.md).
"""
import collections
import functools
import os
import re
import shutil
import subprocess
import tempfile

from .nvrtc import CUPY_ADDED_OPTIONS, Nvrtc, find_nvrtc, nvidia_wheel_files

FLOAT_OPS = ('FADD', 'FFMA', 'FMUL', 'FSEL', 'FSETP', 'DADD', 'DFMA', 'DMUL', 'DSETP', 'FMNMX')
_INSTRUCTION = re.compile(r'/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;')
_BRANCH_TARGET = re.compile(r'BRA\s+`\((\.L_x_\d+)\)')
_FUNCTION = re.compile(r'^\.text\.(\S+):$')
_LABEL = re.compile(r'^(\.L_x_\d+):$')


def find_nvdisasm():
    """$LAPFORMER_NVDISASM, the pip package's binary, or nvdisasm on PATH."""
    explicit = os.environ.get('LAPFORMER_NVDISASM')
    if explicit:
        return explicit
    hits = nvidia_wheel_files('bin/nvdisasm')
    return hits[0] if hits else shutil.which('nvdisasm')


@functools.lru_cache(maxsize=8)
def disassemble(nvdisasm, cubin):
    """{mangled function: [(address, opcode, text, labels before it)]} (cached: a report
    and a test of the same compile read one listing; do not modify it)."""
    with tempfile.NamedTemporaryFile(suffix='.cubin') as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, '-c', f.name], capture_output=True, text=True,
                              check=True).stdout
    functions, current, labels = {}, None, []
    for line in text.splitlines():
        stripped = line.strip()
        function = _FUNCTION.match(stripped)
        if function:
            current = functions.setdefault(function.group(1), [])
            continue
        label = _LABEL.match(stripped)
        if label:
            labels.append(label.group(1))
            continue
        ins = _INSTRUCTION.search(line)
        if ins and current is not None:
            body = ins.group(2)
            opcode = body.split()[1] if body.startswith('@') else body.split()[0]
            current.append((int(ins.group(1), 16), opcode, body, labels))
            labels = []
    return functions


def loops(instructions):
    """[(first index, last index)] of every loop: a branch back to an earlier label."""
    where = {label: i for i, (_, _, _, labels) in enumerate(instructions) for label in labels}
    found = []
    for i, (_, opcode, body, _) in enumerate(instructions):
        target = _BRANCH_TARGET.search(body)
        if opcode == 'BRA' and target and where.get(target.group(1), i + 1) <= i:
            found.append((where[target.group(1)], i))
    return found


def innermost_loops(instructions):
    """The loops of :func:`loops` with no loop inside them."""
    spans = loops(instructions)
    return [(a, b) for a, b in spans
            if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]


def hot_loop(instructions, key_ops=FLOAT_OPS, innermost=False):
    """Opcode Counter of the hot loop's own instructions, or None without a loop.

    The hot loop is the one with the most ``key_ops`` instructions of its own (``innermost``:
    of the loops with none nested).
    """
    best, best_float = None, -1
    all_loops = loops(instructions)
    for first, last in innermost_loops(instructions) if innermost else all_loops:
        nested = [(a, b) for a, b in all_loops
                  if first <= a and b <= last and (a, b) != (first, last)]
        own = [instructions[i][1] for i in range(first, last + 1)
               if not any(a <= i <= b for a, b in nested)]
        counts = collections.Counter(op.split('.')[0] for op in own if op != 'NOP')
        floats = sum(counts[op] for op in key_ops)
        if floats > best_float:
            best, best_float = counts, floats
    return best


class SassToolError(RuntimeError):
    """nvdisasm is missing, or NVRTC rejected a source."""


# The kernels whose hot loop is a kernel tile, and the variant's rows of that tile.
_TILE_ROWS = {'nys_forward_stats': 'tn', 'nys_forward_out': 'tn', 'nys_backward_reduce': 'tn',
              'nys_backward_grads': 'tb'}


def terms_per_iteration(kernel, counts, variant):
    """Terms one thread accumulates per hot-loop iteration (one d-chunk of its kernel
    tile): TK x rows/thread x columns/thread, rows NYS_TN or, in the gradient kernel,
    NYS_TB (4 x 16 x 2 = 128 at 32 rows, 64 at 16). Elsewhere the FFMAs."""
    rows = _TILE_ROWS.get(kernel.split('<')[0])
    if rows is None:
        return counts['FFMA']
    return variant.tk * (getattr(variant, rows) // variant.ty) * (variant.mp // variant.tx)


def hot_loop_ops(kernel):
    """(opcodes whose count picks a kernel's hot loop, whether only innermost loops count):
    for the kernels whose hot loop is a kernel tile, its FADDs (2 a term), so a row-tile
    loop with many other float instructions of its own (nys_forward_stats' statistics,
    centring and fp64 common part) is not taken for it; in nys_forward_solve the innermost
    loop with the most FFMAs, Newton-Schulz's k-quad (64 FFMAs; the loop over the block's
    jobs has more of its own); elsewhere every float instruction."""
    stage = kernel.split('<')[0]
    if stage in _TILE_ROWS:
        return ('FADD',), False
    if stage == 'nys_forward_solve':
        return ('FFMA',), True
    return FLOAT_OPS, False


def _runtime():
    from lapformer_mm.ops.backends import cuda
    return cuda


def _plan():
    from lapformer_mm.ops.backends import cuda_plan
    return cuda_plan


def kernel_names(element_types=('float',), stages=None):
    """The instantiations of ``stages`` (every stage when None) the host can launch for
    these element types."""
    return [name for name in _plan().kernel_names(element_types)
            if stages is None or name.split('<')[0] in stages]


def compile_variant(variant_name, arch, element_types=('float',), stages=None):
    """(status, log, {name: lowered}, cubin) of one variant's instantiations for ``arch``
    (of every stage, or of ``stages``), compiled once per process however the call spells
    its arguments (lru_cache keys a defaulted argument apart from the same one passed)."""
    return _compile(variant_name, arch, tuple(element_types),
                    None if stages is None else tuple(stages))


@functools.lru_cache(maxsize=None)
def _compile(variant_name, arch, element_types, stages):
    cl = _runtime()
    variant = _plan().VARIANT_BY_NAME[variant_name]
    names = kernel_names(element_types, stages)
    options = ((f'--gpu-architecture={arch}', '--ptxas-options=-v') + cl.NVRTC_OPTIONS
               + variant.defines + CUPY_ADDED_OPTIONS)
    return Nvrtc(find_nvrtc()).compile(cl.load_source(), cl.SOURCE, options, names)


def report(variant_name='dv64_tb32', arch='sm_90', stages=None):
    """[{kernel, instructions, terms, per_term, histogram}] of a variant's fp32 kernels (of
    every stage, or of ``stages``)."""
    nvdisasm = find_nvdisasm()
    if not nvdisasm:
        raise SassToolError('nvdisasm not found: pip install nvidia-cuda-nvdisasm '
                            '(or set LAPFORMER_NVDISASM)')
    status, log, lowered, cubin = compile_variant(variant_name, arch, stages=stages)
    if status != 0:
        raise SassToolError(f'NVRTC failed on {variant_name}:\n{log}')
    functions = disassemble(nvdisasm, cubin)
    rows = []
    for name, mangled in lowered.items():
        counts = hot_loop(functions[mangled], *hot_loop_ops(name))
        if counts is None:
            rows.append(dict(kernel=name, instructions=0, terms=0, per_term=None, histogram={}))
            continue
        terms = terms_per_iteration(name, counts, _plan().VARIANT_BY_NAME[variant_name])
        total = sum(counts.values())
        rows.append(dict(kernel=name, instructions=total, terms=terms,
                         per_term=total / terms if terms else None,
                         histogram=dict(counts.most_common())))
    return rows
