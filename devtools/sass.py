"""SASS instruction counts of the CUDA kernels' hot loops, without a GPU.

Each instantiation is compiled with NVRTC for one architecture (with CuPy's
options, as at run time) and the cubin disassembled with ``nvdisasm`` (pip
package ``nvidia-cuda-nvdisasm``). A kernel's hot loop is, of its loops
(backward branches), the one with the most floating-point instructions of its
own (nested loops' instructions not counted; for Newton–Schulz, the most FMAs).
Instructions per term: one ``|x - y|``/``(x - y)^2`` accumulation of the kernel
matrix or gradient, or one FMA of the Newton–Schulz products. The forward's
loop body holds PW_TK x 4 x 4 = 256 terms (the d-chunk, fully unrolled, times
each thread's 4 x 4 outputs); the gradient's 4 x 4 x 2 = 32 (its reduction
loop is unrolled 4 times); the Newton–Schulz loop's terms are its FMAs.
``benchmarks/cuda_sass.py`` prints the table (docs/cuda.md). Development tooling of a
source checkout: it reads ``ops/`` and ``lapformer_mm/ops/cuda_runtime.py`` there.
"""
import collections
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .nvrtc import CUPY_ADDED_OPTIONS, Nvrtc, find_nvrtc, nvidia_wheel_files

SOURCE_ROOT = Path(__file__).resolve().parents[1]
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


def load_runtime(source_root):
    """``cuda_runtime`` of the checkout at ``source_root`` (its sources and instantiations)."""
    path = Path(source_root) / 'lapformer_mm' / 'ops' / 'cuda_runtime.py'
    spec = importlib.util.spec_from_file_location(f'cuda_runtime_{abs(hash(str(path)))}', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def disassemble(nvdisasm, cubin):
    """{mangled function: [(address, opcode, text, labels before it)]}."""
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


def hot_loop(instructions, key_ops=FLOAT_OPS):
    """Opcode Counter of the hot loop's own instructions, or None without a loop.

    The hot loop is the one with the most ``key_ops`` instructions of its own.
    """
    best, best_float = None, -1
    all_loops = loops(instructions)
    for first, last in all_loops:
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


_TILE_TERMS = {'pairwise_forward': 256, 'pairwise_backward': 32, 'nys_forward_stats': 256,
               'nys_forward_out': 256, 'nys_backward_reduce': 256, 'nys_backward_grads': 128}


def terms_per_iteration(kernel, counts):
    terms = _TILE_TERMS.get(kernel.split('<')[0])
    return counts['FFMA'] + counts['DFMA'] if terms is None else terms


def hot_loop_ops(kernel):
    """The opcodes whose count picks a kernel's hot loop."""
    if kernel.startswith('newton_schulz'):
        return ('FFMA', 'DFMA')  # its row-sum loop has more other float work
    if kernel.startswith('nys_backward_grads'):
        return ('FADD',)
    return FLOAT_OPS


def report(source_root=SOURCE_ROOT, arch='sm_90'):
    """[{kernel, instructions, terms, per_term, histogram}] of every instantiation."""
    rt = load_runtime(source_root)
    nvrtc = Nvrtc(find_nvrtc())
    nvdisasm = find_nvdisasm()
    if not nvdisasm:
        raise SassToolError('nvdisasm not found: pip install nvidia-cuda-nvdisasm '
                            '(or set LAPFORMER_NVDISASM)')
    rows = []
    for source, names in rt.all_name_expressions().items():
        options = (f'--gpu-architecture={arch}',) + tuple(rt.NVRTC_OPTIONS) + CUPY_ADDED_OPTIONS
        status, log, lowered, cubin = nvrtc.compile(rt.load_source(source), source, options, names)
        if status != 0:
            raise SassToolError(f'NVRTC failed on {source}:\n{log}')
        functions = disassemble(nvdisasm, cubin)
        for name in names:
            counts = hot_loop(functions[lowered[name]], hot_loop_ops(name))
            if counts is None:
                rows.append(dict(kernel=name, instructions=0, terms=0, per_term=None, histogram={}))
                continue
            terms = terms_per_iteration(name, counts)
            total = sum(counts.values())
            rows.append(dict(kernel=name, instructions=total, terms=terms,
                             per_term=total / terms if terms else None,
                             histogram=dict(counts.most_common())))
    return rows
