"""The deploy tests' tiny backbone, accuracy measure, graph checks and op library."""
import copy
import functools
import os
import os.path as osp
import tempfile

import torch
from _shared import ROOT

from lapformer_mm.models import LaplacianFormer

#: ONNX Runtime's C API headers: $ORT_INCLUDE_DIR, else the copy CI has beside the checkout.
ORT_INCLUDE = os.environ.get('ORT_INCLUDE_DIR') or osp.join(
    osp.dirname(ROOT), 'shared', 'third_party', 'onnxruntime-1.29', 'include')

#: Four stages of one block each, narrow: the default layout's export paths, traced fast.
TINY_ARCH = dict(embed_dims=[16, 32, 40, 64], num_heads=[1, 2, 2, 4], depths=[1, 1, 1, 1])

#: An exported graph may be this many times further from eager fp32 than eager fp32 is from
#: fp64 (per output, relative to its largest value): the whitening amplifies rounding ~1000×
#: and ONNX Runtime rounds differently from ATen, so an honest graph is 1.2-4.2× as far
#: (measured 2026-12-01); a wrong bin edge or a dropped landmark chunk is 1e-2 or more.
FACTOR = 8.0
#: Rounding floor of the fp32-vs-fp64 error (an output that fp32 computes exactly).
FLOOR = 1e-6


def tiny_backbone(seed=0, **kwargs):
    torch.manual_seed(seed)
    model = LaplacianFormer(TINY_ARCH, drop_path_rate=0.0, **kwargs)
    model.init_weights()
    return model.eval()


def relative_errors(outs, refs):
    """max |out - ref| / max |ref| of each output pair."""
    assert len(outs) == len(refs)
    errors = []
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape, (out.shape, ref.shape)
        ref = ref.double()
        errors.append(((out.double() - ref).abs().max() / ref.abs().max()).item())
    return errors


def as_list(outs):
    return [outs] if isinstance(outs, torch.Tensor) else list(outs)


def assert_as_close_as_fp32(outs, module, x, what=''):
    """Each of ``outs`` within FACTOR × (eager fp32 vs fp64) of eager fp32 on ``x``."""
    with torch.no_grad():
        ref32, ref64 = as_list(module(x)), as_list(copy.deepcopy(module).double()(x.double()))
    errors = relative_errors(outs, ref32)
    budget = [FACTOR * max(e, FLOOR) for e in relative_errors(ref32, ref64)]
    bad = [(i, f'{e:.2e} > {b:.2e}') for i, (e, b) in enumerate(zip(errors, budget)) if e > b]
    assert not bad, f'{what} {tuple(x.shape)}: outputs further from eager fp32 than ' \
                    f'{FACTOR}x the fp32-vs-fp64 error: {bad}'
    return errors, budget


def non_standard_nodes(proto):
    """(domain, op) of nodes outside the standard ONNX domain, and local functions."""
    nodes = {(n.domain, n.op_type) for n in proto.graph.node if n.domain not in ('', 'ai.onnx')}
    return sorted(nodes) + [('function', f.name) for f in proto.functions]


def fp64_tensors(proto):
    """Names of the fp64 tensors of an ONNX model (values, initializers, cast targets)."""
    import onnx
    inferred = onnx.shape_inference.infer_shapes(proto)
    double = onnx.TensorProto.DOUBLE
    values = list(inferred.graph.value_info) + list(inferred.graph.output) + list(
        inferred.graph.input)
    names = {v.name for v in values if v.type.tensor_type.elem_type == double}
    names |= {t.name for t in proto.graph.initializer if t.data_type == double}
    names |= {n.output[0] for n in proto.graph.node if n.op_type == 'Cast' and any(
        a.name == 'to' and a.i == double for a in n.attribute)}
    return sorted(names)


def constant_values(proto):
    """{name: numpy array} of the initializers and Constant nodes."""
    from onnx import numpy_helper
    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == 'Constant':
            for attr in node.attribute:
                if attr.name == 'value':
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


#: Ops through which a Reshape's target shape is assembled from pieces.
_SHAPE_PLUMBING = {'Concat': None, 'Unsqueeze': 1, 'Squeeze': 1, 'Cast': 1, 'Identity': 1}


def frozen_reshapes(proto, sizes):
    """Reshape nodes whose target shape (followed back through Concat/Unsqueeze/Squeeze/Cast)
    has a constant piece that is one of ``sizes``."""
    constants = constant_values(proto)
    producers = {out: node for node in proto.graph.node for out in node.output}

    def constant_pieces(name):
        if name in constants:
            return [int(v) for v in constants[name].reshape(-1)]
        node = producers.get(name)
        if node is None or node.op_type not in _SHAPE_PLUMBING:
            return []
        inputs = node.input[:_SHAPE_PLUMBING[node.op_type]]
        return [v for i in inputs for v in constant_pieces(i)]

    frozen = []
    for node in proto.graph.node:
        if node.op_type == 'Reshape':
            pieces = constant_pieces(node.input[1])
            if set(pieces) & set(sizes):
                frozen.append((node.name, pieces))
    return frozen


def stage_sizes(shape):
    """The spatial numbers a graph traced at ``shape`` could freeze (H, W, H·W per stage)."""
    height, width = shape
    sizes = {height, width, height * width}
    for stride in (2, 4, 8, 16, 32):
        h, w = -(-height // stride), -(-width // stride)
        sizes |= {h, w, h * w}
    return sizes


@functools.lru_cache(maxsize=None)
def ort_library():
    """The op library built once per test process, or None without the headers."""
    from lapformer_mm.cli import build_ort_ops
    if not osp.isfile(osp.join(ORT_INCLUDE, 'onnxruntime_c_api.h')):
        return None
    folder = tempfile.mkdtemp(prefix='lapformer_ort_ops_')
    return build_ort_ops.build(ORT_INCLUDE, osp.join(folder, build_ort_ops.LIBRARY_NAME))


def require_ort_headers():
    import pytest
    if not osp.isfile(osp.join(ORT_INCLUDE, 'onnxruntime_c_api.h')):
        pytest.skip(f'no ONNX Runtime C API headers at {ORT_INCLUDE} (set ORT_INCLUDE_DIR)')


def require_ort_library():
    require_ort_headers()
    return ort_library()
