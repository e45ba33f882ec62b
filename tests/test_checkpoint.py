"""Checkpoints under torch's weights_only loading: mmengine's own load, crafted pickles don't."""

import numpy as np
import pytest
import torch
from _runner_helpers import RunsCode, make_runner
from mmengine.hooks import Hook
from mmengine.logging import HistoryBuffer

import lapformer_mm  # noqa: F401  (allowlists mmengine's checkpoint contents)
from lapformer_mm.checkpoint import TRUST_ENV, load_checkpoint, safe_load


@pytest.fixture(scope='module')
def full_checkpoint(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('run')
    make_runner(work_dir, max_epochs=1).train()
    return work_dir / 'epoch_1.pth'


class WalksAttributes:
    """A ``getattr`` beyond HistoryBuffer's statistics methods: the first step of an escape."""

    def __reduce__(self):
        return (getattr, (HistoryBuffer, '__dict__'))


def test_mmengine_checkpoint_loads_with_weights_only(full_checkpoint):
    checkpoint = torch.load(full_checkpoint, weights_only=True)
    assert {'meta', 'state_dict', 'optimizer', 'message_hub'} <= set(checkpoint)
    assert isinstance(checkpoint['message_hub']['log_scalars']['train/loss'], HistoryBuffer)
    assert safe_load(full_checkpoint)['meta']['epoch'] == 1


@pytest.mark.parametrize('module', ['numpy.core.multiarray', 'numpy._core.multiarray'])
def test_checkpoint_pickled_by_either_numpy_major_loads(full_checkpoint, tmp_path, module):
    """numpy 1 pickles arrays from numpy.core, numpy 2 from numpy._core."""
    import zipfile

    saved = tmp_path / 'other_numpy.pth'
    spellings = (b'numpy.core.multiarray\n', b'numpy._core.multiarray\n')
    found = 0
    with zipfile.ZipFile(full_checkpoint) as src, zipfile.ZipFile(saved, 'w') as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith('data.pkl'):
                for spelling in spellings:
                    found += data.count(spelling)
                    data = data.replace(spelling, module.encode() + b'\n')
            dst.writestr(item, data)
    assert found, 'the checkpoint pickles no numpy array: nothing to respell'
    checkpoint = safe_load(saved)
    expected = torch.load(full_checkpoint, weights_only=True)['message_hub']
    assert checkpoint['message_hub']['log_scalars']['train/loss'].mean() == pytest.approx(
        expected['log_scalars']['train/loss'].mean())


class RecordIterations(Hook):

    def __init__(self):
        self.iterations = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.iterations.append(runner.iter)


def test_runner_resumes_from_full_checkpoint(full_checkpoint, tmp_path):
    record = RecordIterations()
    runner = make_runner(tmp_path, max_epochs=2, load_from=str(full_checkpoint), resume=True,
                         custom_hooks=[record])
    runner.train()
    assert record.iterations == [4, 5, 6, 7]
    assert runner.epoch == 2


def object_array(marker):
    payload = np.empty(1, dtype=object)  # numpy arrays are allowlisted; object ones must not be
    payload[0] = RunsCode(marker)
    return payload


@pytest.mark.parametrize('payload, protocol', [
    (RunsCode, 2), (lambda marker: WalksAttributes(), 2), (object_array, 2),
    # Protocols 4 and 5 use opcodes the safe loader lacks: a checkpoint all the same, which
    # the trust opt-in loads, not a file of other bytes.
    (lambda marker: {'w': torch.ones(2)}, 5),
])
@pytest.mark.filterwarnings('ignore:Detected pickle protocol 5:UserWarning')
def test_what_is_not_plain_weights_is_refused_with_the_trust_hint(tmp_path, payload, protocol):
    marker, path = tmp_path / 'ran', tmp_path / 'evil.pth'
    torch.save({'state_dict': {}, 'payload': payload(marker)}, path, pickle_protocol=protocol)
    with pytest.raises(RuntimeError, match='Refused') as info:
        safe_load(path)
    assert TRUST_ENV in str(info.value)
    assert not marker.exists()


def test_mmengines_own_loader_is_left_to_torchs_refusal(tmp_path):
    marker, path = tmp_path / 'ran', tmp_path / 'evil.pth'
    torch.save({'state_dict': {}, 'payload': RunsCode(marker)}, path)
    from mmengine.runner import CheckpointLoader
    for load in (torch.load, CheckpointLoader.load_checkpoint):
        with pytest.raises(Exception, match='Weights only load failed'):
            load(str(path))
    assert not marker.exists()


@pytest.mark.parametrize('name, error', [('nope.pth', FileNotFoundError),
                                         ('', IsADirectoryError)])
def test_a_missing_file_or_a_folder_is_named(tmp_path, name, error):
    with pytest.raises(error, match=str(tmp_path / name)):
        safe_load(tmp_path / name)


class HarmlessCustomObject:
    """Not on the allowlist but harmless: what a trusted third-party checkpoint may hold."""

    def __init__(self):
        self.note = 'trusted'


@pytest.mark.usefixtures('mmdet_scope')
def test_trust_opt_in_named_in_the_message_works(tmp_path, monkeypatch):
    path = tmp_path / 'custom.pth'
    torch.save({'state_dict': {'w': torch.ones(2)}, 'meta': HarmlessCustomObject()}, path)
    with pytest.raises(RuntimeError, match='Refused to load checkpoint'):
        safe_load(path)
    monkeypatch.setenv(TRUST_ENV, '1')
    with pytest.warns(UserWarning, match='full unpickling'):
        loaded = safe_load(path)
    assert loaded['meta'].note == 'trusted'


@pytest.mark.parametrize('content', [b'hello\n', b'{"epoch": 3}\n', bytes(range(256)) * 4,
                                     b"auto_scale_lr = dict(base_batch_size=16)\n"],
                         ids=['text', 'json', 'bytes', 'config'])
def test_a_file_that_is_no_checkpoint_is_named_so_not_refused_as_unsafe(tmp_path, content):
    """Other bytes: named as no checkpoint, with no trust opt-in offered."""
    path = tmp_path / 'notes.pth'
    path.write_bytes(content)
    with pytest.raises(RuntimeError, match='notes.pth') as info:
        safe_load(path)
    assert TRUST_ENV not in str(info.value)


def test_a_bad_map_location_is_named_not_blamed_on_the_file(tmp_path):
    path = tmp_path / 'fine.pth'
    torch.save({'w': torch.ones(2)}, path)
    # A location torch cannot restore, given where safe_load does not check it (in a dict):
    # a whole archive, not called truncated.
    with pytest.raises(RuntimeError, match='fine.pth') as info:
        safe_load(path, map_location={'cpu': 'nonsense'})
    assert 'truncated' not in str(info.value)
    # torch.device names the string; in the load it read as an unreadable file.
    with pytest.raises(RuntimeError, match='gpu') as info:
        safe_load(path, map_location='gpu')
    assert 'fine.pth' not in str(info.value)
    # Checked before the download, too.
    with pytest.raises(RuntimeError, match='gpu'):
        load_checkpoint('https://example.invalid/x.pth', map_location='gpu')
    for location in ('cpu', torch.device('cpu'), None, {'cpu': 'cpu'},
                     lambda storage, tag: storage):
        assert torch.equal(safe_load(path, map_location=location)['w'], torch.ones(2))
