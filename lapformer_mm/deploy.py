"""Export LaplacianFormer models to ONNX (:func:`export_onnx`, either exporter, static or with
symbolic batch, height and width) or ``torch.export`` (:func:`export_program`), and check the
files in ONNX Runtime against eager (:func:`verify_onnx`); docs/deploy.md. onnx and
onnxruntime (the ``[deploy]`` extra) are imported only where needed.
"""
import contextlib
import copy
import os
import os.path as osp
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .ops._checks import check_choice, check_int
from .ops.export import ORT_DOMAIN, PLACEHOLDER_DOMAIN, ExportForm, check_exportable
from .ops.reference import LANDMARK_CHUNK, adaptive_avg_pool2d_export

TARGETS = ('backbone', 'features', 'model')
EXPORTERS = ('dynamo', 'torchscript')
#: 20 has a Gelu operator (one kernel in ONNX Runtime instead of the five nodes of its erf
#: form). ONNX Runtime >= 1.16 and TensorRT >= 10 read it, TensorRT 8.6 reads 18.
DEFAULT_OPSET = 20
#: From this opset on the standard file's kernel matrices are token blocks (Split and
#: ReduceSum take their sizes as inputs).
BLOCKS_MIN_OPSET = 13
#: The dynamo exporter builds opset 18 and cannot convert these graphs lower (ONNX's version
#: converter needs constant ``axes``); the TorchScript exporter has no dynamic Slice below 10.
LOWEST_OPSET = {'dynamo': 18, 'torchscript': 10}
INPUT_NAME = 'input'
#: Largest weight size kept in the .onnx file (protobuf's 2 GiB limit, with room for the
#: graph); above it the weights go to an external data file.
SINGLE_FILE_BYTES = 2 ** 31 - 2 ** 26
DEPLOY_HINT = "pip install 'lapformer_mm[deploy]' (onnx, onnxscript, onnxruntime)"
#: Where ``tools/build_ort_ops.py`` puts the op library unless $LAPFORMER_ORT_OPS_LIBRARY
#: names another file.
ORT_OPS_LIBRARY = osp.join(osp.dirname(osp.abspath(__file__)), 'liblapformer_mm_ort.so')
ORT_OPS_ENV = 'LAPFORMER_ORT_OPS_LIBRARY'
ORT_OPS_HINT = ('build it with `python tools/build_ort_ops.py --ort-include DIR` (DIR: the '
                'include/ folder of an ONNX Runtime release) or `make ort-ops '
                'ORT_INCLUDE_DIR=DIR`')


def _import(name):
    try:
        return __import__(name)
    except ImportError as err:
        raise ImportError(f'{name} is needed to export and check ONNX models: '
                          f'{DEPLOY_HINT}') from err


def _check_opset(opset, exporter):
    """Before the export (minutes; the TorchScript exporter refuses too high an opset itself):
    past onnxscript's version converter torch falls back to onnx's, which has no adapters for
    these graphs."""
    highest = None
    with contextlib.suppress(ImportError, AttributeError):
        if exporter == 'dynamo':
            from onnxscript.version_converter import _version_converter
            highest = min(_import('onnx').defs.onnx_opset_version(),
                          _version_converter.SUPPORTED_MAX_ONNX_OPSET)
    if not LOWEST_OPSET[exporter] <= opset <= (highest or opset):
        raise ValueError(f'opset={opset!r} is not supported by the {exporter} exporter; allowed: '
                         f'{LOWEST_OPSET[exporter]} to {highest or "its highest"}')


def export_min_size(model: nn.Module) -> int:
    from .models.backbone import LaplacianFormer
    return max((m.export_min_size() for m in model.modules() if isinstance(m, LaplacianFormer)),
               default=1)


class ExportModule(nn.Module):
    """``target`` of a detector, segmentor or bare backbone as a module returning a flat tuple
    of tensors, named in :attr:`output_names` once a forward has run: 'backbone', 'features'
    (with the neck) or 'model' (the raw head outputs; a two-stage detector's stop at the RPN
    maps), from the normalised, padded batch the data preprocessor makes."""

    def __init__(self, model: nn.Module, target: str = 'backbone'):
        super().__init__()
        self.target = check_choice('target', target, TARGETS)
        self.model = model
        # Else the forward fails later on a missing attribute.
        if target != 'backbone' and not hasattr(model, 'backbone'):
            raise ValueError(f'target={target!r} needs a detector or segmentor; '
                             f"{type(model).__name__} supports only 'backbone'")
        if target == 'model' and not any(hasattr(model, head) for head in
                                         ('decode_head', 'rpn_head', 'bbox_head')):
            raise ValueError(f"target='model' needs a decode_head, rpn_head or bbox_head; "
                             f'{type(model).__name__} has none')
        self.output_names: List[str] = []

    def _named_outputs(self, x) -> List[Tuple[str, torch.Tensor]]:
        model = self.model
        if self.target == 'backbone':
            backbone = getattr(model, 'backbone', model)
            outs = _as_list(backbone(x))
            # Named by stage, as PVT and Swin number them.
            stages = sorted(getattr(backbone, 'out_indices', ()))
            if len(stages) != len(outs) or not all(isinstance(i, int) and i >= 0
                                                   for i in stages):
                stages = range(len(outs))
            return [(f'stage{i}', t) for i, t in zip(stages, outs)]
        feats = model.extract_feat(x)
        named = [(f'feat{i}', t) for i, t in enumerate(feats)]
        if self.target == 'features':
            return named
        if hasattr(model, 'decode_head'):
            return [('seg_logits', model.decode_head(feats))]
        two_stage = hasattr(model, 'rpn_head')
        head = model.rpn_head if two_stage else model.bbox_head
        names = ('cls_score', 'bbox_pred', 'centerness', 'extra')
        names = ('rpn_cls', 'rpn_bbox', 'rpn_centerness', 'rpn_extra') if two_stage else names
        outs = [(f'{name}{i}', t) for name, level_outs in zip(names, head(feats))
                for i, t in enumerate(level_outs)]
        return named + outs if two_stage else outs

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        named = self._named_outputs(x)
        self.output_names = [name for name, _ in named]
        return tuple(t for _, t in named)


def _as_list(outs):
    return [outs] if isinstance(outs, torch.Tensor) else list(outs)


class AdaptiveAvgPool2dExport(nn.Module):
    """``nn.AdaptiveAvgPool2d`` from two averaging matrices, for any input size (mmseg's
    pyramid pooling in :func:`prepare_for_export`'s copy)."""

    def __init__(self, output_size):
        super().__init__()
        size = (output_size, output_size) if isinstance(output_size, int) else output_size
        # nn.AdaptiveAvgPool2d takes None (the input's size), which has no export form.
        if len(size) != 2 or not all(isinstance(s, int) and s >= 1 for s in size):
            raise ValueError(f'output_size must be a positive int or a pair of them, got '
                             f'{output_size!r}')
        self.output_size = tuple(size)

    def forward(self, x):
        return adaptive_avg_pool2d_export(x, self.output_size)


class UpsampleExport(nn.Module):
    """mmseg's ``Upsample`` by a whole factor, the factor in the graph: its own
    ``int(size * factor)`` fixes the traced size (TorchScript) and is a shape guard that
    dynamic sizes violate (dynamo). For whole factors the output is the same."""

    def __init__(self, scale_factor, mode, align_corners):
        super().__init__()
        self.scale_factor, self.mode, self.align_corners = scale_factor, mode, align_corners

    def forward(self, x):
        return nn.functional.interpolate(x, scale_factor=self.scale_factor, mode=self.mode,
                                         align_corners=self.align_corners)


def _export_form(child: nn.Module) -> Optional[nn.Module]:
    if isinstance(child, nn.AdaptiveAvgPool2d):
        return AdaptiveAvgPool2dExport(child.output_size)
    # A model holding mmseg's Upsample has imported mmseg; others must not import it here.
    Upsample = getattr(sys.modules.get('mmseg.models.utils'), 'Upsample', None)
    if Upsample is not None and isinstance(child, Upsample) and not child.size and \
            child.scale_factor:
        factors = child.scale_factor if isinstance(child.scale_factor, tuple) else (
            child.scale_factor, )
        if all(float(f).is_integer() for f in factors):
            return UpsampleExport(child.scale_factor, child.mode, child.align_corners)
    return None


def prepare_for_export(model: nn.Module, form: Optional[ExportForm] = None) -> nn.Module:
    """An eval-mode copy of ``model`` that the exporters can trace, its attentions in ``form``
    (None: the default ExportForm): SyncBatchNorm as BatchNorm, ``nn.AdaptiveAvgPool2d`` and
    mmseg's ``Upsample`` by a whole factor in their export forms."""
    from .models.attention import LaplacianAttention
    prepared = copy.deepcopy(model).eval()
    with contextlib.suppress(ImportError):
        from mmengine.model import revert_sync_batchnorm
        prepared = revert_sync_batchnorm(prepared)
    for name, module in list(prepared.named_modules()):
        if isinstance(module, LaplacianAttention):
            try:
                check_exportable(module.options)
            except ValueError as err:
                raise ValueError(f'{name}: {err}') from None
            module.export_form = form
        for child_name, child in module.named_children():
            replacement = _export_form(child)
            if replacement is not None:
                setattr(module, child_name, replacement)
    return prepared


def example_input(shape, batch, seed=0, dtype=torch.float32):
    """A fixed random (batch, 3, H, W) input: normalised images have unit scale."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *shape, generator=gen, dtype=dtype)


def smooth_input(shape, batch, seed=0, dtype=torch.float32, cells=(6, 8)):
    """A fixed natural-image-like (batch, 3, H, W) input: Gaussian noise on a coarse ``cells``
    grid, bilinearly upsampled, unit standard deviation per channel (on white noise the model
    itself is ill-conditioned at large sizes, docs/deploy.md)."""
    if all(min(size, n) < 2 for size, n in zip(shape, cells)):  # else NaN: 0 / 0
        raise ValueError(f'shape {shape!r} with cells {cells!r} is a constant field: give '
                         'more than one pixel and more than one cell along H or W')
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(batch, 3, *cells, generator=gen, dtype=torch.float64)
    field = torch.nn.functional.interpolate(coarse, size=shape, mode='bilinear',
                                            align_corners=False)
    field = (field - field.mean((2, 3), keepdim=True)) / field.std((2, 3), keepdim=True)
    return field.to(dtype)


#: The normalisation of the configs' data preprocessors (ImageNet's mean and std, RGB).
IMAGE_MEAN = (123.675, 116.28, 103.53)
IMAGE_STD = (58.395, 57.12, 57.375)


def toy_image_input(shape, batch, seed=0, dtype=torch.float32, max_objects=4):
    """A fixed (batch, 3, H, W) input as the data preprocessor makes it: image i the toy scene
    (:mod:`lapformer_mm.scenes`) of seed + i, normalised with IMAGE_MEAN and IMAGE_STD."""
    import numpy as np

    from .scenes import render_image
    height, width = shape
    images = [torch.from_numpy(render_image(np.random.default_rng(seed + index), width, height,
                                            max_objects)[0].astype(np.float64)).permute(2, 0, 1)
              for index in range(batch)]
    mean = torch.tensor(IMAGE_MEAN, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD, dtype=torch.float64).view(3, 1, 1)
    return ((torch.stack(images) - mean) / std).to(dtype)


def _example(model, shape, batch, dynamic):
    """The example input and, when ``dynamic``, the Dims of its batch, height and width (traced
    at batch >= 2: torch.export specialises a size-1 dimension)."""
    x = example_input(shape, max(batch, 2) if dynamic else batch)
    if not dynamic:
        return x, None
    Dim, low = torch.export.Dim, export_min_size(model)
    return x, ({0: Dim('batch', min=1, max=1024), 2: Dim('height', min=low, max=16384),
                3: Dim('width', min=low, max=16384)}, )


def export_onnx(model: nn.Module, out: str, *, shape: Sequence[int] = (800, 1333),
                batch: int = 1, dynamic: bool = False, exporter: str = 'dynamo',
                residual: str = 'fp64', opset: int = DEFAULT_OPSET,
                ort_ops: bool = False) -> List[str]:
    """Write ``model`` (e.g. an :class:`ExportModule`; not modified) as the ONNX file ``out``;
    returns the output names.

    Args:
        shape, batch: the example input's (H, W), at least :func:`export_min_size`, and batch.
        dynamic: symbolic batch, height and width (from :func:`export_min_size` to 16384).
        exporter: 'dynamo' (``torch.export``, then the dynamo ONNX exporter) or 'torchscript'.
        residual: the attention's refinement residual, 'fp64' (the eager numerics) or 'fp32'
            (no fp64 tensor, for TensorRT and mobile runtimes).
        opset: the ONNX opset; from 13 on the kernel matrices are written in token blocks.
        ort_ops: each attention as the op library's nodes (:func:`ort_ops_library`).
    """
    check_choice('exporter', exporter, EXPORTERS)  # another would take the TorchScript branch
    _check_opset(opset, exporter)
    # The standard file's kernel matrices as placeholders, expanded into token blocks after
    # the export.
    blocks = not ort_ops and opset >= BLOCKS_MIN_OPSET
    module = prepare_for_export(model, ExportForm(residual, ort_ops, blocks))
    x, dims = _example(model, shape, batch, dynamic)
    with torch.no_grad():
        outputs = _as_list(module(x))
        names = list(getattr(module, 'output_names', [])) or [
            f'output{i}' for i in range(len(outputs))]
        if exporter == 'dynamo':
            _save_program(torch.export.export(module, (x, ), dynamic_shapes=dims), out, names,
                          opset)
        else:
            axes = None
            if dynamic:
                axes = {INPUT_NAME: {0: 'batch', 2: 'height', 3: 'width'}}
                for name, t in zip(names, outputs):
                    axes[name] = {0: 'batch', **{d: f'{name}_dim{d}' for d in range(2, t.dim())}}
            os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
            torch.onnx.export(module, (x, ), out, dynamo=False, input_names=[INPUT_NAME],
                              output_names=names, opset_version=opset, dynamic_axes=axes)
    if blocks:
        onnx = _import('onnx')  # external weights stay where they are
        onnx.save(expand_placeholders(onnx.load(out, load_external_data=False)), out)
    return names


def expand_placeholders(proto):
    """Each placeholder node in ``proto`` (an ``onnx.ModelProto``, changed in place) as
    ``reference.similarity_export``'s standard operators, the tokens in blocks (bounds
    ⌊i·N / blocks⌋ from the input's shape; every sum the unblocked form's, in the same order),
    the i-th's nodes named ``lapformer_mm_kernel<i>/...``."""
    from onnx import helper
    graph = proto.graph
    if any(node.domain == PLACEHOLDER_DOMAIN for f in proto.functions for node in f.node):
        raise ValueError('expand_placeholders: a placeholder inside a local function')
    nodes, count = [], 0
    for node in graph.node:
        if node.domain == PLACEHOLDER_DOMAIN:
            nodes.extend(_blocked_kernel(node, f'lapformer_mm_kernel{count}', helper))
            count += 1
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    imports = [o for o in proto.opset_import if o.domain != PLACEHOLDER_DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(imports)
    return proto


def _blocked_kernel(node, prefix, helper):
    """The standard nodes of one placeholder (x (B, h, N, d), y (B, h, m, d)) -> k (B, h, N, m)."""
    from onnx import TensorProto
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    kind, blocks, m = attrs['kind'].decode(), attrs['blocks'], attrs['m']
    x, y = node.input
    nodes = []

    def const(values, dtype=TensorProto.INT64):
        out = f'{prefix}/c{len(nodes)}'
        nodes.append(helper.make_node('Constant', [], [out], value=helper.make_tensor(
            out, dtype, [len(values)], values)))
        return out

    def op(op_type, inputs, outputs=1, **kwargs):
        outs = [f'{prefix}/{op_type}{len(nodes)}_{i}' for i in range(outputs)]
        nodes.append(helper.make_node(op_type, inputs, outs, name=f'{prefix}/{len(nodes)}',
                                      **kwargs))
        return outs[0] if outputs == 1 else outs

    # x (B, h, 1, d, N) and the landmark chunks (B, h, c, d, 1): the layout of similarity_export.
    # A Reshape, not an Unsqueeze: ONNX Runtime moves a Transpose past an Unsqueeze (and then
    # before a Split), into a slower 5-D transpose (docs/deploy.md).
    shape = op('Shape', [x])
    xt = op('Reshape', [op('Transpose', [x], perm=[0, 1, 3, 2]), op('Concat', [
        op('Slice', [shape, const([0]), const([2])]), const([1]),
        op('Slice', [shape, const([3]), const([4])]), const([-1])], axis=0)])
    yt = op('Unsqueeze', [y, const([4])])
    step = LANDMARK_CHUNK
    chunks = [op('Slice', [yt, const([j]), const([min(j + step, m)]), const([2])])
              for j in range(0, m, step)]
    if blocks == 1:
        parts = [xt]
    else:
        tokens = op('Slice', [shape, const([2]), const([3])])
        edges = op('Div', [op('Mul', [tokens, const(list(range(blocks + 1)))]),
                           const([blocks])])
        sizes = op('Sub', [op('Slice', [edges, const([1]), const([blocks + 1])]),
                           op('Slice', [edges, const([0]), const([blocks])])])
        parts = op('Split', [xt, sizes], outputs=blocks, axis=4)
    rows = []
    for part in parts:
        sums = []
        for chunk in chunks:
            diff = op('Sub', [part, chunk])
            size = op('Abs', [diff]) if kind == 'laplacian' else op('Mul', [diff, diff])
            sums.append(op('ReduceSum', [size, const([3])], keepdims=0))
        rows.append(sums[0] if len(sums) == 1 else op('Concat', sums, axis=2))
    dist = rows[0] if len(rows) == 1 else op('Concat', rows, axis=3)
    scaled = op('Mul', [dist, const([attrs['scale']], TensorProto.FLOAT)])
    nodes.append(helper.make_node('Transpose', [op('Exp', [scaled])], list(node.output),
                                  name=f'{prefix}/out', perm=[0, 1, 3, 2]))
    return nodes


def export_program(model: nn.Module, *, shape: Sequence[int] = (800, 1333), batch: int = 2,
                   dynamic: bool = True, residual: str = 'fp64'):
    """``torch.export.export`` of ``model`` (not modified), arguments as :func:`export_onnx`;
    ``program.run_decompositions()`` lowers it to core ATen with no lapformer_mm op left."""
    x, dims = _example(model, shape, batch, dynamic)
    with torch.no_grad():
        return torch.export.export(prepare_for_export(model, ExportForm(residual)), (x, ),
                                   dynamic_shapes=dims)


def program_to_onnx(program, out: str, *, output_names: Optional[Sequence[str]] = None,
                    opset: int = DEFAULT_OPSET) -> None:
    """Convert an :func:`export_program` program to the ONNX file ``out`` (dynamo exporter);
    its dynamic dimensions stay symbolic."""
    _check_opset(opset, 'dynamo')
    _save_program(program, out, output_names, opset)


def _save_program(program, out, output_names, opset):
    external = sum(t.numel() * t.element_size()
                   for t in program.state_dict.values()) > SINGLE_FILE_BYTES
    onnx_program = torch.onnx.export(
        program, program.example_inputs[0], dynamo=True, input_names=[INPUT_NAME],
        opset_version=opset, verbose=False,
        output_names=list(output_names) if output_names else None)
    # Where its conversion fails, the exporter keeps opset 18 with a log line only.
    written = onnx_program.model.opset_imports.get('')
    if written != opset:
        raise ValueError(f'opset={opset}: the dynamo exporter made opset {written} instead '
                         f'(its conversion failed); no file written')
    _name_input_dims(onnx_program)
    os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
    onnx_program.save(out, external_data=external)


def _name_input_dims(onnx_program):
    """The dynamic input dimensions named batch, height and width (as the TorchScript export
    names them) instead of torch.export's symbols, in every shape that uses them."""
    shape = onnx_program.model.graph.inputs[0].shape
    if shape is None or len(shape) != 4:
        return
    symbolic = {shape[axis]: name for axis, name in ((0, 'batch'), (2, 'height'), (3, 'width'))
                if not isinstance(shape[axis], int) and shape[axis].value is not None}
    if hasattr(onnx_program, 'rename_axes'):
        onnx_program.rename_axes(symbolic)
        return
    # torch releases before ONNXProgram.rename_axes have the pass it calls, or none.
    with contextlib.suppress(ImportError, AttributeError):
        from torch.onnx._internal.exporter import _ir_passes
        _ir_passes.rename_axis(onnx_program.model, symbolic)


def ort_ops_library(path: Optional[str] = None) -> str:
    """The path of the ONNX Runtime op library: ``path``, else $LAPFORMER_ORT_OPS_LIBRARY, else
    :data:`ORT_OPS_LIBRARY`; FileNotFoundError, with the build command, when it is missing."""
    path = path or os.environ.get(ORT_OPS_ENV) or ORT_OPS_LIBRARY
    if not os.path.isfile(path):
        raise FileNotFoundError(f'the ONNX Runtime op library {path!r} does not exist: '
                                f'{ORT_OPS_HINT}')
    return path


def uses_ort_ops(path: str) -> bool:
    proto = _import('onnx').load(path, load_external_data=False)
    return any(o.domain == ORT_DOMAIN for o in proto.opset_import)


#: Left out by :func:`ort_session`: SkipLayerNormFusion made a residual Add and its LayerNorm
#: 3-4× slower on one thread at the backbone's widths (docs/deploy.md) and is known to change
#: results (onnxruntime#17689).
ORT_DISABLED_OPTIMIZERS = ['SkipLayerNormFusion']


def ort_session(path: str, threads: Optional[int] = None, ort_ops=None,
                profile: Optional[str] = None):
    """An ONNX Runtime CPU session of ``path``; ``threads`` intra-op threads (None: all);
    ``ort_ops`` registers the op library: True, False, a library path, or None (when the file
    uses it); ``profile``, a path prefix, times every node (``session.end_profiling()``)."""
    ort = _import('onnxruntime')
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = os.fspath(profile)
    if ort_ops is None:
        ort_ops = uses_ort_ops(path)
    if ort_ops is not False:
        library = ort_ops_library(None if ort_ops is True else os.fspath(ort_ops))
        try:
            options.register_custom_ops_library(library)
        except Exception as err:  # onnxruntime's errors derive from Exception alone
            raise OSError(f'ONNX Runtime cannot register the op library {library!r}: '
                          f'{err}') from err
    return ort.InferenceSession(path, options, providers=['CPUExecutionProvider'],
                                disabled_optimizers=ORT_DISABLED_OPTIMIZERS)


def run_onnx(session, x: torch.Tensor) -> List[torch.Tensor]:
    outs = session.run(None, {session.get_inputs()[0].name: x.detach().cpu().numpy()})
    return [torch.from_numpy(o) for o in outs]


def output_error(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> Dict[str, float]:
    """max_abs: largest |out - ref|; max_rel: the largest of max |out - ref| / max |ref|
    over the outputs (a whole-map relative error, meaningful where single values are ~0)."""
    # Else zip would drop outputs, a difference broadcast, and no values read as a match.
    if (not outs or len(outs) != len(refs) or any(
            o.shape != r.shape or not o.numel() for o, r in zip(outs, refs))):
        raise ValueError(f'outs and refs must be as many non-empty tensors of the same shapes, '
                         f'got {[tuple(o.shape) for o in outs]} and '
                         f'{[tuple(r.shape) for r in refs]}')
    max_abs = max_rel = 0.0
    for out, ref in zip(outs, refs):
        err = (out.double() - ref.double()).abs().max().item()
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / max(ref.double().abs().max().item(), 1e-30))
    return dict(max_abs=max_abs, max_rel=max_rel)


def verify_sizes(shape: Sequence[int], min_size: int) -> List[Tuple[int, int]]:
    """The export size and two others, neither a multiple of 32, each at least ``min_size``
    where the export size is."""
    height, width = shape
    return [(height, width), (max(min_size, height * 3 // 4 + 3), width + 37),
            (height + 45, max(min_size, width * 3 // 4 + 11))]


#: What :func:`verify_onnx` can feed: toy COCO scenes as the data preprocessor makes them,
#: smooth random fields, or white noise (no image; the model itself is ill-conditioned on it
#: at large sizes).
VERIFY_INPUTS = {'toy': toy_image_input, 'smooth': smooth_input, 'noise': example_input}


def rounding_change(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``x`` with each element multiplied by 1 + u, |u| <= 2⁻²⁴ (fp32's unit roundoff), a fixed
    random u, and rounded back: kept or moved by one ulp, the size of change any evaluation
    that rounds differently makes."""
    gen = torch.Generator().manual_seed(seed)
    step = (torch.rand(x.shape, generator=gen, dtype=torch.float64) * 2 - 1) * 2.0 ** -24
    return (x.double() * (1 + step)).to(x.dtype)


def verify_onnx(path: str, model: nn.Module, sizes: Sequence[Sequence[int]], batch: int = 1,
                threads: Optional[int] = None, fp64: bool = True,
                inputs: str = 'toy', images: int = 1) -> List[Dict]:
    """ONNX Runtime against eager PyTorch (fp32) on ``images`` inputs (of the kind
    :data:`VERIFY_INPUTS` names) of each (H, W) of ``sizes``, each at least
    :func:`export_min_size`.

    One dict per size and image: size, image, batch, max_abs, max_rel (:func:`output_error`);
    rounding_rel, how far rounding alone moves eager fp32 on this input (:func:`rounding_change`:
    the scale to read max_rel against); with ``fp64``, fp32_vs_fp64_rel.
    """
    make_input = VERIFY_INPUTS[inputs]
    images = check_int('images', images)  # 0: no rows, which would read as a pass
    sizes = [tuple(size) for size in sizes]
    # ONNX Runtime does not enforce a dynamic file's size range: below it the file runs, to
    # outputs wrong by far more than rounding, which a row would pass off as error.
    minimum = export_min_size(model)
    for i, size in enumerate(sizes):
        if min(size) < minimum:
            raise ValueError(f'sizes[{i}] {size} is below the export size range: H and W must '
                             f'be >= {minimum} for this model (export_min_size)')
    session = ort_session(path, threads)
    module = copy.deepcopy(model if hasattr(model, 'output_names') else ExportModule(model))
    module = module.eval()
    module64 = copy.deepcopy(module).double() if fp64 else None
    rows = []
    for size in sizes:
        for image in range(images):
            seed = 1 + image
            x = make_input(size, batch, seed=seed)
            with torch.no_grad():
                refs = _as_list(module(x))
                row = dict(size=size, image=image, batch=batch,
                           **output_error(run_onnx(session, x), refs))
                moved = _as_list(module(rounding_change(x, seed)))
                row['rounding_rel'] = output_error(moved, refs)['max_rel']
                if module64 is not None:
                    refs64 = _as_list(module64(x.double()))
                    row['fp32_vs_fp64_rel'] = output_error(refs, refs64)['max_rel']
            rows.append(row)
    return rows


def build_model(config, checkpoint: Optional[str] = None, cfg_options: Optional[dict] = None):
    """(model in eval mode, scope) of an mmdet/mmseg config, the weights from ``checkpoint``
    (read with ``weights_only=True``; it must match the model), else random."""
    from .registry import build_from_config
    model, scope = build_from_config(config, cfg_options)
    if checkpoint is not None:
        from .checkpoint import safe_load
        state = safe_load(checkpoint)
        state = state.get('state_dict', state) if isinstance(state, dict) else state
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise ValueError(f'checkpoint {checkpoint!r} holds no state dict')
        state = {k[len('module.'):] if k.startswith('module.') else k: v
                 for k, v in state.items()}
        # Another shape is torch's RuntimeError. The load's own report: its hooks
        # (BatchNorm's num_batches_tracked, mmdet's renamed heads) fill or map keys.
        report = model.load_state_dict(state, strict=False)
        if report.missing_keys or report.unexpected_keys:
            raise ValueError(
                f'checkpoint {checkpoint!r} does not match the model of {config}: '
                f'{len(report.missing_keys)} missing keys (e.g. {report.missing_keys[:3]}), '
                f'{len(report.unexpected_keys)} unexpected (e.g. '
                f'{report.unexpected_keys[:3]})')
    return model, scope


def export_config(config, out: str, *, checkpoint: Optional[str] = None,
                  target: str = 'backbone', cfg_options: Optional[dict] = None,
                  **export_kwargs) -> Tuple[ExportModule, List[str]]:
    """:func:`export_onnx` of the ``target`` of ``config``'s model to ``out``; the
    (unprepared) :class:`ExportModule` and the output names."""
    model, _ = build_model(config, checkpoint, cfg_options)
    module = ExportModule(model, target)
    return module, export_onnx(module, out, **export_kwargs)


#: Far above the spread of honest files against the rounding column (docs/deploy.md, What
#: accuracy to expect), far below a file with a size fixed in its trace.
WRONG_FACTOR = 100.


def wrong_rows(rows: Sequence[Dict], factor: float = WRONG_FACTOR) -> List[Dict]:
    """The :func:`verify_onnx` rows more than ``factor`` times further from eager than
    rounding alone moves it (at least 1e-6): the file does not compute the model there."""
    return [r for r in rows if r['max_rel'] > factor * max(r['rounding_rel'], 1e-6)]


def format_rows(rows: Sequence[Dict]) -> str:
    has64 = any('fp32_vs_fp64_rel' in r for r in rows)
    head = ('| size | image | batch | max abs error | max rel error | eager fp32, input '
            'changed by rounding (rel) |' + (' eager fp32 vs fp64 (rel) |' if has64 else ''))
    lines = [head, '|---' * (6 + has64) + '|']
    for r in rows:
        line = (f"| {r['size'][0]}x{r['size'][1]} | {r.get('image', 0)} | {r['batch']} | "
                f"{r['max_abs']:.2e} | {r['max_rel']:.2e} | {r['rounding_rel']:.2e} |")
        if has64:
            line += f" {r['fp32_vs_fp64_rel']:.2e} |"
        lines.append(line)
    return '\n'.join(lines)
