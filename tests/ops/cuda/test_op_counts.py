"""Launches plus ATen compute ops per LaplacianAttention call on the emulated CUDA path
(devtools/op_counts.py): at most 10 forward, 30 forward+backward (issue #24)."""

import pytest
import torch
from _emulation_fixtures import emu_lib  # noqa: F401 (a fixture)

from devtools.cuda_emulation import make_launch, route_cpu_tensors_to_cuda_backend
from devtools.op_counts import module_call_counts
from lapformer_mm.models.attention import LaplacianAttention
from lapformer_mm.ops.backends import cuda as rt
from lapformer_mm.ops.backends import cuda_plan

# Ops that wait for the device (a CUDA tensor's value read on the host).
HOST_SYNCS = {'aten::_local_scalar_dense', 'aten::item', 'aten::is_nonzero', 'aten::equal'}


@pytest.fixture
def cupy_path(emu_lib, monkeypatch):  # noqa: F811 (the imported fixture)
    monkeypatch.setattr(rt, 'launch', make_launch(emu_lib))
    route_cpu_tensors_to_cuda_backend(monkeypatch.setattr)


@pytest.mark.slow
@pytest.mark.parametrize('qk_shared', [True, False])
def test_launches_plus_aten_ops_per_attention_call(cupy_path, qk_shared):
    torch.manual_seed(0)
    module = LaplacianAttention(64, 2, qk_shared=qk_shared).train()
    x = torch.randn(2, 63, 64, requires_grad=True)
    forward, both = module_call_counts(module, x, (7, 9), rt)
    totals_f, totals_b = forward.totals(), both.totals()
    print(f'qk_shared={qk_shared}: forward {totals_f} {dict(forward.compute)}; '
          f'forward+backward {totals_b} {dict(both.compute)}')
    assert dict(forward.launches) == {name: 1 for name in cuda_plan.FORWARD}
    assert dict(both.launches) == {name: 1 for name in rt.STAGES}
    assert totals_f['launches+compute'] <= 10
    assert totals_b['launches+compute'] <= 30
    # One op of ours per direction, and nothing computed inside it but our launches.
    assert dict(both.ours) == {'lapformer_mm::nystrom_attention': 1,
                               'lapformer_mm::nystrom_attention_backward': 1}
    assert not HOST_SYNCS & set(both.compute)
    # No cast kernels: fp32 in, fp32 out, nothing converted.
    assert '_to_copy' not in ''.join(both.compute)


@pytest.mark.slow
def test_16_bit_operands_are_not_cast(cupy_path):
    """Under autocast the projection emits bf16 and the op reads it as it is."""
    torch.manual_seed(0)
    module = LaplacianAttention(64, 2).eval()
    x = torch.randn(2, 63, 64)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        forward, _ = module_call_counts(module, x, (7, 9), rt, backward=False)
    assert dict(forward.launches) == {name: 1 for name in cuda_plan.FORWARD}
    # Autocast's own casts of the fp32 input x and of the weights and biases of the two
    # linear layers and the conv: 7. q, k, v and the landmarks are never converted.
    assert forward.compute['aten::_to_copy'] == 7, dict(forward.compute)
