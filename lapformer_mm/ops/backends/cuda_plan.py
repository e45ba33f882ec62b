"""The plan of the CUDA backend (:mod:`.cuda`), plain Python shared with the g++ emulation
(devtools/cuda_emulation.py) and the NVRTC checks (devtools/sass.py): the kernels' names, the
tile variants (NVRTC ``-D`` options) and their shared memory, :func:`plan`, :func:`splits`,
:func:`fit` and ``nys_params`` (:data:`PARAMS_DTYPE`: CuPy passes a numpy array of size one).
"""
import functools
from typing import NamedTuple

import numpy as np
import torch

from ..reference import KERNEL_CODES

#: torch dtype -> C++ element type of the kernels (fp64 runs the reference).
ELEMENT_TYPES = {torch.float32: 'float', torch.float16: 'lap_half', torch.bfloat16: 'lap_bf16'}

FORWARD = ('nys_forward_stats', 'nys_forward_solve', 'nys_forward_context', 'nys_forward_out')
BACKWARD = ('nys_backward_reduce', 'nys_backward_merge', 'nys_backward_solve',
            'nys_backward_grads', 'nys_backward_landmarks')
STAGES = FORWARD + BACKWARD
#: Stages that evaluate no kernel function: no KIND template argument.
NO_KIND = ('nys_forward_context', 'nys_backward_merge')
_KERNEL_OF_CODE = {code: name for name, code in KERNEL_CODES.items()}

#: The oldest architecture the kernels are written for (no instruction needs more).
MIN_CAPABILITY = (6, 0)
#: NVRTC 13 dropped every architecture below this one.
NVRTC13_MIN_CAPABILITY = (7, 5)
MAX_GRID_YZ = 65535
MAX_GRID_X = 2 ** 31 - 1
# Sizes are 32-bit ints in the kernels; the margin keeps "size + tile - 1" from overflowing.
_MAX_SIZE = 2 ** 31 - 2 ** 16
#: lap_common.cuh's layout of ns_iterate: floats of one k-split partial, the row strides.
NS_PART_STRIDE, NS_LD_NARROW, NS_LD_WIDE = 20, 52, 68
#: ns_iterate's static norm scalar, as ptxas reports it (counts against the limit).
NS_STATIC_SMEM = 16
#: Shared memory every CUDA device gives a block without opting in.
DEFAULT_SMEM = 48 * 1024


def kernel_name(stage, element_type, kind):
    """A stage's kernel as the host names it (the emulation's template instantiation)."""
    return f'{stage}<{element_type}>' if stage in NO_KIND else f'{stage}<{element_type}, {kind}>'


def kernel_names(element_types=tuple(ELEMENT_TYPES.values())):
    """Every instantiation the host can launch for these element types."""
    return list(dict.fromkeys(kernel_name(stage, element, kind) for element in element_types
                              for kind in KERNEL_CODES.values() for stage in STAGES))


def entry_name(stage, kind):
    """The C name of a stage's kernel in a module of one element type (the .cu's end)."""
    return f'{stage}_entry' if stage in NO_KIND else f'{stage}_{_KERNEL_OF_CODE[kind]}'


def stage_of(entry):
    """The stage of an entry point's C name (profiler and Nsight rows)."""
    return entry.rsplit('_', 1)[0]


class Variant(NamedTuple):
    """Tile geometry (the .cu's NYS_* macros): a tile's landmark and value columns (mp, dv), rows
    of a row-pass / gradient tile (tn, tb), staged d-chunk (tk), threads (tx, ty), entries per
    merge block (lanes), context columns per block (cc), forward-solve thread rows (sy)."""
    name: str
    mp: int
    dv: int
    tn: int
    tb: int
    tk: int = 16
    tx: int = 16
    ty: int = 16
    lanes: int = 32
    cc: int = 8
    sy: int = 32

    @property
    def defines(self):
        return tuple(f'-DNYS_{key.upper()}={getattr(self, key)}' for key in self._fields[1:])

    @property
    def threads(self):
        return self.tx * self.ty

    @property
    def block(self):
        return (self.tx, self.ty, 1)


#: Value tiles fitted to d_v <= 32 (Tiny's heads) or <= 64; gradient tiles of 32 rows, or 16
#: where the device's shared memory is smaller (T4, RTX 20xx: 64 KiB).
VARIANTS = (
    Variant('dv32_tb32', 64, 32, 64, 32),
    Variant('dv32_tb16', 64, 32, 64, 16),
    Variant('dv64_tb32', 64, 64, 64, 32),
    Variant('dv64_tb16', 64, 64, 64, 16),
)
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}
MAX_M = max(v.mp for v in VARIANTS)
MAX_DV = max(v.dv for v in VARIANTS)


def ceil_div(a, b):
    return -(-a // b)


def ns_layout(m):
    """(m padded to the 4 x 4 micro-tile, row stride): lap_common.cuh's ns_stride."""
    mp = ceil_div(m, 4) * 4
    return mp, (NS_LD_NARROW if mp <= NS_LD_NARROW else NS_LD_WIDE)


def grads_smem(v):
    """Dynamic shared memory (bytes) of nys_backward_grads: the layout at its top."""
    dw = max(v.mp, v.dv)
    return 4 * (2 * v.mp * (v.dv + 1) + 2 * v.tb * (v.mp + 1) + 2 * v.tb * (dw + 1)
                + v.tk * (v.tb + 1) + v.tk * (v.mp + 1) + 3 * v.mp + 2 * v.tb + 2 * v.dv)


def row_pass_static_smem(v):
    """Static shared memory (bytes) of the largest row pass, within the 48 KiB of any device."""
    staging = v.tk * (v.tn + 1) + v.tk * (v.mp + 1) + v.tn * (v.mp + 1) + 2 * v.tn
    # The values, the statistics' group sums and the fp64 group sums of the common part
    # and of sum r.
    stats = (staging + v.tn * (v.dv + 1) + 2 * (v.threads // v.mp) * v.mp + 2 * v.threads
             + 2 * (v.threads // v.dv))
    out = staging + v.mp * (v.dv + 1) + v.dv
    return 4 * max(stats, out)


def context_static_smem(v):
    """Static shared memory (bytes) of nys_forward_context: X, P, R and the context columns."""
    return 4 * (2 * v.mp * (v.mp + 1) + 2 * v.mp * (v.cc + 1) + v.mp)


def landmark_tile_floats(v):
    """Floats of the kernel tile of the landmarks against themselves (NYS_LTILE)."""
    return (2 * v.tk + v.mp) * (v.mp + 1)


def ns_partials(v, m, smem_limit):
    """Floats of ns_iterate's k-split partials in nys_forward_solve (lap_common.cuh's
    ns_splits, over the nt^2, nt (nt + 1) / 2 and nt (nt + 1) tiles of its products): tiles x
    splits threads fill the block as far as the room P, X and T leave holds the partials."""
    mp, ld = ns_layout(m)
    nt, room = mp // 4, max(0, (smem_limit - NS_STATIC_SMEM) // 4 - 3 * mp * ld)
    return NS_PART_STRIDE * max(
        (max(1, min(v.tx * v.sy // t, nt, 1 + room // (NS_PART_STRIDE * t))) - 1) * t
        for t in (nt * nt, nt * (nt + 1) // 2, nt * (nt + 1)))


def solve_smem(v, m, partials):
    """Dynamic shared memory (bytes) of nys_forward_solve: P, X, T and the k-split partials,
    or P and the landmark tile (a merge job needs less than both: the .cu asserts it)."""
    mp, ld = ns_layout(m)
    return 4 * max(mp * ld + landmark_tile_floats(v), 3 * mp * ld + partials)


def backward_solve_smem(v, m, cols):
    """Dynamic shared memory (bytes) of nys_backward_solve with ``cols`` value columns a pass."""
    return 4 * (m * m + max(landmark_tile_floats(v),
                            m * (m + 1) + 3 * m * (cols + 1) + v.mp + cols))


class Plan(NamedTuple):
    variant: Variant
    backward_solve_cols: int  # value columns per pass of nys_backward_solve
    solve_smem: int
    backward_solve_smem: int
    grads_smem: int
    ns_partials: int          # floats of the forward solve's k-split partials


def variant_fits(v, smem_limit):
    """Whether the variant's kernels fit ``smem_limit`` bytes of shared memory, whatever m."""
    return row_pass_static_smem(v) <= DEFAULT_SMEM and grads_smem(v) <= smem_limit


@functools.lru_cache(maxsize=None)
def plan(m, dv, smem_limit):
    """A :class:`Plan` for m landmarks and d_v value columns within ``smem_limit`` bytes of
    shared memory, or a tuple of reasons none fits."""
    if not 1 <= m <= MAX_M:
        return (f'm = {m} landmarks; the CUDA kernels take 1 to {MAX_M}',)
    if not 1 <= dv <= MAX_DV:
        return (f'd_v = {dv} value columns; the CUDA kernels take 1 to {MAX_DV}',)
    reasons = []
    for v in sorted((v for v in VARIANTS if v.dv >= dv), key=lambda v: (v.dv, -v.tb)):
        if not variant_fits(v, smem_limit):
            reasons.append(f'variant {v.name}: the gradient kernel needs {grads_smem(v):,} bytes '
                           f'of shared memory, the device allows {smem_limit:,}')
            continue
        # The backward solve's widest column pass: all of d_v, else a halving down to 8.
        bcols = next((c for c in dict.fromkeys([dv] + [c for c in (32, 16, 8) if c < dv])
                      if backward_solve_smem(v, m, c) <= smem_limit), None)
        partials = ns_partials(v, m, smem_limit)
        if solve_smem(v, m, partials) + NS_STATIC_SMEM > smem_limit or bcols is None:
            mp, ld = ns_layout(m)
            need = max(solve_smem(v, m, 0) + NS_STATIC_SMEM, backward_solve_smem(v, m, 8))
            reasons.append(f'variant {v.name}: the solves of m = {m} need {need:,} bytes of '
                           f'shared memory (Newton-Schulz on {mp} x {ld}), the device allows '
                           f'{smem_limit:,}')
            continue
        return Plan(v, bcols, solve_smem(v, m, partials), backward_solve_smem(v, m, bcols),
                    grads_smem(v), partials)
    return tuple(reasons)


@functools.lru_cache(maxsize=None)
def splits(bh, n, target_blocks, tile_rows):
    """(splits, chunk): each (batch, head)'s N rows in slices of ``chunk`` rows (whole tiles),
    about ``target_blocks`` blocks in all; shapes and device alone decide (deterministic)."""
    tiles = ceil_div(max(n, 1), tile_rows)
    count = min(tiles, max(1, ceil_div(target_blocks, bh)), MAX_GRID_X)
    chunk = ceil_div(tiles, count) * tile_rows
    return ceil_div(max(n, 1), chunk), chunk


class DeviceLimits(NamedTuple):
    capability: tuple
    sms: int
    smem_optin: int       # shared memory a block may opt into (static + dynamic), bytes
    nvrtc_major: int      # 0 when unknown


def fit(q, v, landmarks, opts, limits):
    """(why the kernels cannot run these operands on a device of these limits, the plan)."""
    reasons = []
    if q.dtype not in ELEMENT_TYPES:
        reasons.append(f'dtype {q.dtype}; the CUDA kernels take '
                       f'{", ".join(str(t) for t in ELEMENT_TYPES)}')
    if q.numel() == 0 or v.numel() == 0 or landmarks.numel() == 0:
        reasons.append('empty operands')
    sizes = dict(n=q.shape[2], d=q.shape[3], bh=q.shape[0] * q.shape[1],
                 elements=max(q.numel(), v.numel()))
    reasons += [f'{name} = {value:,} exceeds the kernels\' 32-bit index range'
                for name, value in sizes.items() if value > _MAX_SIZE]
    major, minor = limits.capability
    if limits.capability < MIN_CAPABILITY:
        reasons.append(f'compute capability {major}.{minor}; the CUDA kernels need '
                       f'{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later')
    elif limits.nvrtc_major >= 13 and limits.capability < NVRTC13_MIN_CAPABILITY:
        reasons.append(f'NVRTC {limits.nvrtc_major} cannot compile for sm_{major}{minor}; '
                       'install cupy-cuda12x (NVRTC 12)')
    found = plan(landmarks.shape[2], v.shape[3], limits.smem_optin)
    if not isinstance(found, Plan):
        reasons += found
    return tuple(reasons), found


_OPERAND = np.dtype([('ptr', np.uint64), ('sb', np.int64), ('sh', np.int64), ('sn', np.int64),
                     ('sd', np.int64)], align=True)
OPERANDS = ('q', 'k', 'v', 'L', 'g', 'grad_q', 'grad_k', 'grad_v', 'grad_l')
POINTERS = ('out', 'part', 'fold', 'context', 'inverse', 'stats', 'work', 'lpart', 'common')
INTS = ('heads', 'n', 'm', 'd', 'dv', 'chunk', 'splits', 'iters', 'init_authors', 'refine',
        'injective', 'solve_cols', 'ns_partials')
FLOATS = ('neg_inv_lam', 'neg_coef', 'eps', 'whiten_eps')
#: ``struct nys_params`` of the .cu, field for field (C alignment: align=True).
PARAMS_DTYPE = np.dtype([(name, _OPERAND) for name in OPERANDS]
                        + [(name, np.uint64) for name in POINTERS] + [('bh_count', np.int64)]
                        + [(name, np.int32) for name in INTS]
                        + [(name, np.float32) for name in FLOATS], align=True)


def set_operand(params, name, tensor):
    """params[name] = (pointer, batch, head, row, column strides) of a (B, h, n, c) tensor."""
    if tensor is not None:
        params[name] = (tensor.data_ptr(),) + tuple(tensor.stride())
