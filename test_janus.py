"""Property checks for Janus-LoRA minimal: each test asserts an identity, an oracle or a bound that
breaks when the code is wrong. CPU, random weights, files and data the tests write; the method's checks
also run on CUDA when present. Sections: the backbone (vit.py), the data (data.py), the method, the program.
Run: pytest -q
"""
import copy
import gzip
import json
import math
import re
import shutil
import struct
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image

import data
import janus_min as jm
import vit


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every test runs as if offline, whether or not the machine has a network: no test may download a
    data set or a checkpoint. Tests that need a download replace download_url_to_file themselves."""
    def offline(*args, **kwargs):
        raise urllib.error.URLError('the tests run offline')
    monkeypatch.setattr(urllib.request, 'urlopen', offline)  # torchvision's dataset downloads
    monkeypatch.setattr(torch.hub, 'download_url_to_file', offline)  # checkpoints (vit.load_pretrained)


# ===================================================================================================
# The backbone: vit.py
# ===================================================================================================
# ---- writers for the three key layouts (from a torchvision state dict) ----
_TV_TO_TIMM = [(r'^class_token$', 'cls_token'), (r'^encoder\.pos_embedding$', 'pos_embed'),
               (r'^conv_proj\.', 'patch_embed.proj.'), (r'^encoder\.ln\.', 'norm.'), (r'^heads\.head\.', 'head.'),
               (r'^encoder\.layers\.encoder_layer_(\d+)\.', r'blocks.\1.'), (r'\.ln_1\.', '.norm1.'),
               (r'\.ln_2\.', '.norm2.'), (r'\.self_attention\.in_proj_', '.attn.qkv.'),
               (r'\.self_attention\.out_proj\.', '.attn.proj.'), (r'\.mlp\.0\.', '.mlp.fc1.'),
               (r'\.mlp\.3\.', '.mlp.fc2.')]


def tv_to_timm(sd):
    out = {}
    for k, v in sd.items():
        for pattern, repl in _TV_TO_TIMM:
            k = re.sub(pattern, repl, k)
        out[k] = v.clone()
    return out


def write_npz(sd, path, heads):
    """The public AugReg layout: HWIO conv kernel, (in, out) dense kernels, per-head q/k/v/out kernels."""
    d = sd['class_token'].shape[-1]
    a = {'embedding/kernel': sd['conv_proj.weight'].permute(2, 3, 1, 0), 'embedding/bias': sd['conv_proj.bias'],
         'cls': sd['class_token'], 'Transformer/posembed_input/pos_embedding': sd['encoder.pos_embedding'],
         'Transformer/encoder_norm/scale': sd['encoder.ln.weight'],
         'Transformer/encoder_norm/bias': sd['encoder.ln.bias'],
         'head/kernel': sd['heads.head.weight'].T, 'head/bias': sd['heads.head.bias']}
    i = 0
    while f'encoder.layers.encoder_layer_{i}.ln_1.weight' in sd:
        t, g = f'encoder.layers.encoder_layer_{i}.', f'Transformer/encoderblock_{i}/'
        m = g + 'MultiHeadDotProductAttention_1/'
        for ln, name in (('ln_1', 'LayerNorm_0'), ('ln_2', 'LayerNorm_2')):
            a[g + name + '/scale'], a[g + name + '/bias'] = sd[t + ln + '.weight'], sd[t + ln + '.bias']
        ws, bs = sd[t + 'self_attention.in_proj_weight'].chunk(3), sd[t + 'self_attention.in_proj_bias'].chunk(3)
        for name, w, b in zip(('query', 'key', 'value'), ws, bs):
            a[m + name + '/kernel'] = w.T.reshape(d, heads, d // heads)
            a[m + name + '/bias'] = b.reshape(heads, d // heads)
        a[m + 'out/kernel'] = sd[t + 'self_attention.out_proj.weight'].T.reshape(heads, d // heads, d)
        a[m + 'out/bias'] = sd[t + 'self_attention.out_proj.bias']
        for n, j in ((0, 0), (1, 3)):
            a[f'{g}MlpBlock_3/Dense_{n}/kernel'] = sd[f'{t}mlp.{j}.weight'].T
            a[f'{g}MlpBlock_3/Dense_{n}/bias'] = sd[f'{t}mlp.{j}.bias']
        i += 1
    np.savez(path, **{k: v.numpy() for k, v in a.items()})


_ST_NAMES = {torch.float32: 'F32', torch.int64: 'I64'}


def write_safetensors(sd, path):
    header, blobs, offset = {'__metadata__': {'format': 'pt'}}, [], 0
    for k, v in sd.items():
        b = v.contiguous().numpy().tobytes()
        header[k] = {'dtype': _ST_NAMES[v.dtype], 'shape': list(v.shape), 'data_offsets': [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b' ' * (-len(h) % 8)  # the format pads the header to 8 bytes
    with open(path, 'wb') as f:
        f.write(len(h).to_bytes(8, 'little') + h + b''.join(blobs))


def write_all(sd, d, heads):
    """One file per format from one torchvision state dict -> {format name: path}."""
    paths = {'torchvision': d / 'tv.pth', 'npz': d / 'w.npz', 'timm': d / 'timm.pth', 'safetensors': d / 'w.st'}
    torch.save(sd, paths['torchvision'])
    write_npz(sd, paths['npz'], heads)
    torch.save(tv_to_timm(sd), paths['timm'])
    write_safetensors(tv_to_timm(sd), paths['safetensors'])
    return paths


def tv_features(model, x):
    model.heads = torch.nn.Identity()  # torchvision's forward then returns the normed class token
    return model.eval()(x)


@pytest.fixture(scope='module')
def vitb(tmp_path_factory):
    torch.manual_seed(0)
    tv = torchvision.models.vit_b_16().eval()
    sd = {k: v.clone() for k, v in tv.state_dict().items()}
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref = tv_features(tv, x)
    paths = write_all(sd, tmp_path_factory.mktemp('vitb'), heads=12)
    model = vit.vit_base_patch16()
    report = vit.load_pretrained(model, paths['torchvision'], verbose=False)
    return dict(sd=sd, x=x, ref=ref, paths=paths, model=model, report=report, z_tv=features(model, x))


@pytest.fixture(scope='module')
def small(tmp_path_factory):
    """A 2-block Ti-width torchvision ViT and its files: for the error, resize and LoRA tests."""
    torch.manual_seed(1)
    tv = torchvision.models.VisionTransformer(224, 16, num_layers=2, num_heads=3, hidden_dim=192, mlp_dim=768).eval()
    sd = {k: v.clone() for k, v in tv.state_dict().items()}
    x = torch.randn(3, 3, 224, 224)
    with torch.no_grad():
        ref = tv_features(tv, x)
    return dict(sd=sd, x=x, ref=ref, paths=write_all(sd, tmp_path_factory.mktemp('small'), heads=3))


def features(model, x):
    with torch.no_grad():
        return model.eval()(x)


def test_vit_b16_matches_torchvision(vitb):
    assert vitb['report']['format'] == 'torchvision' and vitb['report']['loaded'] == 198
    assert vitb['report']['ignored'] == ['heads.head.bias', 'heads.head.weight']
    assert (vitb['z_tv'] - vitb['ref']).abs().max() <= 1e-4
    frozen = sum(p.numel() for n, p in vitb['model'].named_parameters() if not n.endswith(('.A', '.B')))
    assert frozen == 85_798_656


@pytest.mark.parametrize('fmt', ['npz', 'timm', 'safetensors'])
def test_every_format_loads_the_same_weights(vitb, fmt):
    model = vit.vit_base_patch16()
    report = vit.load_pretrained(model, vitb['paths'][fmt], verbose=False)
    assert report['format'] == {'safetensors': 'timm'}.get(fmt, fmt) and report['loaded'] == 198
    assert report['ignored'] == (['head/bias', 'head/kernel'] if fmt == 'npz' else ['head.bias', 'head.weight'])
    assert (features(model, vitb['x']) - vitb['z_tv']).abs().max() <= 1e-5


@pytest.mark.parametrize('wrap', ['model', 'state_dict', 'legacy_mlp'])
def test_wrapped_and_legacy_torch_files(small, tmp_path, wrap):
    sd = small['sd']
    if wrap == 'legacy_mlp':  # key names of torchvision's released ViT_B_16 file
        obj = {k.replace('mlp.0.', 'mlp.linear_1.').replace('mlp.3.', 'mlp.linear_2.'): v for k, v in sd.items()}
    else:
        obj = {wrap: sd, 'epoch': 3}
    torch.save(obj, tmp_path / 'w.pth')
    model = vit.vit_tiny_patch16(depth=2)
    vit.load_pretrained(model, str(tmp_path / 'w.pth'), verbose=False)
    assert (features(model, small['x']) - small['ref']).abs().max() <= 1e-5


def test_lora_lifecycle(small):
    torch.manual_seed(2)
    model = vit.vit_tiny_patch16(depth=2)
    ab = [p.detach().clone() for p in model.lora_parameters()]
    vit.load_pretrained(model, small['paths']['npz'], verbose=False)
    assert all(torch.equal(a, p) for a, p in zip(ab, model.lora_parameters()))  # loading leaves A, B alone
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in model.lora_parameters()}
    assert [(i, n) for i, n, _ in model.lora_layers()] == [(0, 'k'), (0, 'v'), (1, 'k'), (1, 'v')]
    for blk in model.blocks:
        assert type(blk.attn.q) is torch.nn.Linear and type(blk.attn.proj) is torch.nn.Linear
        assert isinstance(blk.attn.k, vit.LoRALinear) and isinstance(blk.attn.v, vit.LoRALinear)
    x = small['x']
    assert (features(model, x) - small['ref']).abs().max() <= 1e-5  # B = 0, random A: no change
    z, kv = model.encode(x)
    assert torch.equal(z, model(x)) and len(kv) == 2 and kv[0].shape == (3, 197, 192)
    memory = torch.linalg.qr(torch.randn(192, 20))[0]  # (d_in, m) orthonormal
    model.blocks[1].attn.k.memory = memory
    opt = torch.optim.Adam(model.lora_parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    before = features(model, x)
    assert (before - small['ref']).abs().max() > 1e-3  # the adapters did change the features
    params = model.lora_parameters()
    for _, _, layer in model.lora_layers():
        layer.merge_()
    assert all(p is q for p, q in zip(params, model.lora_parameters()))
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}  # still frozen
    assert all(layer.B.abs().max() == 0 for _, _, layer in model.lora_layers())
    assert (features(model, x) - before).abs().max() <= 1e-5
    assert (model.blocks[1].attn.k.A @ memory).abs().max() <= 1e-5  # the fresh A starts off span(M)


def test_memory_routed_forward_gives_safe_gradient():
    torch.manual_seed(3)
    d_in, d_out, r, s = 12, 7, 3, 0.7
    layer = vit.LoRALinear(d_in, d_out, r, s).double()
    with torch.no_grad():
        layer.B.normal_()
    layer.memory = torch.linalg.qr(torch.randn(d_in, 4, dtype=torch.float64))[0]
    x = torch.randn(5, 2, d_in, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(5, 2, d_out, dtype=torch.float64)
    (layer(x) * upstream).sum().backward()
    w = (layer.weight + s * layer.B @ layer.A).detach().requires_grad_(True)  # the dense W = W0 + s B A
    x_ref = x.detach().clone().requires_grad_(True)
    out_ref = torch.nn.functional.linear(x_ref, w, layer.bias)
    (out_ref * upstream).sum().backward()
    g, m = w.grad, layer.memory
    p_free = torch.eye(d_in, dtype=torch.float64) - m @ m.T  # I - M M^T
    assert torch.allclose(layer(x), out_ref, atol=1e-12)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    assert torch.allclose(layer.A.grad, s * layer.B.T @ g @ p_free, atol=1e-12)
    assert torch.allclose(layer.B.grad, s * g @ p_free @ layer.A.T, atol=1e-12)


def test_bad_checkpoints_fail_with_a_named_problem(vitb, small, tmp_path):
    wrong_size = r'width 384, 12 blocks.*shape mismatches.*class_token \(1, 1, 768\) vs cls_token \(1, 1, 384\)'
    with pytest.raises(vit.CheckpointError, match=wrong_size):
        vit.load_pretrained(vit.vit_small_patch16(), vitb['paths']['torchvision'], verbose=False)
    sd = dict(small['sd'])
    del sd['encoder.layers.encoder_layer_1.ln_2.bias']
    torch.save(sd, tmp_path / 'missing.pth')
    with pytest.raises(vit.CheckpointError, match=r'missing keys \(1\): encoder\.layers\.encoder_layer_1\.ln_2\.bias;'):
        vit.load_pretrained(vit.vit_tiny_patch16(depth=2), tmp_path / 'missing.pth', verbose=False)
    torch.save({**small['sd'], 'encoder.extra': torch.zeros(1)}, tmp_path / 'extra.pth')
    with pytest.raises(vit.CheckpointError, match=r'unexpected keys \(1\): encoder\.extra;'):
        vit.load_pretrained(vit.vit_tiny_patch16(depth=2), tmp_path / 'extra.pth', verbose=False)
    with pytest.raises(vit.CheckpointError, match=r'missing keys \(16\): Transformer/encoderblock_2/'):  # 3 blocks
        vit.load_pretrained(vit.vit_tiny_patch16(depth=3), small['paths']['npz'], verbose=False)
    for fmt, path in small['paths'].items():
        data = path.read_bytes()
        (tmp_path / fmt).write_bytes(data[:len(data) // 2])
        with pytest.raises(vit.CheckpointError, match='truncated'):
            vit.load_pretrained(vit.vit_tiny_patch16(depth=2), tmp_path / fmt, verbose=False)
    (tmp_path / 'notes.txt').write_text('not a checkpoint\n')
    with pytest.raises(vit.CheckpointError, match='not a checkpoint'):
        vit.load_pretrained(vit.vit_tiny_patch16(depth=2), tmp_path / 'notes.txt', verbose=False)
    torch.save({'foo': torch.zeros(2)}, tmp_path / 'other.pth')
    with pytest.raises(vit.CheckpointError, match='no known ViT key layout'):
        vit.load_pretrained(vit.vit_tiny_patch16(depth=2), tmp_path / 'other.pth', verbose=False)
    with pytest.raises(vit.CheckpointError, match='no checkpoint file'):
        vit.load_pretrained(vit.vit_tiny_patch16(depth=2), tmp_path / 'absent.npz', verbose=False)


@pytest.mark.parametrize('img_size, grid', [(384, 24), (32, 2)])
def test_position_embedding_is_resized(small, img_size, grid):
    model = vit.vit_tiny_patch16(depth=2, img_size=img_size)
    report = vit.load_pretrained(model, small['paths']['timm'], verbose=False)
    assert report['resized'] == f'14x14 -> {grid}x{grid}' and model.pos_embed.shape == (1, 1 + grid ** 2, 192)
    assert torch.equal(model.pos_embed[0, 0], small['sd']['encoder.pos_embedding'][0, 0])  # class token kept
    assert torch.isfinite(features(model, torch.randn(2, 3, img_size, img_size))).all()


def test_named_source_offline_message(tmp_path, monkeypatch):
    def offline(url, dst, progress=True):
        raise urllib.error.URLError('no network')
    monkeypatch.setattr(torch.hub, 'get_dir', lambda: str(tmp_path))
    monkeypatch.setattr(torch.hub, 'download_url_to_file', offline)
    for model, source, url in [(vit.vit_tiny_patch16(depth=1), 'in21k', vit.URLS['in21k'][192]),
                               (vit.vit_base_patch16(depth=1), 'sam', vit.URLS['sam']),
                               (vit.vit_base_patch16(depth=1), 'torchvision',
                                torchvision.models.ViT_B_16_Weights.IMAGENET1K_V1.url)]:
        with pytest.raises(vit.CheckpointError) as e:
            vit.load_pretrained(model, source)
        assert url in str(e.value) and '--weights PATH' in str(e.value)
        assert str(tmp_path / 'checkpoints' / url.rsplit('/', 1)[1]) in str(e.value)
    with pytest.raises(vit.CheckpointError, match="no 'dino' weights for a ViT with width 192"):
        vit.load_pretrained(vit.vit_tiny_patch16(depth=1), 'dino')
    assert vit.load_pretrained(vit.vit_tiny_patch16(depth=1), 'none')['loaded'] == 0


def test_named_source_downloads_into_the_hub_cache(small, tmp_path, monkeypatch):
    calls = []

    def fake_download(url, dst, progress=True):  # stands in for the network: "downloads" the small npz
        calls.append((url, dst, progress))
        shutil.copyfile(small['paths']['npz'], dst)
    monkeypatch.setattr(torch.hub, 'get_dir', lambda: str(tmp_path))
    monkeypatch.setattr(torch.hub, 'download_url_to_file', fake_download)
    for _ in range(2):  # the second call finds the cached file
        model = vit.vit_tiny_patch16(depth=2)
        report = vit.load_pretrained(model, 'in21k', verbose=False)
        assert (features(model, small['x']) - small['ref']).abs().max() <= 1e-5
    path = str(tmp_path / 'checkpoints' / vit.URLS['in21k'][192].rsplit('/', 1)[1])
    assert calls == [(vit.URLS['in21k'][192], path, True)] and report['path'] == path


def test_legacy_pickle_torch_file(small, tmp_path):
    torch.save(small['sd'], tmp_path / 'w.bin', _use_new_zipfile_serialization=False)
    model = vit.vit_tiny_patch16(depth=2)
    assert vit.load_pretrained(model, tmp_path / 'w.bin', verbose=False)['container'] == 'torch'
    assert (features(model, small['x']) - small['ref']).abs().max() <= 1e-5


# ===================================================================================================
# The data: data.py
# ===================================================================================================
MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
DEBIAN_FASHION = Path('/usr/share/datasets/fashion-mnist')


def test_task_classes_partition_and_errors():
    for classes, tasks in [(100, 10), (200, 20), (345, 5), (12, 3), (10, 5)]:
        split = data.task_classes(classes, tasks)
        flat = [c for task in split for c in task]
        assert len(split) == tasks and all(len(t) == classes // tasks for t in split)
        assert sorted(flat) == list(range(classes)) and len(set(flat)) == classes  # disjoint, covering
        assert split == data.task_classes(classes, tasks)
        assert all(t == list(range(t[0], t[0] + len(t))) for t in split)  # contiguous, natural order
    for classes, tasks in [(100, 7), (10, 0), (10, -2)]:
        with pytest.raises(data.DataError, match='divisor'):
            data.task_classes(classes, tasks)


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(data.DataError) as err:
        data.load_dataset('mnist', '.', 32, *MEAN_STD)
    assert all(name in str(err.value) for name in data.DATASETS)
    assert set(data.DATASETS) == {'cifar100', 'imagenet-r', 'domainnet', 'imagenet100', 'fashion-mnist', 'synthetic'}


def _raw(split):
    return torch.stack([split.source[i] for i in range(len(split))])


def test_synthetic_deterministic_shapes_disjoint():
    a = data.load_dataset('synthetic', None, 32, *MEAN_STD, seed=3)
    b = data.load_dataset('synthetic', None, 32, *MEAN_STD, seed=3)
    c = data.load_dataset('synthetic', None, 32, *MEAN_STD, seed=4)
    assert a.num_classes == 12 and len(a.class_names) == 12
    assert (len(a.train), len(a.test)) == (12 * 24, 12 * 8)
    x, y = a.train[5]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and isinstance(y, int)
    assert torch.equal(_raw(a.train), _raw(b.train)) and torch.equal(_raw(a.test), _raw(b.test))
    assert torch.equal(a.test[7][0], b.test[7][0])
    assert not torch.equal(_raw(a.train), _raw(c.train))
    assert sorted(set(a.train.targets)) == list(range(12)) and sorted(set(a.test.targets)) == list(range(12))
    train, test = _raw(a.train).flatten(1), _raw(a.test).flatten(1)
    assert not (train[:, None] == test[None]).all(-1).any()  # no test image is also a training image
    assert torch.equal(a.train_eval[3][0], a.train[3][0])  # synthetic: no augmentation, same images
    assert data.load_dataset('synthetic', None, 48, *MEAN_STD).train[0][0].shape == (3, 48, 48)


def test_limit_per_class_deterministic():
    full = data.load_dataset('synthetic', None, 16, *MEAN_STD)
    a = data.load_dataset('synthetic', None, 16, *MEAN_STD, limit_per_class=5)
    b = data.load_dataset('synthetic', None, 16, *MEAN_STD, limit_per_class=5)
    assert np.bincount(a.train.targets).tolist() == [5] * 12
    assert torch.equal(_raw(a.train), _raw(b.train)) and a.train.targets == b.train.targets
    assert len(a.train_eval) == len(a.train) and len(a.test) == len(full.test)  # test set untouched
    assert len(data.load_dataset('synthetic', None, 16, *MEAN_STD, limit_per_class=100).train) == len(full.train)
    kept = {tuple(t.flatten().tolist()) for t in _raw(a.train)}
    assert kept <= {tuple(t.flatten().tolist()) for t in _raw(full.train)}


def test_subset_and_loader():
    s = data.load_dataset('synthetic', None, 16, *MEAN_STD)
    part = data.subset(s.train, [4, 5, 6, 7])
    assert len(part) == 4 * 24 and set(part.targets) == {4, 5, 6, 7}
    assert [part[i][1] for i in range(len(part))] == part.targets
    loader = data.make_loader(part, 32, True, 0, seed=1)
    order = [y.tolist() for _, y in loader]
    assert order == [y.tolist() for _, y in data.make_loader(part, 32, True, 0, seed=1)]
    assert order != [y.tolist() for _, y in data.make_loader(part, 32, True, 0, seed=2)]
    x, y = next(iter(data.make_loader(part, 8, False, 0, seed=0)))
    assert x.shape == (8, 3, 16, 16) and y.dtype == torch.int64


class _Noisy(torch.utils.data.Dataset):
    """Stands in for a random augmentation: each item draws from torch's global generator."""
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.rand(3), i


def test_loader_draws_depend_on_the_seed_only():
    epochs = {}
    for workers in (0, 2):
        loader = data.make_loader(_Noisy(), 4, True, workers, seed=5)
        epochs[workers] = [[torch.cat([x, y[:, None].float()], 1) for x, y in loader] for _ in range(2)]
    for a, b in zip(sum(epochs[0], []), sum(epochs[2], [])):  # same order and draws, whatever the workers
        assert torch.equal(a, b)
    first, second = (torch.cat(e) for e in epochs[0])
    assert not torch.equal(first, second)  # each epoch: a new order and new draws
    assert sorted(first[:, 3].tolist()) == list(range(12))
    state = torch.get_rng_state()
    list(data.make_loader(_Noisy(), 4, True, 0, seed=5))  # loading in the main process ...
    assert torch.equal(state, torch.get_rng_state())  # ... leaves the run's generator where it was


def _write_idx(path, array):
    header = struct.pack(f'>I{array.ndim}I', 0x800 + array.ndim, *array.shape)  # uint8 data, ndim dims
    with gzip.open(path, 'wb') as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _fake_fashion(folder, n_train=40, n_test=20):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (('train', n_train), ('t10k', n_test)):
        _write_idx(folder / f'{prefix}-images-idx3-ubyte.gz', rng.integers(0, 256, (n, 28, 28)))
        _write_idx(folder / f'{prefix}-labels-idx1-ubyte.gz', np.arange(n) % 10)
    return folder


def test_fashion_mnist_from_written_idx(tmp_path):
    _fake_fashion(tmp_path)
    s = data.load_dataset('fashion-mnist', tmp_path, 32, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test), s.num_classes) == (40, 20, 10)
    assert s.class_names[9] == 'Ankle boot'
    x, y = s.test[13]
    assert x.shape == (3, 32, 32) and y == 3
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])  # grey copied to three channels
    # torchvision's own layout is found too
    s = data.load_dataset('fashion-mnist', _fake_fashion(tmp_path / 'tv' / 'FashionMNIST' / 'raw').parent.parent,
                          32, *MEAN_STD, download=False)
    assert len(s.train) == 40


def test_fashion_mnist_loader_repeats_augmented_batches(tmp_path):
    s = data.load_dataset('fashion-mnist', _fake_fashion(tmp_path), 32, *MEAN_STD, download=False)
    batches = [next(iter(data.make_loader(s.train, 16, True, 2, seed=7))) for _ in range(2)]
    assert torch.equal(batches[0][0], batches[1][0]) and torch.equal(batches[0][1], batches[1][1])
    other = next(iter(data.make_loader(s.train, 16, True, 2, seed=8)))
    assert not torch.equal(batches[0][0], other[0])


def test_fashion_mnist_corrupt_and_missing(tmp_path):
    _fake_fashion(tmp_path)
    path = tmp_path / 'train-images-idx3-ubyte.gz'
    with gzip.open(path) as f:
        raw = f.read()
    with gzip.open(path, 'wb') as f:
        f.write(raw[:-100])  # a valid gzip of a truncated idx file
    with pytest.raises(data.DataError, match='not a complete idx file'):
        data.load_dataset('fashion-mnist', tmp_path, 32, *MEAN_STD, download=False)
    path.write_bytes(gzip.compress(raw)[:200])  # a truncated gzip stream
    with pytest.raises(data.DataError, match='gzip'):
        data.load_dataset('fashion-mnist', tmp_path, 32, *MEAN_STD, download=False)
    path.unlink()
    with pytest.raises(data.DataError) as err:
        data.load_dataset('fashion-mnist', tmp_path, 32, *MEAN_STD, download=False)
    assert 'train-images-idx3-ubyte.gz' in str(err.value) and str(tmp_path) in str(err.value)
    assert '--data-dir' in str(err.value)


@pytest.mark.skipif(not (DEBIAN_FASHION / 'train-images-idx3-ubyte.gz').is_file(), reason='no dataset-fashion-mnist')
def test_fashion_mnist_debian():
    s = data.load_dataset('fashion-mnist', DEBIAN_FASHION, 224, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test)) == (60000, 10000)
    assert np.bincount(s.train.targets).tolist() == [6000] * 10
    assert s.test[0][0].shape == (3, 224, 224) and s.test[0][1] == 9  # the first test image is an ankle boot


def _fake_imagenet_r(root, per_class=5, classes=200):
    for c in range(classes):
        folder = root / 'imagenet-r' / f'n{c:08d}'
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.new('RGB', (8, 6), (c, i * 40, 0)).save(folder / f'{i}.png')


def test_imagenet_r_split(tmp_path):
    _fake_imagenet_r(tmp_path)
    a = data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD, download=False)
    assert (len(a.train), len(a.test), a.num_classes) == (800, 200, 200)
    assert np.bincount(a.test.targets).tolist() == [1] * 200  # 80/20 in every class
    assert set(a.train.source).isdisjoint(a.test.source)
    assert a.class_names == sorted(a.class_names)
    (tmp_path / 'imagenet-r' / '.ipynb_checkpoints').mkdir()  # hidden folders are no classes
    assert a.train[0][0].shape == (3, 32, 32) and a.test[0][0].shape == (3, 32, 32)
    split = json.loads((tmp_path / 'imagenet-r_split.json').read_text())
    assert (len(split['train']), len(split['test'])) == (800, 200)
    assert all(p.count('/') == 1 for p in split['train'])  # relative paths <wnid>/<file>
    b = data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD, download=False)
    assert a.train.source == b.train.source and a.test.targets == b.test.targets
    (tmp_path / 'imagenet-r_split.json').unlink()  # drawn again: the same split
    assert data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD).test.source == a.test.source
    split['train'], split['test'] = split['train'][1:], split['test'] + split['train'][:1]
    (tmp_path / 'imagenet-r_split.json').write_text(json.dumps(split))  # a saved split is reused
    assert len(data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD).test) == 201


def test_imagenet_r_missing(tmp_path):
    with pytest.raises(data.DataError) as err:
        data.load_dataset('imagenet-r', tmp_path / 'nothing', 32, *MEAN_STD, download=False)
    assert 'imagenet-r.tar' in str(err.value) and str(tmp_path / 'nothing') in str(err.value)
    assert '--data-dir' in str(err.value) and data.IMAGENET_R_URL in str(err.value)
    _fake_imagenet_r(tmp_path, per_class=1, classes=20)
    with pytest.raises(data.DataError, match='20 classes, not 200'):
        data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD)


def _fake_domainnet(root):
    """The twelve lists, and an empty file for every listed image (load_dataset checks they are there)."""
    for domain in data.DOMAINS:
        for part, n in (('train', 2), ('test', 1)):
            lines = [f'{domain}/class_{c:03d}/{domain}_{c}_{i}.jpg {c}' for c in range(345) for i in range(n)]
            (root / f'{domain}_{part}.txt').write_text('\n'.join(lines) + '\n')
            for line in lines:
                (root / line.split()[0]).parent.mkdir(parents=True, exist_ok=True)
                (root / line.split()[0]).touch()


def test_domainnet_lists(tmp_path):
    _fake_domainnet(tmp_path)
    Image.new('RGB', (10, 12)).save(tmp_path / 'real' / 'class_007' / 'real_7_0.jpg')
    s = data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test), s.num_classes) == (6 * 345 * 2, 6 * 345, 345)
    assert s.class_names[7] == 'class_007'
    i = s.test.source.index(str(tmp_path / 'real/class_007/real_7_0.jpg'))
    x, y = s.test[i]
    assert x.shape == (3, 32, 32) and y == 7
    assert [len(t) for t in data.task_classes(s.num_classes, data.DATASETS['domainnet']['tasks'])] == [69] * 5
    (tmp_path / 'sketch_test.txt').write_text('no label here\n')
    with pytest.raises(data.DataError, match='line 1'):
        data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD)
    (tmp_path / 'sketch_test.txt').unlink()
    with pytest.raises(data.DataError, match='sketch_test.txt'):
        data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD)


def test_domainnet_missing_image_and_foreign_list(tmp_path):
    _fake_domainnet(tmp_path)
    (tmp_path / 'painting' / 'class_100' / 'painting_100_0.jpg').unlink()  # listed in painting_test.txt
    with pytest.raises(data.DataError) as err:
        data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD, download=False)
    assert str(tmp_path / 'painting/class_100/painting_100_0.jpg') in str(err.value)
    assert 'missing' in str(err.value) and 'http://ai.bu.edu/M3SDA/' in str(err.value)
    (tmp_path / 'clipart_train.txt').write_bytes(b'\xff\xfe c\x00l\x00i\x00p\x00')  # UTF-16, say
    with pytest.raises(data.DataError, match='clipart_train.txt is not a text list .*fetch it again'):
        data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD, download=False)


@pytest.mark.parametrize('text', ['{"train": [', '[]', '"train"', '{"train": []}', '{"train": [1], "test": []}',
                                  '{"train": "n00000000/0.png", "test": []}', b'\xff{}'])
def test_imagenet_r_foreign_split_file(tmp_path, text):
    _fake_imagenet_r(tmp_path, classes=200)
    split_file = tmp_path / 'imagenet-r_split.json'
    split_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(data.DataError, match='imagenet-r_split.json is not a train/test split.*delete it to split'):
        data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD, download=False)


def test_imagenet_r_split_naming_missing_files(tmp_path):
    _fake_imagenet_r(tmp_path)
    data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD, download=False)  # writes the split
    split_file = tmp_path / 'imagenet-r_split.json'
    split = json.loads(split_file.read_text())
    (tmp_path / 'imagenet-r' / split['test'][0]).unlink()
    with pytest.raises(data.DataError) as err:
        data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD, download=False)
    assert str(tmp_path / 'imagenet-r' / split['test'][0]) in str(err.value)
    assert 'delete imagenet-r_split.json to split again' in str(err.value)
    split_file.unlink()  # as the message says: split again, from the files that are there
    assert len(data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD, download=False).train) == 799


def test_imagenet_r_truncated_tar_leaves_no_half_folder(tmp_path):
    _fake_imagenet_r(tmp_path / 'src')
    with tarfile.open(tmp_path / 'full.tar', 'w') as tar:
        tar.add(tmp_path / 'src' / 'imagenet-r', arcname='imagenet-r')
        cut = tar.getmembers()[600].offset_data + 3  # inside a file's data: tarfile cannot take it for the end
    (tmp_path / 'data').mkdir()
    (tmp_path / 'data' / 'imagenet-r.tar').write_bytes((tmp_path / 'full.tar').read_bytes()[:cut])
    for _ in range(2):  # the second run sees the same tar, not a half-unpacked folder
        with pytest.raises(data.DataError) as err:
            data.load_dataset('imagenet-r', tmp_path / 'data', 32, *MEAN_STD, download=False)
        assert str(tmp_path / 'data' / 'imagenet-r.tar') in str(err.value) and 'downloaded' not in str(err.value)
        assert 'delete it and fetch it again' in str(err.value) and data.IMAGENET_R_URL in str(err.value)
        assert [p.name for p in (tmp_path / 'data').iterdir()] == ['imagenet-r.tar']
    shutil.copy(tmp_path / 'full.tar', tmp_path / 'data' / 'imagenet-r.tar')  # fetched again
    assert len(data.load_dataset('imagenet-r', tmp_path / 'data', 32, *MEAN_STD, download=False).test) == 200
    assert sorted(p.name for p in (tmp_path / 'data').iterdir()) == ['imagenet-r', 'imagenet-r.tar',
                                                                    'imagenet-r_split.json']


def test_fashion_mnist_failed_download_leaves_no_empty_folders(tmp_path):
    # no_network makes torchvision's download fail after it made FashionMNIST/raw/
    for root in (tmp_path, tmp_path / 'new'):  # a folder that was there stays; one the download made goes
        with pytest.raises(data.DataError, match='could not be downloaded'):
            data.load_dataset('fashion-mnist', root, 32, *MEAN_STD, download=True)
        assert not (tmp_path / 'FashionMNIST').exists() and tmp_path.is_dir() and not any(tmp_path.iterdir())


def test_missing_folder_names_path_and_flag(tmp_path):
    for name in ('domainnet', 'imagenet100', 'fashion-mnist', 'cifar100', 'imagenet-r'):
        with pytest.raises(data.DataError) as err:
            data.load_dataset(name, tmp_path / 'absent', 32, *MEAN_STD, download=False)
        assert str(tmp_path / 'absent') in str(err.value) and '--data-dir' in str(err.value), name
    with pytest.raises(data.DataError, match='--data-dir'):
        data.load_dataset('cifar100', None, 32, *MEAN_STD)


def test_imagenet100_class_list(tmp_path):
    wnids = [f'n{c:08d}' for c in range(120)]
    for part in ('train', 'val'):
        for w in wnids:
            (tmp_path / part / w).mkdir(parents=True)
            Image.new('RGB', (4, 4)).save(tmp_path / part / w / 'a.JPEG')
    s = data.load_dataset('imagenet100', tmp_path, 32, *MEAN_STD, download=False)
    assert s.class_names == wnids[:100] and (len(s.train), len(s.test)) == (100, 100)
    (tmp_path / 'imagenet100_classes.txt').write_text('\n'.join(wnids[20:]) + '\n')
    s = data.load_dataset('imagenet100', tmp_path, 32, *MEAN_STD, download=False)
    assert s.class_names == wnids[20:] and s.test[0][0].shape == (3, 32, 32)


def test_cifar100_missing(tmp_path):
    with pytest.raises(data.DataError) as err:
        data.load_dataset('cifar100', tmp_path, 32, *MEAN_STD, download=False)
    msg = str(err.value)
    assert 'cifar-100-python.tar.gz' in msg and str(tmp_path) in msg and '--data-dir' in msg


def test_cifar100_corrupt_archive_is_named_not_downloaded_again(tmp_path):
    (tmp_path / 'cifar-100-python.tar.gz').write_bytes(b'half a download')
    with pytest.raises(data.DataError) as err:
        data.load_dataset('cifar100', tmp_path, 32, *MEAN_STD, download=True)
    msg = str(err.value)
    assert str(tmp_path / 'cifar-100-python.tar.gz') in msg and 'corrupt' in msg and 'delete it' in msg
    assert 'could not be downloaded' not in msg and torchvision.datasets.CIFAR100.url in msg


def test_cifar100_download_fails_cleanly_offline(tmp_path):
    # no_network (below the imports) makes the download fail as it does on a machine without a network
    with pytest.raises(data.DataError, match='could not be downloaded') as err:
        data.load_dataset('cifar100', tmp_path / 'data', 32, *MEAN_STD, download=True)
    assert torchvision.datasets.CIFAR100.url in str(err.value) and '--data-dir' in str(err.value)
    assert not (tmp_path / 'data').exists()  # the folder the failed download made is removed again


def test_imagenet_r_from_tar_and_ready_split(tmp_path):
    _fake_imagenet_r(tmp_path / 'src')
    with tarfile.open(tmp_path / 'imagenet-r.tar', 'w') as tar:
        tar.add(tmp_path / 'src' / 'imagenet-r', arcname='imagenet-r')
    s = data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD, download=False)  # unpacked, then split
    assert (len(s.train), len(s.test)) == (800, 200) and (tmp_path / 'imagenet-r' / 'n00000199').is_dir()
    (tmp_path / 'bad').mkdir()
    (tmp_path / 'bad' / 'imagenet-r.tar').write_bytes(b'not a tar')
    with pytest.raises(data.DataError, match='imagenet-r.tar could not be unpacked'):
        data.load_dataset('imagenet-r', tmp_path / 'bad', 32, *MEAN_STD, download=False)
    ready = tmp_path / 'ready' / 'imagenet-r'  # LAE's layout, as InfLoRA reads it: used as it is
    ready.mkdir(parents=True)
    (tmp_path / 'src' / 'imagenet-r').rename(ready / 'train')
    shutil.copytree(ready / 'train', ready / 'test')
    s = data.load_dataset('imagenet-r', tmp_path / 'ready', 32, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test)) == (1000, 1000) and not (tmp_path / 'ready' / 'imagenet-r_split.json').exists()


# ===================================================================================================
# The method and the program: janus_min.py
# ===================================================================================================
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def orthonormal(d, m, dtype=torch.float64, device="cpu", gen=None):
    return torch.linalg.qr(torch.randn(d, m, dtype=dtype, generator=gen).to(device)).Q


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ---------------------------------------------------------------------------------------------------
# Theorem 1
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_safe_gradient_is_the_constrained_optimum(device):
    g = torch.Generator().manual_seed(0)
    G = torch.randn(12, 20, dtype=torch.float64, generator=g).to(device)
    X_past = torch.randn(20, 5, dtype=torch.float64, generator=g).to(device)  # past activations, not orthonormal
    M = torch.linalg.qr(X_past).Q
    S = jm.safe_gradient(G, M)
    assert float((S @ M).abs().max()) < 1e-12  # feasible: the update leaves past outputs unchanged
    assert rel(jm.safe_gradient(S, M), S) < 1e-14  # idempotent
    # The paper's Lagrangian closed form (Appendix A): dW = G - G X (X^T X)^{-1} X^T.
    lagrange = G - G @ X_past @ torch.linalg.solve(X_past.T @ X_past, X_past.T)
    assert rel(S, lagrange) < 1e-12
    # No feasible point is closer to G: any D with D M = 0 is D = Y (I - M M^T).
    best = (G - S).norm()
    for _ in range(200):
        D = jm.safe_gradient(torch.randn(12, 20, dtype=torch.float64, generator=g).to(device) * 0.1 + S, M)
        assert (G - D).norm() >= best - 1e-12
    assert jm.safe_gradient(G, M[:, :0]) is G  # empty memory: unchanged


# ---------------------------------------------------------------------------------------------------
# Gradient Rectification
# ---------------------------------------------------------------------------------------------------
def _gr_problem(device, d_out=14, d_in=11, r=3, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = orthonormal(d_in, m, gen=g).to(device)
    G = torch.randn(d_out, d_in, dtype=torch.float64, generator=g).to(device)
    A = torch.randn(r, d_in, dtype=torch.float64, generator=g).to(device)
    B = torch.randn(d_out, r, dtype=torch.float64, generator=g).to(device)
    return G, M, A, B


@pytest.mark.parametrize("device", DEVICES)
def test_gr_is_the_tangent_space_projection(device):
    G, M, A, B = _gr_problem(device)
    s = 0.7
    Gs = jm.safe_gradient(G, M)
    dA, dB = jm.rectify(Gs, A, B, s, delta=1e-14)
    composite = s * (B @ dA + dB @ A)
    P_B = B @ torch.linalg.pinv(B)  # projector onto col(B)
    P_A = torch.linalg.pinv(A) @ A  # projector onto row(A)
    tangent = P_B @ Gs + Gs @ P_A - P_B @ Gs @ P_A
    assert rel(composite, tangent) < 1e-8
    assert float((dA @ M).abs().max()) < 1e-10 * float(dA.abs().max())  # rows of grad_A stay off span(M)
    # What violation is left is exactly (I - P_B) G_safe P_A M: zero once A's rows are orthogonal to M.
    I = torch.eye(B.shape[0], dtype=B.dtype, device=device)
    assert rel(composite @ M, (I - P_B) @ Gs @ P_A @ M) < 1e-8
    A_perp = jm.safe_gradient(A, M)
    dA, dB = jm.rectify(Gs, A_perp, B, s, delta=1e-14)
    assert float((s * (B @ dA + dB @ A_perp) @ M).norm()) < 1e-10 * float(Gs.norm())


def _joint_lstsq(Gs, A, B, s):
    """Eq. (5) written as one linear least-squares system in (dA, dB) and solved by LAPACK's gelsd, which
    returns the solution of least norm. -> (dA, dB, residual norm)."""
    (r, d_in), d_out = A.shape, B.shape[0]
    eye = lambda n: torch.eye(n, dtype=Gs.dtype, device=Gs.device)
    # Row-major vec(P X Q) = (P kron Q^T) vec(X): vec(s B dA) and vec(s dB A) side by side
    L = (s * torch.cat([torch.kron(B, eye(d_in)), torch.kron(eye(d_out), A.T.contiguous())], dim=1)).cpu()
    x = torch.linalg.lstsq(L, Gs.flatten().cpu()[:, None], driver="gelsd").solution.flatten()
    residual = (Gs.flatten().cpu() - L @ x).norm()
    return x[:r * d_in].reshape(r, d_in).to(Gs.device), x[r * d_in:].reshape(d_out, r).to(Gs.device), residual


@pytest.mark.parametrize("device", DEVICES)
def test_gr_attains_the_joint_least_squares_optimum(device):
    G, M, A, B = _gr_problem(device)
    s = 1.3
    Gs = jm.safe_gradient(G, M)
    dA, dB = jm.rectify(Gs, A, B, s, delta=1e-14)
    ours = (Gs - s * (B @ dA + dB @ A)).norm()
    optimum = _joint_lstsq(Gs, A, B, s)[2]
    assert abs(float(ours.cpu()) - float(optimum)) <= 1e-8 * float(Gs.norm())


@pytest.mark.parametrize("device", DEVICES)
def test_least_norm_split_is_the_minimum_norm_least_squares_solution(device):
    G, M, A, B = _gr_problem(device)
    s = 1.3
    Gs = jm.safe_gradient(G, M)
    hA, hB = jm.rectify(Gs, A, B, s, delta=1e-14)
    dA, dB = jm.least_norm_split(hA, hB, A, B)
    oA, oB, _ = _joint_lstsq(Gs, A, B, s)
    assert rel(dA, oA) < 1e-8 and rel(dB, oB) < 1e-8  # the oracle: gelsd's minimum-norm solution
    assert rel(B @ dA + dB @ A, B @ hA + hB @ A) < 1e-12  # the composite is untouched
    assert dA.norm() ** 2 + dB.norm() ** 2 < hA.norm() ** 2 + hB.norm() ** 2  # GR's own split is not the least
    assert rel(dA @ A.T, B.T @ dB) < 1e-10  # optimality of C: dA A^T = B^T dB
    for A_, B_ in [(A, torch.zeros_like(B)), (torch.zeros_like(A), torch.zeros_like(B)), (A[[0, 0, 1]], B[:, [0, 0, 2]])]:
        for dtype in (torch.float64, torch.float32):  # B = 0 starts every task; rank-deficient factors
            A_, B_, hA_, hB_ = (t.to(dtype) for t in (A_, B_, hA, hB))
            a, b = jm.least_norm_split(hA_, hB_, A_, B_)
            assert torch.isfinite(a).all() and torch.isfinite(b).all()
            composite = B_ @ hA_ + hB_ @ A_
            assert float((B_ @ a + b @ A_ - composite).abs().max()) <= 1e-5 * (1 + float(composite.abs().max()))


def test_violation_is_the_dense_relative_violation():
    torch.manual_seed(4)
    layer = vit.LoRALinear(24, 16, 4, 0.5)
    with torch.no_grad():
        layer.B.normal_()
    layer.memory = torch.linalg.qr(torch.randn(24, 6))[0]
    dW = (layer.scale * layer.B @ layer.A).detach()  # (d_out, d_in), formed densely here only
    expected = float((dW @ layer.memory).norm() / dW.norm())
    assert expected > 0.1 and abs(jm.violation(layer) - expected) < 1e-5 * expected
    layer.memory = torch.zeros(24, 0)
    assert jm.violation(layer) == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_gr_is_finite_for_zero_and_rank_deficient_factors(device):
    G, M, A, B = _gr_problem(device)
    for A_, B_ in [(A, torch.zeros_like(B)), (A, B * torch.tensor([1.0, 0.0, 0.0], dtype=B.dtype, device=device)),
                   (torch.zeros_like(A), B), (A[[0, 0, 1]], B)]:
        for dtype in (torch.float64, torch.float32):
            dA, dB = jm.rectify(G.to(dtype), A_.to(dtype), B_.to(dtype), 1.0)
            assert torch.isfinite(dA).all() and torch.isfinite(dB).all()
    dA, dB = jm.rectify(G, A, torch.zeros_like(B), 1.0)
    assert float(dA.abs().max()) == 0.0  # B = 0: no information about dA, so no step on A
    assert rel(dB @ A, G @ torch.linalg.pinv(A) @ A) < 1e-3  # and dB alone does G's share along row(A)


# ---------------------------------------------------------------------------------------------------
# The training-time path: LoRA forward with a memory + rectify_gradients_ == rectify(safe_gradient(G))
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_training_path_matches_dense_gr(device):
    torch.manual_seed(0)
    d_in, d_out, r, s = 24, 20, 4, 0.5
    layer = vit.LoRALinear(d_in, d_out, r, s).double().to(device)
    with torch.no_grad():
        layer.B.normal_()
        layer.A.normal_()  # A deliberately NOT orthogonal to M: the general case of `grad` mode
    M = orthonormal(d_in, 6, device=device)
    layer.memory = M
    x = torch.randn(7, 5, d_in, dtype=torch.float64, device=device)  # (B, N, d_in): all tokens count
    target = torch.randn(7, 5, d_out, dtype=torch.float64, device=device)
    F.mse_loss(layer(x), target).backward()
    # Oracle: G from autograd on the effective weight W = W0 + s B A.
    W = (layer.weight + s * layer.B @ layer.A).detach().requires_grad_()
    F.mse_loss(F.linear(x, W, layer.bias), target).backward()
    dA, dB = jm.rectify(jm.safe_gradient(W.grad, M), layer.A.detach(), layer.B.detach(), s)
    jm.rectify_gradients_([layer], delta=1e-4)
    assert rel(layer.A.grad, dA) < 1e-10 and rel(layer.B.grad, dB) < 1e-10


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_keeps_the_method_in_float32(device):
    """Under bf16 autocast (CUDA in training; CPU here too) the backbone computes in bf16, but the safe
    gradient, GR and OE stay in float32: A's gradient stays orthogonal to M to float32 round-off."""
    torch.manual_seed(0)
    model = vit.vit_tiny_patch16(img_size=32, patch_size=8).to(device)
    M = orthonormal(192, 40, dtype=torch.float32, device=device)
    for _, _, layer in model.lora_layers():
        layer.memory = M
        layer.reset_lora_()
        torch.nn.init.normal_(layer.B, std=0.02)
    with torch.autocast(device, dtype=torch.bfloat16):
        z, kv_inputs = model.encode(torch.randn(4, 3, 32, 32, device=device))
    assert kv_inputs[0].dtype == torch.bfloat16  # the one bf16 copy q, k, v and OE share
    z.float().pow(2).sum().backward()
    layers = [layer for _, _, layer in model.lora_layers()]
    for layer in layers:
        assert layer.A.grad.dtype == torch.float32
        assert float((layer.A.grad @ M).norm()) <= 1e-5 * float(layer.A.grad.norm())
    jm.rectify_gradients_(layers, 1e-4)
    sub = jm.OnlineSubspace(192, 8, device=device)
    sub.memory = M
    sub.basis = sub._fresh_basis()
    sub.update(kv_inputs[3].detach().flatten(0, 1))
    assert sub.basis.dtype == torch.float32 and float((M.T @ sub.basis).abs().max()) < 1e-5
    for layer in layers:
        assert torch.isfinite(layer.A.grad).all() and float((layer.A.grad @ M).norm()) <= 1e-5 * float(layer.A.grad.norm())


# ---------------------------------------------------------------------------------------------------
# Online Estimation
# ---------------------------------------------------------------------------------------------------
def _planted(d, k, gap, seed):
    g = torch.Generator().manual_seed(seed)
    Q = orthonormal(d, d, dtype=torch.float32, gen=g)
    sd = torch.cat([torch.full((k,), math.sqrt(gap)), torch.ones(d - k)])
    return Q, sd, g


def _sin_largest_angle(U, V):
    return float((1 - torch.linalg.svdvals(U.T @ V).min() ** 2).clamp_min(0).sqrt())


@pytest.mark.parametrize("device", DEVICES)
def test_oe_converges_to_the_planted_subspace(device):
    d, k, n = 64, 8, 64
    Q, sd, g = _planted(d, k, gap=10.0, seed=1)
    torch.manual_seed(0)
    sub = jm.OnlineSubspace(d, k, device=device)
    trace = {}
    for step in range(1, 2001):
        X = ((torch.randn(n, d, generator=g) * sd) @ Q.T).to(device)
        sub.update(X)
        V = sub.basis
        assert float((V.T @ V - torch.eye(k, device=device)).norm()) <= 1e-5
        if step in (10, 50, 200, 1000, 2000):
            trace[step] = _sin_largest_angle(Q[:, :k].to(device), V)
    print("OE sin(largest principal angle) vs updates:", trace)
    assert trace[2000] <= 0.05
    assert trace[2000] < trace[10]


def test_oe_captures_a_vit_tasks_activations_within_an_epoch():
    """On the K/V inputs of a ViT (random ViT-Ti, one synthetic task of 96 images, batches of 16 images and all
    their tokens, as in training), one epoch of OE updates (6) leaves a basis that captures nearly the
    energy of the best rank-k subspace: the top-k eigenvectors of all the task's activations (the oracle).
    These activations have one direction with most of the energy, where a scalar step overshoots."""
    torch.manual_seed(0)
    model = vit.vit_tiny_patch16(img_size=32, patch_size=8).eval()
    task = data.subset(data.load_dataset('synthetic', None, 32, 0.0, 1.0).train, [0, 1, 2, 3])
    k, subs, captured = 8, [jm.OnlineSubspace(192, 8) for _ in model.blocks], {}
    with torch.no_grad():
        X_all = [X.flatten(0, 1) for X in model.encode(torch.stack([task[i][0] for i in range(len(task))]))[1]]
        best = [torch.linalg.eigvalsh(X.T @ X)[-k:].sum() for X in X_all]  # (B*N, D) per block: the optimum
        for step, (images, _) in enumerate(data.make_loader(task, 16, True, 0, seed=0), 1):
            for sub, X in zip(subs, model.encode(images)[1]):
                sub.update(X.flatten(0, 1))  # (B, N, D) -> (B*N, D)
            captured[step] = [float((X @ sub.basis).pow(2).sum() / b) for sub, X, b in zip(subs, X_all, best)]
    print("OE energy captured / optimal, worst block, after each update of the epoch:",
          [round(min(c), 4) for c in captured.values()])
    assert len(captured) == 6 and min(captured[6]) >= 0.99


def test_oe_is_scale_free_and_merges_into_an_orthonormal_memory():
    d, k = 32, 4
    Q, sd, g = _planted(d, k, gap=8.0, seed=2)
    batches = [(torch.randn(40, d, generator=g) * sd) @ Q.T for _ in range(30)]
    subs = []
    for c in (1.0, 1000.0):
        torch.manual_seed(0)
        subs.append(jm.OnlineSubspace(d, k))
        for X in batches:
            subs[-1].update(X * c)
    assert float((subs[0].basis - subs[1].basis).abs().max()) < 1e-4  # same trajectory
    sub = subs[0]
    for _ in range(3):  # three tasks
        sub.merge()
        for X in batches:
            sub.update(X)
        M = sub.memory
        assert float((M.T @ M - torch.eye(M.shape[1])).abs().max()) < 1e-5
        assert float((M.T @ sub.basis).abs().max()) < 1e-5  # the next task's basis is off the memory
    sub.merge()
    assert sub.memory.shape[1] == 4 * k
    layer = vit.LoRALinear(d, 8, 2, 1.0)
    layer.memory = torch.linalg.qr(torch.randn(d, d)).Q
    layer.reset_lora_()
    assert float(layer.A.detach().abs().max()) == 0.0  # a full memory: an exact zero, not round-off for GR to amplify
    for _ in range(10):  # the memory never exceeds the width; a full memory leaves an empty basis
        sub.merge()
    assert sub.memory.shape[1] == d and sub.basis.shape[1] == 0
    sub.update(batches[0])


# ---------------------------------------------------------------------------------------------------
# Decoupled Margin Loss
# ---------------------------------------------------------------------------------------------------
def test_dml_terms():
    torch.manual_seed(0)
    z = torch.randn(16, 8)
    y = torch.randint(0, 3, (16,))
    # The intra-task term is the cross-entropy of cosine / tau against the batch's class prototypes.
    zn = F.normalize(z, dim=1)
    protos = F.normalize(torch.stack([zn[y == c].mean(0) for c in range(3)]), dim=1)
    expected = F.cross_entropy(zn @ protos.T / 0.07, y)
    assert abs(float(jm.dml_loss(z, y, torch.zeros(0, 8), 0.3, 0.07)) - float(expected)) < 1e-5
    # The inter-task hinge vanishes when every similarity is below the margin ...
    old = -protos  # far from every feature of its class
    sims = zn @ old.T
    m = float(sims.max()) + 0.01
    assert abs(float(jm.dml_loss(z, y, old, m, 0.07)) - float(jm.dml_loss(z, y, torch.zeros(0, 8), m, 0.07))) < 1e-6
    # ... and equals mean(max(0, s - m)) over batch x old prototypes otherwise.
    m = 0.0
    hinge = F.relu(sims - m).mean()
    assert abs(float(jm.dml_loss(z, y, old, m, 0.07)) - float(expected + hinge)) < 1e-5
    # One class in the batch and no old prototypes: finite (the intra term is then 0).
    one = jm.dml_loss(z[:4], torch.zeros(4, dtype=torch.long), torch.zeros(0, 8))
    assert torch.isfinite(one) and abs(float(one)) < 1e-6


def test_dml_pushes_a_violating_feature_away_from_an_old_prototype():
    p = F.normalize(torch.tensor([[1.0, 0.2, 0.0]]), dim=1)
    z = torch.tensor([[0.9, 0.3, 0.1], [0.1, 1.0, 0.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    before = float(F.normalize(z.detach(), dim=1)[0] @ p[0])
    assert before > 0.3
    jm.dml_loss(z, y, p, margin=0.3).backward()
    with torch.no_grad():
        after = float(F.normalize(z - 0.1 * z.grad, dim=1)[0] @ p[0])
    assert after < before


def test_metrics_on_a_hand_computed_matrix():
    acc = [[90.0, None, None], [80.0, 70.0, None], [60.0, 65.0, 50.0]]
    out = jm.metrics(acc)
    assert out["ACC"] == pytest.approx((60 + 65 + 50) / 3)
    assert out["MAA"] == pytest.approx((90 + (80 + 70) / 2 + (60 + 65 + 50) / 3) / 3)
    assert out["BWT"] == pytest.approx(((60 - 90) + (65 - 70)) / 2)


# ---------------------------------------------------------------------------------------------------
# One LoRA layer, two tasks: what OE, GR and the two places of rectification do to the violation
# ---------------------------------------------------------------------------------------------------
def _fit(layer, X, Y, steps, sub=None, gr=None, lr=1e-2, delta=1e-4):
    """Adam on one LoRA layer; gr in (None, 'grad', 'update'); sub: an OnlineSubspace to update."""
    opt = torch.optim.Adam([layer.A, layer.B], lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, X.shape[0], (64,), generator=g)
        if sub is not None:
            sub.update(X[idx])
        opt.zero_grad()
        F.mse_loss(layer(X[idx]), Y[idx]).backward()
        if gr == "grad":
            jm.rectify_gradients_([layer], delta)
        before = [(layer.A.detach().clone(), layer.B.detach().clone())]
        opt.step()
        if gr == "update":
            jm.rectify_updates_([layer], before, delta)


def test_two_task_violation_and_forgetting_of_the_four_variants(monkeypatch):
    torch.manual_seed(0)
    d_in, d_out, r, k = 32, 16, 4, 6
    U = orthonormal(d_in, d_in, dtype=torch.float32)
    U1, U2 = U[:, :k], U[:, k:2 * k]
    X1 = torch.randn(2048, k) @ U1.T * 2 + 0.05 * torch.randn(2048, d_in)  # task 1 lives in span(U1)
    X2 = torch.randn(2048, k) @ U1.T + torch.randn(2048, k) @ U2.T * 2  # task 2 overlaps it
    W1, W2 = torch.randn(d_out, d_in), torch.randn(d_out, d_in)
    Y1, Y2 = X1 @ W1.T, X2 @ W2.T

    layer = vit.LoRALinear(d_in, d_out, r, 1.0)
    sub = jm.OnlineSubspace(d_in, k)
    _fit(layer, X1, Y1, 300, sub=sub)
    layer.merge_()
    sub.merge()
    M = sub.memory
    assert _sin_largest_angle(U1, M) < 0.1  # OE found task 1's subspace
    with torch.no_grad():
        loss1, loss2 = float(F.mse_loss(layer(X1), Y1)), float(F.mse_loss(layer(X2), Y2))

    results = {}
    for name, oe, gr in [("all off", False, None), ("OE only", True, None), ("OE+GR grad", True, "grad"),
                         ("OE+GR update", True, "update"), ("update, GR's split", True, "update")]:
        if name == "update, GR's split":  # the update mode with Eqs. (6)-(7)'s own split, for comparison
            monkeypatch.setattr(jm, "least_norm_split", lambda dA, dB, A, B: (dA, dB))
        lay = copy.deepcopy(layer)
        torch.manual_seed(1)
        if oe:
            lay.memory = M
        lay.reset_lora_()  # fresh pair, A started off the memory when it is set (README, "LoRA lifecycle")
        _fit(lay, X2, Y2, 300, gr=gr)
        with torch.no_grad():
            dW = lay.scale * lay.B @ lay.A
            viol = float((dW @ M).norm() / dW.norm())
            forget = float(F.mse_loss(lay(X1), Y1)) - loss1
            learned = float(F.mse_loss(lay(X2), Y2))
            results[name] = (viol, forget, learned, float(lay.A.norm()), float(lay.B.norm()))
    for name, (viol, forget, learned, a, b) in results.items():
        print(f"{name:18s} violation {viol:.2e}  task-1 loss increase {forget:8.4f}  task-2 loss {learned:8.3f} "
              f"(before: {loss2:.3f})  ||A|| {a:7.2f}  ||B|| {b:6.3f}")
    assert results["OE+GR update"][0] <= 1e-3
    assert results["OE+GR grad"][0] < results["all off"][0]
    assert results["OE+GR update"][1] < results["all off"][1]
    # Low forgetting must not come from learning nothing: every variant cuts task 2's loss by 40% or more.
    assert all(learned <= 0.6 * loss2 for _, _, learned, _, _ in results.values())
    # The least-norm split keeps the factors of one size (measured ratio 1.0); GR's own split hands B's growth to A.
    a, b = results["OE+GR update"][3:]
    assert 0.25 <= a / b <= 4
    a, b = results["update, GR's split"][3:]
    assert a / b >= 100 and results["update, GR's split"][0] <= 1e-3  # same protection, lopsided factors


# ---------------------------------------------------------------------------------------------------
# The program: end to end, resume, determinism, bad input
# ---------------------------------------------------------------------------------------------------
TINY = ["--dataset", "synthetic", "--model", "vit_tiny", "--weights", "none", "--img-size", "32", "--patch-size", "8",
        "--tasks", "3", "--epochs", "2", "--batch-size", "16", "--k", "8", "--workers", "0", "--lr", "2e-3"]


def _results(folder):
    with open(folder / "results.json") as f:
        return json.load(f)


def test_end_to_end_on_synthetic_data(tmp_path, capsys):
    assert jm.main(TINY + ["--out", str(tmp_path / "run")]) == 0
    res = _results(tmp_path / "run")
    assert set(res) == {"config", "runs", "summary"}
    r = res["runs"][0]
    assert set(r) >= {"seed", "acc_matrix", "ACC", "MAA", "BWT", "task_seconds", "violation"}
    A = r["acc_matrix"]
    assert len(A) == 3 and all(len(row) == 3 for row in A)
    assert all(A[t][i] is None for t in range(3) for i in range(t + 1, 3))
    assert all(0 <= A[t][i] <= 100 for t in range(3) for i in range(t + 1))
    m = jm.metrics(A)
    assert r["ACC"] == pytest.approx(m["ACC"]) and r["MAA"] == pytest.approx(m["MAA"]) and r["BWT"] == pytest.approx(m["BWT"])
    assert r["ACC"] == pytest.approx(sum(A[2]) / 3)
    # Task-aware: the argmax over the true task's head only. It is right whenever the argmax over all seen
    # classes is, so it is never lower; with one head (row 1) the two are the same.
    aware = r["task_aware"]
    assert {k: aware[k] for k in ("ACC", "MAA", "BWT")} == pytest.approx(jm.metrics(aware["acc_matrix"]))
    assert all(aware["acc_matrix"][t][i] >= A[t][i] for t in range(3) for i in range(t + 1))
    assert aware["acc_matrix"][0][0] == A[0][0] and res["summary"]["task_aware"]["ACC"]["mean"] == pytest.approx(aware["ACC"])
    assert res["summary"]["ACC"]["mean"] == pytest.approx(r["ACC"])
    assert [len(v) for v in r["violation"]["k"]] == [12, 12, 12] and len(r["violation"]["v"]) == 3
    assert all(v == 0 for v in r["violation"]["k"][0])  # task 1: no memory yet
    assert len(r["task_seconds"]) == 3 and (tmp_path / "run" / "checkpoint.pt").exists()
    out = capsys.readouterr().out
    assert "task 3/3 epoch 2/2" in out and "img/s" in out and "ETA" in out and "ACC" in out


def test_the_loop_learns_each_task(tmp_path):
    # With 6 epochs every synthetic task is learned: measured diagonal 100, 100, 68.75 (seed 0, CPU).
    # Chance is 25% for task 1 (4 classes) and 1/12 over all 12 classes after task 3, so these bounds fail
    # when labels, heads or the optimizer are wired wrongly, with room for other torch versions' numerics.
    argv = [("6" if prev == "--epochs" else a) for prev, a in zip([None] + TINY, TINY)]
    assert jm.main(argv + ["--out", str(tmp_path / "run")]) == 0
    A = _results(tmp_path / "run")["runs"][0]["acc_matrix"]
    assert A[0][0] >= 90
    assert sum(A[t][t] for t in range(3)) / 3 >= 60


def test_plots_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")  # optional: without it the program prints a one-line note instead
    A = [[90.0, None], [80.0, 70.0]]
    viol = {"k": [[0.0, 0.0], [0.1, 0.2]], "v": [[0.0, 0.0], [0.3, 0.1]]}
    run = {"seed": 0, "acc_matrix": A, "task_aware": {"acc_matrix": [[90.0, None], [85.0, 75.0]]}, "violation": viol}
    jm.plot({"config": {"dataset": "synthetic"}, "runs": [run]}, str(tmp_path))
    for name in ("trajectory.png", "violation.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_gives_the_uninterrupted_result_and_runs_are_deterministic(tmp_path, monkeypatch):
    assert jm.main(TINY + ["--out", str(tmp_path / "a")]) == 0
    assert jm.main(TINY + ["--out", str(tmp_path / "c")]) == 0
    calls = {"n": 0}
    real_evaluate = jm.evaluate

    def interrupted(*args):  # Ctrl-C at the end of task 3, after task 2's checkpoint was written
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_evaluate(*args)

    monkeypatch.setattr(jm, "evaluate", interrupted)
    assert jm.main(TINY + ["--out", str(tmp_path / "b")]) == 130
    monkeypatch.setattr(jm, "evaluate", real_evaluate)
    assert not (tmp_path / "b" / "results.json").exists()
    assert len(torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["current"]["acc"]) == 2
    assert jm.main(TINY + ["--resume", str(tmp_path / "b")]) == 0
    a, b, c = (_results(tmp_path / x)["runs"][0] for x in "abc")
    for key in ("acc_matrix", "task_aware", "violation"):
        assert a[key] == c[key]  # determinism
        assert a[key] == b[key]  # resume equivalence


def _timm_state(model):
    """Our model's pretrained tensors in the timm layout (fused qkv, patch_embed.proj)."""
    sd = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] not in ("A", "B", "memory")}
    out = {}
    for k, v in sd.items():
        if ".attn.q." in k:
            stem, kind = k.split(".attn.q.")
            out[f"{stem}.attn.qkv.{kind}"] = torch.cat([sd[f"{stem}.attn.{n}.{kind}"] for n in "qkv"])
        elif ".attn.k." not in k and ".attn.v." not in k:
            out[k.replace("patch_embed.", "patch_embed.proj.")] = v
    return out


def _bad_inputs(tmp):
    (tmp / "empty").mkdir()
    (tmp / "junk.pth").write_bytes(b"this is not a checkpoint" * 10)
    torch.save(_timm_state(vit.vit_small_patch16(img_size=32)), tmp / "small.pth")  # ViT-S into a ViT-Ti
    (tmp / "trunc.pth").write_bytes((tmp / "small.pth").read_bytes()[:5000])
    (tmp / "noresume").mkdir()
    (tmp / "oldformat").mkdir()
    torch.save({"config": {}, "runs": [], "current": None}, tmp / "oldformat" / "checkpoint.pt")  # no "format"
    ckpt = [("16" if prev == "--patch-size" else a) for prev, a in zip([None] + TINY, TINY)]  # checkpoints are /16
    return [
        (["--dataset", "nope"], "invalid choice"),
        (["--model", "vit_huge"], "invalid choice"),
        (["--dataset", "cifar100", "--data-dir", str(tmp / "empty")], "--data-dir"),
        (["--dataset", "cifar100", "--data-dir", str(tmp / "absent")], "--data-dir"),
        (["--dataset", "fashion-mnist", "--data-dir", str(tmp / "missing")], "--data-dir"),
        (ckpt + ["--weights", str(tmp / "trunc.pth")], "trunc.pth"),
        (ckpt + ["--weights", str(tmp / "junk.pth")], "junk.pth"),
        (ckpt + ["--weights", str(tmp / "small.pth")], "does not fit this ViT"),
        (ckpt + ["--weights", str(tmp / "small.pth"), "--input-range", "checkpoint"], "--input-range half"),
        (TINY + ["--k", "0"], "--k"), (TINY + ["--k", "193"], "--k"), (TINY + ["--rank", "0"], "--rank"),
        (TINY + ["--tasks", "5"], "does not divide"), (TINY + ["--epochs", "0"], "--epochs"),
        (TINY + ["--batch-size", "0"], "--batch-size"), (TINY + ["--lr", "-1"], "--lr"),
        (TINY + ["--margin", "-0.1"], "--margin"), (TINY + ["--tau", "-1"], "--tau"),
        (TINY + ["--resume", str(tmp / "noresume")], "no checkpoint.pt"),
        (TINY + ["--resume", str(tmp / "oldformat")], "another version"),
        (TINY + ["--device", "cuda:7"] if torch.cuda.is_available() else TINY + ["--device", "cuda"], "cuda"),
        (TINY + ["--device", "tpu"], "--device"), (TINY + ["--delta", "0"], "--delta"),
        (TINY + ["--lambda-dml", "nan"], "finite"), (TINY + ["--lora-scale", "inf"], "finite"),
        (TINY + ["--lambda-dml", "-1"], "--lambda-dml"), (TINY + ["--patch-size", "0"], "--patch-size"),
        (TINY + ["--img-size", "-16"], "--img-size"), (TINY + ["--seeds", "99999999999999999999"], "--seeds"),
    ]


def test_bad_input_gets_one_clear_line_and_leaves_dir_alone(tmp_path, capsys):
    out = tmp_path / "previous"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for argv, needle in _bad_inputs(tmp_path):
        try:
            code = jm.main(argv + ["--out", str(out)])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        err = capsys.readouterr().err
        assert code == 2, argv
        lines = [l for l in err.strip().splitlines() if l]
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (argv, err)
        assert "Traceback" not in err
        assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "absent").exists()  # a failed download leaves no folder behind
    # A run into a folder that holds a run is refused; a resume with other flags too.
    assert jm.main(TINY + ["--out", str(tmp_path / "r")]) == 0
    assert jm.main(TINY + ["--out", str(tmp_path / "r")]) == 2 and "already holds a run" in capsys.readouterr().err
    assert jm.main(TINY + ["--resume", str(tmp_path / "r"), "--rank", "4"]) == 2
    assert "different configuration" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert jm.main(TINY + ["--out", str(tmp_path / "afile")]) == 2 and "is a file" in capsys.readouterr().err
    # A diverging run stops at the epoch's end with one line, not with a results.json of nonsense.
    assert jm.main(TINY + ["--lr", "1e30", "--out", str(tmp_path / "nan")]) == 2
    assert "the loss is nan" in capsys.readouterr().err and not (tmp_path / "nan" / "results.json").exists()


@pytest.mark.parametrize("flags, mean_std", [([], (0.0, 1.0)), (["--input-range", "checkpoint"], vit.MEAN_STD["half"]),
                                             (["--input-range", "checkpoint", "--weights", "dino"], vit.MEAN_STD["imagenet"]),
                                             (["--input-range", "imagenet"], vit.MEAN_STD["imagenet"])])
def test_input_range_reaches_the_data(monkeypatch, flags, mean_std):
    seen = []

    def load_dataset(name, data_dir, img_size, mean, std, **kw):
        seen.append((mean, std))
        raise data.DataError("stop here")
    monkeypatch.setattr(data, "load_dataset", load_dataset)
    argv = ["--dataset", "cifar100", "--model", "vit_base"] + flags
    assert jm.main(argv) == 2 and seen == [mean_std]


def test_safetensors_with_an_integer_tensor_names_it(small, tmp_path):
    sd = tv_to_timm(small['sd'])
    sd['pos_ids'] = torch.arange(197)
    write_safetensors(sd, tmp_path / 'w.safetensors')
    with pytest.raises(vit.CheckpointError, match=r'unexpected keys \(1\): pos_ids'):
        vit.load_pretrained(vit.vit_tiny_patch16(depth=2), tmp_path / 'w.safetensors', verbose=False)


def test_resume_of_a_finished_run_and_of_the_default_seeds(tmp_path, capsys):
    assert jm.main(TINY + ["--out", str(tmp_path / "r")]) == 0  # --seeds left at its default, 0
    before = _results(tmp_path / "r")
    assert jm.main(TINY + ["--seeds", "0", "--resume", str(tmp_path / "r")]) == 0  # the same seed, typed; all done
    after = _results(tmp_path / "r")
    assert after["runs"] == before["runs"] and after["summary"] == before["summary"]
    assert "ACC" in capsys.readouterr().out
