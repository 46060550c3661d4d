"""Property checks for Janus-LoRA minimal: each test asserts an identity, an oracle or a bound that
breaks when the code is wrong. CPU, random weights, files and data the tests write; the method's
checks also run on CUDA when present. Sections follow the files: vit.py, data.py, janus_min.py (the
method, then the program). Run: pytest -q
"""
import contextlib
import copy
import gzip
import io
import json
import os
import math
import pickle
import re
import shutil
import shlex
import signal
import socket
import struct
import subprocess
import sys
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

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every test runs offline: none may download a data set or a checkpoint."""
    def offline(*args, **kwargs):
        raise urllib.error.URLError('the tests run offline')
    monkeypatch.setattr(urllib.request, 'urlopen', offline)  # torchvision's dataset downloads
    monkeypatch.setattr(torch.hub, 'download_url_to_file', offline)  # vit.load_pretrained


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def rectify(G_safe, A, B, s, delta=1e-4):
    """Eqs. (6)-(7) for a dense G_safe (d_out, d_in): GR from the two products it needs."""
    return jm.rectify_factors(B.mT @ G_safe, G_safe @ A.mT, A, B, s, delta)


def orthonormal(d, m, dtype=torch.float64, device="cpu", gen=None):
    return torch.linalg.qr(torch.randn(d, m, dtype=dtype, generator=gen).to(device)).Q


# ==================================================================================================
# vit.py: the backbone, LoRA, checkpoint loading
# ==================================================================================================
_TV_TO_TIMM = [(r'^class_token$', 'cls_token'), (r'^encoder\.pos_embedding$', 'pos_embed'),
               (r'^conv_proj\.', 'patch_embed.proj.'), (r'^encoder\.ln\.', 'norm.'),
               (r'^heads\.head\.', 'head.'),
               (r'^encoder\.layers\.encoder_layer_(\d+)\.', r'blocks.\1.'),
               (r'\.ln_1\.', '.norm1.'), (r'\.ln_2\.', '.norm2.'),
               (r'\.self_attention\.in_proj_', '.attn.qkv.'),
               (r'\.self_attention\.out_proj\.', '.attn.proj.'), (r'\.mlp\.0\.', '.mlp.fc1.'),
               (r'\.mlp\.3\.', '.mlp.fc2.')]


def tv_to_timm(sd):
    """A torchvision state dict in the timm layout (fused qkv, patch_embed.proj)."""
    out = {}
    for k, v in sd.items():
        for pattern, repl in _TV_TO_TIMM:
            k = re.sub(pattern, repl, k)
        out[k] = v.clone()
    return out


def write_npz(sd, path, heads):
    """The public AugReg layout: HWIO conv kernel, (in, out) dense kernels, per-head q/k/v/out."""
    d = sd['class_token'].shape[-1]
    a = {'embedding/kernel': sd['conv_proj.weight'].permute(2, 3, 1, 0),
         'embedding/bias': sd['conv_proj.bias'], 'cls': sd['class_token'],
         'Transformer/posembed_input/pos_embedding': sd['encoder.pos_embedding'],
         'Transformer/encoder_norm/scale': sd['encoder.ln.weight'],
         'Transformer/encoder_norm/bias': sd['encoder.ln.bias'],
         'head/kernel': sd['heads.head.weight'].T, 'head/bias': sd['heads.head.bias']}
    i = 0
    while f'encoder.layers.encoder_layer_{i}.ln_1.weight' in sd:
        t, g = f'encoder.layers.encoder_layer_{i}.', f'Transformer/encoderblock_{i}/'
        m = g + 'MultiHeadDotProductAttention_1/'
        for ln, name in (('ln_1', 'LayerNorm_0'), ('ln_2', 'LayerNorm_2')):
            a[g + name + '/scale'] = sd[t + ln + '.weight']
            a[g + name + '/bias'] = sd[t + ln + '.bias']
        ws = sd[t + 'self_attention.in_proj_weight'].chunk(3)
        bs = sd[t + 'self_attention.in_proj_bias'].chunk(3)
        for name, w, b in zip(('query', 'key', 'value'), ws, bs):
            a[m + name + '/kernel'] = w.T.reshape(d, heads, d // heads)
            a[m + name + '/bias'] = b.reshape(heads, d // heads)
        out = sd[t + 'self_attention.out_proj.weight']
        a[m + 'out/kernel'] = out.T.reshape(heads, d // heads, d)
        a[m + 'out/bias'] = sd[t + 'self_attention.out_proj.bias']
        for n, j in ((0, 0), (1, 3)):
            a[f'{g}MlpBlock_3/Dense_{n}/kernel'] = sd[f'{t}mlp.{j}.weight'].T
            a[f'{g}MlpBlock_3/Dense_{n}/bias'] = sd[f'{t}mlp.{j}.bias']
        i += 1
    np.savez(path, **{k: v.numpy() for k, v in a.items()})


def write_safetensors(sd, path):
    names = {torch.float32: 'F32', torch.int64: 'I64'}
    header, blobs, offset = {'__metadata__': {'format': 'pt'}}, [], 0
    for k, v in sd.items():
        b = v.contiguous().numpy().tobytes()
        header[k] = {'dtype': names[v.dtype], 'shape': list(v.shape),
                     'data_offsets': [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b' ' * (-len(h) % 8)  # the format pads the header to 8 bytes
    with open(path, 'wb') as f:
        f.write(len(h).to_bytes(8, 'little') + h + b''.join(blobs))


def write_all(sd, d, heads):
    """One file per format from one torchvision state dict -> {format name: path}."""
    paths = {'torchvision': d / 'tv.pth', 'npz': d / 'w.npz', 'timm': d / 'timm.pth',
             'safetensors': d / 'w.st'}
    torch.save(sd, paths['torchvision'])
    write_npz(sd, paths['npz'], heads)
    torch.save(tv_to_timm(sd), paths['timm'])
    write_safetensors(tv_to_timm(sd), paths['safetensors'])
    return paths


def features(model, x):
    with torch.no_grad():
        return model.eval()(x)


def tv_features(model, x):
    model.heads = torch.nn.Identity()  # torchvision's forward then returns the normed class token
    return features(model, x)


@pytest.fixture(scope='module')
def vitb(tmp_path_factory):
    torch.manual_seed(0)
    tv = torchvision.models.vit_b_16().eval()
    sd = {k: v.clone() for k, v in tv.state_dict().items()}
    x = torch.randn(2, 3, 224, 224)
    ref = tv_features(tv, x)
    paths = write_all(sd, tmp_path_factory.mktemp('vitb'), heads=12)
    model = vit.vit_base_patch16()
    report = vit.load_pretrained(model, paths['torchvision'], verbose=False)
    return dict(x=x, ref=ref, paths=paths, model=model, report=report, z=features(model, x))


@pytest.fixture(scope='module')
def small(tmp_path_factory):
    """A 2-block Ti-width torchvision ViT and its files: for the error, resize and LoRA tests."""
    torch.manual_seed(1)
    tv = torchvision.models.VisionTransformer(224, 16, num_layers=2, num_heads=3, hidden_dim=192,
                                              mlp_dim=768).eval()
    sd = {k: v.clone() for k, v in tv.state_dict().items()}
    x = torch.randn(3, 3, 224, 224)
    return dict(sd=sd, x=x, ref=tv_features(tv, x),
                paths=write_all(sd, tmp_path_factory.mktemp('small'), heads=3))


def test_vit_b16_matches_torchvision(vitb):
    assert vitb['report']['format'] == 'torchvision' and vitb['report']['loaded'] == 198
    assert vitb['report']['ignored'] == ['heads.head.bias', 'heads.head.weight']
    assert (vitb['z'] - vitb['ref']).abs().max() <= 1e-4
    frozen = sum(p.numel() for n, p in vitb['model'].named_parameters() if not p.requires_grad)
    assert frozen == 85_798_656


@pytest.mark.parametrize('fmt', ['npz', 'timm', 'safetensors'])
def test_every_format_loads_the_same_weights(vitb, fmt):
    model = vit.vit_base_patch16()
    report = vit.load_pretrained(model, vitb['paths'][fmt], verbose=False)
    assert report['format'] == {'safetensors': 'timm'}.get(fmt, fmt) and report['loaded'] == 198
    head = ['head/bias', 'head/kernel'] if fmt == 'npz' else ['head.bias', 'head.weight']
    assert report['ignored'] == head
    assert (features(model, vitb['x']) - vitb['z']).abs().max() <= 1e-5


@pytest.mark.parametrize('wrap', ['model', 'state_dict', 'legacy_mlp', 'legacy_pickle'])
def test_wrapped_and_legacy_torch_files(small, tmp_path, wrap):
    sd, new_zip = small['sd'], wrap != 'legacy_pickle'
    if wrap == 'legacy_mlp':  # key names of torchvision's released ViT_B_16 file
        obj = {k.replace('mlp.0.', 'mlp.linear_1.').replace('mlp.3.', 'mlp.linear_2.'): v
               for k, v in sd.items()}
    else:
        obj = {wrap: sd, 'epoch': 3} if new_zip else sd
    torch.save(obj, tmp_path / 'w.pth', _use_new_zipfile_serialization=new_zip)
    model = vit.vit_tiny_patch16(depth=2)
    report = vit.load_pretrained(model, str(tmp_path / 'w.pth'), verbose=False)
    assert report['container'] == 'torch'
    assert (features(model, small['x']) - small['ref']).abs().max() <= 1e-5


def test_lora_lifecycle(small):
    """Loading leaves A, B alone; only A, B train; B = 0 changes nothing; merge keeps the output
    and starts a fresh pair with A off the memory."""
    torch.manual_seed(2)
    model = vit.vit_tiny_patch16(depth=2)
    ab = [p.detach().clone() for p in model.lora_parameters()]
    vit.load_pretrained(model, small['paths']['npz'], verbose=False)
    assert all(torch.equal(a, p) for a, p in zip(ab, model.lora_parameters()))
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in model.lora_parameters()}
    assert [(i, n) for i, n, _ in model.lora_layers()] == [(0, 'k'), (0, 'v'), (1, 'k'), (1, 'v')]
    for blk in model.blocks:
        assert type(blk.attn.q) is torch.nn.Linear and type(blk.attn.proj) is torch.nn.Linear
        assert isinstance(blk.attn.k, vit.LoRALinear) and isinstance(blk.attn.v, vit.LoRALinear)
    x = small['x']
    assert (features(model, x) - small['ref']).abs().max() <= 1e-5
    z, kv = model.encode(x)
    assert torch.equal(z, model(x)) and len(kv) == 2 and kv[0].shape == (3, 197, 192)
    memory = torch.linalg.qr(torch.randn(192, 20))[0]  # (d_in, m) orthonormal: block 1's
    memories = [torch.zeros(192, 0), memory]  # block 0 has none yet
    opt = torch.optim.Adam(model.lora_parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model.encode(x, memories)[0].pow(2).sum().backward()
        opt.step()
    before = features(model, x)
    assert (before - small['ref']).abs().max() > 1e-3  # the adapters did change the features
    assert (model.encode(x, memories)[0] - model(x)).abs().max() <= 1e-5  # the memory: same output
    params = model.lora_parameters()
    for i, _, layer in model.lora_layers():
        layer.merge_(memories[i])
    assert all(p is q for p, q in zip(params, model.lora_parameters()))
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
    assert all(layer.B.abs().max() == 0 for _, _, layer in model.lora_layers())
    assert (features(model, x) - before).abs().max() <= 1e-5
    for layer in (model.blocks[1].attn.k, model.blocks[1].attn.v):  # K and V share the memory
        assert (layer.A @ memory).abs().max() <= 1e-5


def test_merge_keeps_the_output_at_any_lora_scale():
    """merge_ folds s B A in with s itself: the layer's output is unchanged at s = 0.5."""
    torch.manual_seed(5)
    layer = vit.LoRALinear(12, 9, 3, 0.5)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(4, 12)
    before = layer(x).detach()
    layer.merge_()
    assert (layer(x) - before).abs().max() <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_lora_forward_gives_the_safe_gradient_of_theorem_1(device):
    """Theorem 1 through autograd (vit.LoRALinear.forward): the same output and input gradient,
    and factor gradients s B^T G_safe, s G_safe A^T; rectify_gradients_ then equals dense GR."""
    torch.manual_seed(3)
    d_in, d_out, r, s = 24, 20, 4, 0.7
    layer = vit.LoRALinear(d_in, d_out, r, s).double().to(device)
    with torch.no_grad():
        layer.B.normal_()
        layer.A.normal_()  # A deliberately NOT orthogonal to M: the general case
    M = orthonormal(d_in, 6, device=device)
    x = torch.randn(7, 5, d_in, dtype=torch.float64, device=device, requires_grad=True)
    upstream = torch.randn(7, 5, d_out, dtype=torch.float64, device=device)
    (layer(x, M) * upstream).sum().backward()
    W = (layer.weight + s * layer.B @ layer.A).detach().requires_grad_()  # dense W = W0 + s B A
    x_ref = x.detach().clone().requires_grad_()
    out_ref = F.linear(x_ref, W, layer.bias)
    (out_ref * upstream).sum().backward()
    G_safe = W.grad - W.grad @ M @ M.T
    assert torch.allclose(layer(x, M), out_ref, atol=1e-12)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    assert torch.allclose(layer.A.grad, s * layer.B.T @ G_safe, atol=1e-12)
    assert torch.allclose(layer.B.grad, s * G_safe @ layer.A.T, atol=1e-12)
    dA, dB = rectify(G_safe, layer.A.detach(), layer.B.detach(), s)
    jm.rectify_gradients_([layer], delta=1e-4)
    assert rel(layer.A.grad, dA) < 1e-10 and rel(layer.B.grad, dB) < 1e-10


def test_bad_checkpoints_fail_with_a_named_problem(vitb, small, tmp_path):
    wrong = r'width 384, 12 blocks.*shape mismatches.*class_token \(1, 1, 768\) vs cls_token'
    with pytest.raises(vit.CheckpointError, match=wrong):
        vit.load_pretrained(vit.vit_small_patch16(), vitb['paths']['torchvision'], verbose=False)
    tiny = lambda depth=2: vit.vit_tiny_patch16(depth=depth)
    sd = dict(small['sd'])
    del sd['encoder.layers.encoder_layer_1.ln_2.bias']
    torch.save(sd, tmp_path / 'missing.pth')
    with pytest.raises(vit.CheckpointError, match=r'missing keys \(1\): encoder\.layers\.encoder_'
                                                  r'layer_1\.ln_2\.bias;'):
        vit.load_pretrained(tiny(), tmp_path / 'missing.pth', verbose=False)
    torch.save({**small['sd'], 'encoder.extra': torch.zeros(1)}, tmp_path / 'extra.pth')
    with pytest.raises(vit.CheckpointError, match=r'unexpected keys \(1\): encoder\.extra;'):
        vit.load_pretrained(tiny(), tmp_path / 'extra.pth', verbose=False)
    with pytest.raises(vit.CheckpointError, match=r'missing keys \(16\): Transformer/encoderbl'):
        vit.load_pretrained(tiny(3), small['paths']['npz'], verbose=False)  # a third block
    for fmt, path in small['paths'].items():
        raw = path.read_bytes()
        (tmp_path / fmt).write_bytes(raw[:len(raw) // 2])
        with pytest.raises(vit.CheckpointError, match='truncated'):
            vit.load_pretrained(tiny(), tmp_path / fmt, verbose=False)
    (tmp_path / 'notes.txt').write_text('not a checkpoint\n')
    with pytest.raises(vit.CheckpointError, match='not a checkpoint'):
        vit.load_pretrained(tiny(), tmp_path / 'notes.txt', verbose=False)
    torch.save({'foo': torch.zeros(2)}, tmp_path / 'other.pth')
    with pytest.raises(vit.CheckpointError, match='no known ViT key layout'):
        vit.load_pretrained(tiny(), tmp_path / 'other.pth', verbose=False)
    with pytest.raises(vit.CheckpointError, match='no checkpoint file'):
        vit.load_pretrained(tiny(), tmp_path / 'absent.npz', verbose=False)
    sd = tv_to_timm(small['sd'])
    sd['pos_ids'] = torch.arange(197)  # an integer tensor is read, and named
    write_safetensors(sd, tmp_path / 'w.safetensors')
    with pytest.raises(vit.CheckpointError, match=r'unexpected keys \(1\): pos_ids'):
        vit.load_pretrained(tiny(), tmp_path / 'w.safetensors', verbose=False)


@pytest.mark.parametrize('img_size, grid', [(384, 24), (32, 2)])
def test_position_embedding_is_resized(small, img_size, grid):
    model = vit.vit_tiny_patch16(depth=2, img_size=img_size)
    report = vit.load_pretrained(model, small['paths']['timm'], verbose=False)
    assert report['resized'] == f'14x14 -> {grid}x{grid}'
    assert model.pos_embed.shape == (1, 1 + grid ** 2, 192)
    assert torch.equal(model.pos_embed[0, 0], small['sd']['encoder.pos_embedding'][0, 0])
    assert torch.isfinite(features(model, torch.randn(2, 3, img_size, img_size))).all()


def test_named_source_offline_message(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, 'get_dir', lambda: str(tmp_path))
    for model, source, url in [(vit.vit_tiny_patch16(depth=1), 'in21k', vit.URLS['in21k'][192]),
                               (vit.vit_base_patch16(depth=1), 'sam', vit.URLS['sam']),
                               (vit.vit_base_patch16(depth=1), 'torchvision',
                                torchvision.models.ViT_B_16_Weights.IMAGENET1K_V1.url)]:
        with pytest.raises(vit.CheckpointError) as e:
            vit.load_pretrained(model, source)
        assert url in str(e.value) and '--weights PATH' in str(e.value)
        assert '--weights none' in str(e.value)  # a quick try without the weights
        assert str(tmp_path / 'checkpoints' / url.rsplit('/', 1)[1]) in str(e.value)
    with pytest.raises(vit.CheckpointError, match="no 'dino' weights for a ViT with width 192"):
        vit.load_pretrained(vit.vit_tiny_patch16(depth=1), 'dino')
    assert vit.load_pretrained(vit.vit_tiny_patch16(depth=1), 'none')['loaded'] == 0


def test_named_source_downloads_into_the_hub_cache(small, tmp_path, monkeypatch):
    calls = []

    def fake_download(url, dst, progress=True):  # stands in for the network
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


# ==================================================================================================
# data.py: data sets, task splits, seeded loaders
# ==================================================================================================
MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
DEBIAN_FASHION = Path('/usr/share/datasets/fashion-mnist')


def test_task_classes_partition_and_errors():
    for classes, tasks in [(100, 10), (200, 20), (345, 5), (12, 3), (10, 5)]:
        split = data.task_classes(classes, tasks)
        flat = [c for task in split for c in task]
        assert len(split) == tasks and all(len(t) == classes // tasks for t in split)
        assert sorted(flat) == list(range(classes))  # disjoint, covering
        assert all(t == list(range(t[0], t[0] + len(t))) for t in split)  # contiguous, in order
    for classes, tasks in [(100, 7), (10, 0), (10, -2)]:
        with pytest.raises(data.DataError, match='divisor'):
            data.task_classes(classes, tasks)
    with pytest.raises(data.DataError, match='one class per task'):
        data.task_classes(10, 10)


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(data.DataError) as err:
        data.load_dataset('mnist', '.', 32, *MEAN_STD)
    assert all(name in str(err.value) for name in data.DATASETS)


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
    assert not torch.equal(_raw(a.train), _raw(c.train))
    assert sorted(set(a.train.targets)) == list(range(12)) == sorted(set(a.test.targets))
    train, test = _raw(a.train).flatten(1), _raw(a.test).flatten(1)
    assert not (train[:, None] == test[None]).all(-1).any()  # no test image is a training image
    assert torch.equal(a.train_eval[3][0], a.train[3][0])  # synthetic: no augmentation
    assert data.load_dataset('synthetic', None, 48, *MEAN_STD).train[0][0].shape == (3, 48, 48)


def test_limit_per_class_deterministic():
    full = data.load_dataset('synthetic', None, 16, *MEAN_STD)
    a = data.load_dataset('synthetic', None, 16, *MEAN_STD, limit_per_class=5)
    b = data.load_dataset('synthetic', None, 16, *MEAN_STD, limit_per_class=5)
    assert np.bincount(a.train.targets).tolist() == [5] * 12
    assert torch.equal(_raw(a.train), _raw(b.train)) and a.train.targets == b.train.targets
    assert len(a.train_eval) == len(a.train) and len(a.test) == len(full.test)  # test untouched
    big = data.load_dataset('synthetic', None, 16, *MEAN_STD, limit_per_class=100)
    assert len(big.train) == len(full.train)
    kept = {tuple(t.flatten().tolist()) for t in _raw(a.train)}
    assert kept <= {tuple(t.flatten().tolist()) for t in _raw(full.train)}


def test_subset_and_loader():
    s = data.load_dataset('synthetic', None, 16, *MEAN_STD)
    part = data.subset(s.train, [4, 5, 6, 7])
    assert len(part) == 4 * 24 and set(part.targets) == {4, 5, 6, 7}
    assert [part[i][1] for i in range(len(part))] == part.targets
    order = [y.tolist() for _, y in data.make_loader(part, 32, True, 0, seed=1)]
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
        epochs[workers] = [[torch.cat([x, y[:, None].float()], 1) for x, y in loader]
                           for _ in range(2)]
    for a, b in zip(sum(epochs[0], []), sum(epochs[2], [])):  # whatever the workers
        assert torch.equal(a, b)
    first, second = (torch.cat(e) for e in epochs[0])
    assert not torch.equal(first, second)  # each epoch: a new order and new draws
    assert sorted(first[:, 3].tolist()) == list(range(12))
    state = torch.get_rng_state()
    list(data.make_loader(_Noisy(), 4, True, 0, seed=5))  # loading in the main process ...
    assert torch.equal(state, torch.get_rng_state())  # ... leaves the run's generator alone


# The device-resident pipeline: on the CPU here, and on CUDA too where there is one
def _pipeline(source, spec, device, batch_size=64, train=True, seed=0):
    ds = data._Images(source, list(range(len(source))), None, spec)  # label i: image i
    return data.DeviceLoader(ds, batch_size, train, seed, torch.device(device))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('size', [48, 8])  # 8 px: most crops of the 20 x 24 image downsample
def test_resized_crops_are_torchvisions_resized_crops(device, size):
    """resized_crops equals torchvision's resized_crop (bilinear, antialiased), box by box."""
    gen = torch.Generator().manual_seed(0)
    x, boxes = torch.rand(64, 3, 20, 24, generator=gen), data.crop_boxes(gen, 64, 20, 24)
    boxes[0] = torch.tensor([0, 0, 20, 24])  # the whole image too
    no_flip = torch.zeros(64, dtype=torch.bool, device=device)
    out = data.resized_crops(x.to(device), boxes.to(device), size, no_flip).cpu()
    ref = torch.stack([torchvision.transforms.functional.resized_crop(
        img, *box.tolist(), [size, size], antialias=True) for img, box in zip(x, boxes)])
    # the same weights by another formula, summed in another order in float32: on values in
    # [0, 1] the round-off is ~1e-6 (2e-6 seen), a wrong weight or half-pixel shift ~1e-2
    assert float((out - ref).abs().max()) < 1e-5


def _ks(a, b):
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = a.double().sort().values, b.double().sort().values
    at = torch.cat([a, b])
    cdf = lambda s: torch.searchsorted(s, at, right=True) / len(s)
    return float((cdf(a) - cdf(b)).abs().max())


# on 4 x 40 px most draws fall back to torchvision's centre box of ratio 4/3: (0, 17, 4, 5)
@pytest.mark.parametrize('height, width, fallback', [(32, 32, None), (4, 40, [0, 17, 4, 5])])
def test_crop_boxes_follow_torchvisions_distribution(height, width, fallback):
    """crop_boxes draws as RandomResizedCrop.get_params: KS-close laws, the fallback as often."""
    n, m = 20000, 4000
    ours = data.crop_boxes(torch.Generator().manual_seed(1), n, height, width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        img = torch.zeros(1, height, width)
        theirs = torch.tensor([torchvision.transforms.RandomResizedCrop.get_params(
            img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(m)])  # (m, 4) top, left, h, w
    # KS critical value c sqrt(1/n + 1/m) = 0.034, c = sqrt(ln(2 / alpha) / 2) = 1.95 at alpha =
    # 1e-3; conservative for these discrete laws
    bound = 1.95 * math.sqrt(1 / n + 1 / m)
    laws = lambda b: [*b.double().T, b[:, 2] * b[:, 3], b[:, 3] / b[:, 2]]  # ..., area, aspect
    for a, b in zip(laws(ours), laws(theirs)):
        assert _ks(a, b) < bound
    if fallback:  # its share: a step of the CDFs, within the same bound
        share = [float((b == torch.tensor(fallback)).all(1).double().mean()) for b in
                 (ours, theirs)]
        assert share[1] > 0.5 and abs(share[0] - share[1]) < bound


@pytest.mark.parametrize('device', DEVICES)
def test_flips_are_fair_coins_and_exact_mirrors(device):
    """Each image comes back as it is or exactly mirrored, mirrored about half the time."""
    n, gen = 2000, torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (n, 3, 6, 6), dtype=torch.uint8, generator=gen)  # never symmetric
    mirrored = []
    for x, y in _pipeline(src, data.Batched(6, False, True, 0.0, 1.0), device, batch_size=500):
        x, plain = x.cpu(), src[y.cpu()].float() / 255  # (B, 3, 6, 6)
        # CUDA divides by 255 as a product with its reciprocal: a rounding apart, far below the
        # 1/255 by which a pixel of an image and of its mirror differ
        same, flipped = (((x - v).abs() < 1e-6).flatten(1).all(1) for v in (plain, plain.flip(-1)))
        assert (same ^ flipped).all()
        mirrored.append(flipped)
    # Binomial(2000, 1/2): standard deviation 0.011, five of them allowed
    assert abs(float(torch.cat(mirrored).double().mean()) - 0.5) < 5 * 0.5 / math.sqrt(n)


@pytest.mark.parametrize('device', DEVICES)
def test_pipeline_draws_depend_on_the_seed_only(device):
    """Batches come from the seed alone, new each epoch; eval: the set's order, unaugmented."""
    src = np.random.default_rng(0).integers(0, 256, (30, 12, 12, 3), dtype=np.uint8)  # CIFAR's
    train, test = data.Batched(16, True, True, *MEAN_STD), data.Batched(16, False, False, *MEAN_STD)
    make = lambda seed, spec=train: _pipeline(src, spec, device, 8, spec is train, seed)
    epoch = lambda batches: [torch.cat(t).cpu() for t in zip(*batches)]  # [images, labels]
    same = lambda u, v: all(torch.equal(p, q) for p, q in zip(u, v))
    state, a = torch.get_rng_state(), make(5)
    batches = list(a)
    assert len(a) == 4 and [len(y) for _, y in batches] == [8, 8, 8, 6]
    first, second = epoch(batches), epoch(a)
    assert same(first, epoch(make(5))) and not same(first, epoch(make(6)))
    assert not same(first, second)  # each epoch: a new order and new crops
    assert sorted(first[1].tolist()) == list(range(30))
    assert torch.equal(state, torch.get_rng_state())  # the loader draws from its own generator
    x, y = epoch(make(5, test))
    assert y.tolist() == list(range(30)) and same([x], epoch(make(6, test)))


@pytest.mark.parametrize('device', DEVICES)
def test_identity_box_gives_the_normalised_image(device):
    """No crop, at the source's size: (x / 255 - mean) / std, from colour or grey uint8 arrays."""
    mean, std = (0.1, 0.4, 0.7), (0.2, 0.5, 2.0)
    spec, rng = data.Batched(9, False, False, mean, std), np.random.default_rng(0)
    cifar = rng.integers(0, 256, (5, 9, 9, 3), dtype=np.uint8)  # (N, H, W, 3)
    grey = rng.integers(0, 256, (5, 9, 9), dtype=np.uint8)  # (N, H, W)
    for src, chw in [(cifar, torch.from_numpy(cifar).permute(0, 3, 1, 2)),
                     (grey, torch.from_numpy(grey)[:, None].expand(-1, 3, -1, -1))]:
        x, _ = next(iter(_pipeline(src, spec, device, train=False)))
        m, s = (torch.tensor(v, device=device).view(3, 1, 1) for v in (mean, std))
        assert torch.equal(x, (chw.to(device).float() / 255 - m) / s)  # weights 0 and 1: exact


def _write_idx(path, array):
    header = struct.pack(f'>I{array.ndim}I', 0x800 + array.ndim, *array.shape)  # uint8 data
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
    s = data.load_dataset('fashion-mnist', _fake_fashion(tmp_path), 32, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test), s.num_classes) == (40, 20, 10)
    assert s.class_names[9] == 'Ankle boot'
    x, y = s.test[13]
    assert x.shape == (3, 32, 32) and y == 3
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])  # grey copied to three channels
    tv_layout = _fake_fashion(tmp_path / 'tv' / 'FashionMNIST' / 'raw').parent.parent
    assert len(data.load_dataset('fashion-mnist', tv_layout, 32, *MEAN_STD).train) == 40
    for f in _fake_fashion(tmp_path / 'unpacked').iterdir():  # idx files as gunzip leaves them
        f.with_suffix('').write_bytes(gzip.decompress(f.read_bytes()))
        f.unlink()
    unpacked = data.load_dataset('fashion-mnist', tmp_path / 'unpacked', 32, *MEAN_STD)
    assert torch.equal(unpacked.test[13][0], x)
    batches = [next(iter(data.make_loader(s.train, 16, True, 2, seed=7))) for _ in range(2)]
    assert torch.equal(batches[0][0], batches[1][0]) and torch.equal(batches[0][1], batches[1][1])
    assert not torch.equal(batches[0][0], next(iter(data.make_loader(s.train, 16, True, 2, 8)))[0])


def test_pipeline_through_load_dataset_and_subset(tmp_path):
    """On loaded sets' subsets: synthetic as the worker loader gives it, Fashion-MNIST resized."""
    s = data.load_dataset('synthetic', None, 16, *MEAN_STD)
    by_workers = data._Images(s.test.source, s.test.targets, s.test.transform)  # no batched spec
    loaders = [data.make_loader(data.subset(ds, [2, 3, 4]), 8, False, 0, seed=0)
               for ds in (s.test, by_workers)]
    assert isinstance(loaders[0], data.DeviceLoader) and len(loaders[0]) == len(loaders[1]) == 3
    for (x, y), (u, v) in zip(*loaders):
        assert torch.equal(x, u) and torch.equal(y, v)
    f = data.load_dataset('fashion-mnist', _fake_fashion(tmp_path), 32, *MEAN_STD, download=False)
    grey = torch.from_numpy(f.train.source.copy()).float()[:, None] / 255  # (40, 1, 28, 28)
    ref = (torchvision.transforms.functional.resize(grey, [32, 32], antialias=True) - 0.5) / 0.5
    x, y = next(iter(data.make_loader(f.train_eval, 40, False, 0, seed=0)))  # test transform
    # the crop test's round-off, doubled by the division by std 0.5
    assert x.shape == (40, 3, 32, 32) and y.tolist() == f.train.targets
    assert float((x - ref).abs().max()) < 2e-5
    unit = data.load_dataset('fashion-mnist', tmp_path, 32, 0.0, 1.0)  # a scalar mean and std
    assert next(iter(data.make_loader(unit.train, 8, True, 0, seed=0)))[0].shape == (8, 3, 32, 32)
    x, y = next(iter(data.make_loader(f.train, 40, True, 0, seed=0)))  # resize and flip, no crop
    gap = (x[:, None] - torch.cat([ref, ref.flip(-1)])).abs().flatten(2).amax(2)  # (40, 80)
    assert float(gap.min(1).values.max()) < 2e-5
    assert torch.equal(torch.tensor(f.train.targets * 2)[gap.argmin(1)], y)


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


@pytest.mark.skipif(not (DEBIAN_FASHION / 'train-images-idx3-ubyte.gz').is_file(),
                    reason='no dataset-fashion-mnist')
def test_fashion_mnist_debian():
    s = data.load_dataset('fashion-mnist', DEBIAN_FASHION, 224, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test)) == (60000, 10000)
    assert np.bincount(s.train.targets).tolist() == [6000] * 10
    assert s.test[0][0].shape == (3, 224, 224) and s.test[0][1] == 9  # an ankle boot


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
    assert set(a.train.source).isdisjoint(a.test.source) and a.class_names == sorted(a.class_names)
    (tmp_path / 'imagenet-r' / '.ipynb_checkpoints').mkdir()  # hidden folders are no classes
    assert a.train[0][0].shape == (3, 32, 32) and a.test[0][0].shape == (3, 32, 32)
    loader = data.make_loader(a.train, 8, True, 0, seed=0, device='cpu')
    assert isinstance(loader, torch.utils.data.DataLoader)  # files: the worker loader, always
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


def test_imagenet_r_missing_and_incomplete(tmp_path):
    with pytest.raises(data.DataError) as err:
        data.load_dataset('imagenet-r', tmp_path / 'nothing', 32, *MEAN_STD, download=False)
    assert 'imagenet-r.tar' in str(err.value) and str(tmp_path / 'nothing') in str(err.value)
    assert '--data-dir' in str(err.value) and data.IMAGENET_R_URL in str(err.value)
    _fake_imagenet_r(tmp_path, per_class=1, classes=20)
    with pytest.raises(data.DataError, match='20 classes, not 200'):
        data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD)


@pytest.mark.parametrize('text', ['{"train": [', '[]', '"train"', '{"train": []}',
                                  '{"train": [1], "test": []}', b'\xff{}',
                                  '{"train": "n00000000/0.png", "test": []}'])
def test_imagenet_r_foreign_split_file(tmp_path, text):
    _fake_imagenet_r(tmp_path, classes=200)
    split_file = tmp_path / 'imagenet-r_split.json'
    split_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(data.DataError, match='imagenet-r_split.json is not a train/test split.*'
                                             'delete it to split'):
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
    assert len(data.load_dataset('imagenet-r', tmp_path, 32, *MEAN_STD).train) == 799


def test_imagenet_r_tar_truncated_bad_and_ready_split(tmp_path):
    _fake_imagenet_r(tmp_path / 'src')
    with tarfile.open(tmp_path / 'full.tar', 'w') as tar:
        tar.add(tmp_path / 'src' / 'imagenet-r', arcname='imagenet-r')
        cut = tar.getmembers()[600].offset_data + 3  # inside a file's data, not at an end
    (tmp_path / 'data').mkdir()
    (tmp_path / 'data' / 'imagenet-r.tar').write_bytes((tmp_path / 'full.tar').read_bytes()[:cut])
    for _ in range(2):  # the second run sees the same tar, not a half-unpacked folder
        with pytest.raises(data.DataError) as err:
            data.load_dataset('imagenet-r', tmp_path / 'data', 32, *MEAN_STD, download=False)
        assert str(tmp_path / 'data' / 'imagenet-r.tar') in str(err.value)
        assert 'delete it and fetch it again' in str(err.value)
        assert 'downloaded' not in str(err.value)
        assert [p.name for p in (tmp_path / 'data').iterdir()] == ['imagenet-r.tar']
    shutil.copy(tmp_path / 'full.tar', tmp_path / 'data' / 'imagenet-r.tar')  # fetched again
    s = data.load_dataset('imagenet-r', tmp_path / 'data', 32, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test)) == (800, 200)
    assert sorted(p.name for p in (tmp_path / 'data').iterdir()) == [
        'imagenet-r', 'imagenet-r.tar', 'imagenet-r_split.json']
    (tmp_path / 'bad').mkdir()
    (tmp_path / 'bad' / 'imagenet-r.tar').write_bytes(b'not a tar')
    with pytest.raises(data.DataError, match='imagenet-r.tar could not be unpacked'):
        data.load_dataset('imagenet-r', tmp_path / 'bad', 32, *MEAN_STD, download=False)
    ready = tmp_path / 'ready' / 'imagenet-r'  # LAE's layout, as InfLoRA reads it: used as it is
    ready.mkdir(parents=True)
    (tmp_path / 'src' / 'imagenet-r').rename(ready / 'train')
    shutil.copytree(ready / 'train', ready / 'test')
    s = data.load_dataset('imagenet-r', tmp_path / 'ready', 32, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test)) == (1000, 1000)
    assert not (tmp_path / 'ready' / 'imagenet-r_split.json').exists()


def _fake_domainnet(root):
    """The twelve lists, and an empty file for every listed image (they are checked)."""
    for domain in data.DOMAINS:
        for part, n in (('train', 2), ('test', 1)):
            lines = [f'{domain}/class_{c:03d}/{domain}_{c}_{i}.jpg {c}'
                     for c in range(345) for i in range(n)]
            (root / f'{domain}_{part}.txt').write_text('\n'.join(lines) + '\n')
            for line in lines:
                (root / line.split()[0]).parent.mkdir(parents=True, exist_ok=True)
                (root / line.split()[0]).touch()


def test_domainnet_lists_and_their_faults(tmp_path):
    _fake_domainnet(tmp_path)
    Image.new('RGB', (10, 12)).save(tmp_path / 'real' / 'class_007' / 'real_7_0.jpg')
    s = data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD, download=False)
    assert (len(s.train), len(s.test), s.num_classes) == (6 * 345 * 2, 6 * 345, 345)
    assert s.class_names[7] == 'class_007'
    x, y = s.test[s.test.source.index(str(tmp_path / 'real/class_007/real_7_0.jpg'))]
    assert x.shape == (3, 32, 32) and y == 7
    (tmp_path / 'painting' / 'class_100' / 'painting_100_0.jpg').unlink()  # listed, missing
    with pytest.raises(data.DataError) as err:
        data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD, download=False)
    assert str(tmp_path / 'painting/class_100/painting_100_0.jpg') in str(err.value)
    assert 'missing' in str(err.value) and 'http://ai.bu.edu/M3SDA/' in str(err.value)
    (tmp_path / 'clipart_train.txt').write_bytes(b'\xff\xfe c\x00l\x00i\x00p\x00')  # UTF-16
    with pytest.raises(data.DataError, match='clipart_train.txt is not a UTF-8 text list'):
        data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD, download=False)
    (tmp_path / 'sketch_test.txt').write_text('no label here\n')
    (tmp_path / 'clipart_train.txt').unlink()
    with pytest.raises(data.DataError, match='clipart_train.txt'):
        data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD)
    _fake_domainnet(tmp_path)
    (tmp_path / 'sketch_test.txt').write_text('no label here\n')
    with pytest.raises(data.DataError, match='line 1'):
        data.load_dataset('domainnet', tmp_path, 32, *MEAN_STD)


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


@pytest.mark.parametrize('name', ['domainnet', 'imagenet100', 'fashion-mnist', 'cifar100',
                                  'imagenet-r'])
def test_missing_folder_names_path_and_flag(tmp_path, name):
    with pytest.raises(data.DataError) as err:
        data.load_dataset(name, tmp_path / 'absent', 32, *MEAN_STD, download=False)
    assert str(tmp_path / 'absent') in str(err.value) and '--data-dir' in str(err.value)


def write_cifar100(root, train_hwc, train_y, test_hwc, test_y):
    """A cifar-100-python folder in torchvision's pickled format, from (N, 32, 32, 3) uint8 arrays;
    the GPU check of the main job writes its generated CIFAR-100 with this too."""
    folder = Path(root) / 'cifar-100-python'
    folder.mkdir(parents=True, exist_ok=True)
    for name, x, y in (('train', train_hwc, train_y), ('test', test_hwc, test_y)):
        rows = np.ascontiguousarray(x.transpose(0, 3, 1, 2)).reshape(len(x), -1)  # (N, 3072)
        entry = {'data': rows, 'fine_labels': [int(c) for c in y], 'coarse_labels': [0] * len(y)}
        (folder / name).write_bytes(pickle.dumps(entry))
    names = [f'class{c}' for c in range(100)]
    (folder / 'meta').write_bytes(pickle.dumps({'fine_label_names': names}))
    return folder


def test_cifar100_reads_the_pickled_folder_without_its_md5(tmp_path):
    """A copy in torchvision's format that is not the official one (its MD5 differs) loads, pixel
    for pixel; a truncated file gets a DataError that names the folder."""
    rng = np.random.default_rng(0)
    train, test = (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8) for n in (200, 100))
    folder = write_cifar100(tmp_path, train, np.arange(200) % 100, test, np.arange(100))
    splits = data.load_dataset('cifar100', tmp_path, 32, *MEAN_STD, download=False)
    assert np.array_equal(splits.train.source, train) and np.array_equal(splits.test.source, test)
    assert splits.train.targets == [c % 100 for c in range(200)] and splits.num_classes == 100
    assert splits.class_names[7] == 'class7'
    (folder / 'train').write_bytes((folder / 'train').read_bytes()[:1000])
    with pytest.raises(data.DataError, match='cannot be read as CIFAR-100') as err:
        data.load_dataset('cifar100', tmp_path, 32, *MEAN_STD, download=False)
    assert str(folder) in str(err.value)


def test_cifar100_missing_corrupt_and_offline(tmp_path):
    with pytest.raises(data.DataError, match='--data-dir'):
        data.load_dataset('cifar100', None, 32, *MEAN_STD)
    with pytest.raises(data.DataError, match='could not be downloaded') as err:
        data.load_dataset('cifar100', tmp_path / 'data', 32, *MEAN_STD, download=True)
    assert torchvision.datasets.CIFAR100.url in str(err.value) and '--data-dir' in str(err.value)
    assert not (tmp_path / 'data').exists()  # the folder the failed download made is removed
    (tmp_path / 'cifar-100-python.tar.gz').write_bytes(b'half a download')
    with pytest.raises(data.DataError) as err:
        data.load_dataset('cifar100', tmp_path, 32, *MEAN_STD, download=True)
    msg = str(err.value)
    assert str(tmp_path / 'cifar-100-python.tar.gz') in msg and 'corrupt' in msg
    assert 'delete it' in msg
    assert 'could not be downloaded' not in msg and torchvision.datasets.CIFAR100.url in msg


def test_fashion_mnist_failed_download_leaves_no_empty_folders(tmp_path):
    for root in (tmp_path, tmp_path / 'new'):  # a folder that was there stays; a new one goes
        with pytest.raises(data.DataError, match='could not be downloaded'):
            data.load_dataset('fashion-mnist', root, 32, *MEAN_STD, download=True)
        assert not (tmp_path / 'FashionMNIST').exists() and not any(tmp_path.iterdir())


# ==================================================================================================
# janus_min.py, the method: Theorem 1, GR, OE, DML, metrics, and our --rectify update
# ==================================================================================================
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d_out", [20, 12])  # square, so that a projection on the wrong side runs
def test_safe_gradient_is_the_constrained_optimum(device, d_out):
    """G (I - M M^T) is feasible (dW X_past = 0), equals the Lagrangian closed form, and no
    feasible point is closer to G."""
    g = torch.Generator().manual_seed(0)
    G = torch.randn(d_out, 20, dtype=torch.float64, generator=g).to(device)
    X_past = torch.randn(20, 5, dtype=torch.float64, generator=g).to(device)  # not orthonormal
    S = jm.safe_gradient(G, torch.linalg.qr(X_past).Q)
    assert float((S @ X_past).abs().max()) < 1e-12
    lagrange = G - G @ X_past @ torch.linalg.solve(X_past.T @ X_past, X_past.T)  # Appendix A
    assert rel(S, lagrange) < 1e-12
    null = torch.linalg.svd(X_past).U[:, 5:]  # (20, 15): the feasible set is {Y null null^T}
    for _ in range(200):
        D = torch.randn(d_out, 15, dtype=torch.float64, generator=g).to(device) @ null.T
        D = D * 0.1 + S
        assert float((D @ X_past).abs().max()) < 1e-12 and (G - D).norm() >= (G - S).norm() - 1e-12
    assert jm.safe_gradient(G, X_past[:, :0]) is G  # empty memory: unchanged


def _gr_problem(device, d_out=14, d_in=11, r=3, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = orthonormal(d_in, m, gen=g).to(device)
    G = torch.randn(d_out, d_in, dtype=torch.float64, generator=g).to(device)
    A = torch.randn(r, d_in, dtype=torch.float64, generator=g).to(device)
    B = torch.randn(d_out, r, dtype=torch.float64, generator=g).to(device)
    return G, M, A, B


@pytest.mark.parametrize("device", DEVICES)
def test_gr_is_the_tangent_space_projection(device):
    """s (B dA + dB A) = P_B G + G P_A - P_B G P_A; the violation left is (I - P_B) G_safe P_A M."""
    G, M, A, B = _gr_problem(device)
    s = 0.7
    Gs = jm.safe_gradient(G, M)
    dA, dB = rectify(Gs, A, B, s, delta=1e-14)
    composite = s * (B @ dA + dB @ A)
    P_B, P_A = B @ torch.linalg.pinv(B), torch.linalg.pinv(A) @ A
    assert rel(composite, P_B @ Gs + Gs @ P_A - P_B @ Gs @ P_A) < 1e-8
    assert float((dA @ M).abs().max()) < 1e-10 * float(dA.abs().max())  # dA's rows stay off M
    I = torch.eye(B.shape[0], dtype=B.dtype, device=device)
    assert rel(composite @ M, (I - P_B) @ Gs @ P_A @ M) < 1e-8
    A_perp = jm.safe_gradient(A, M)
    dA, dB = rectify(Gs, A_perp, B, s, delta=1e-14)
    assert float((s * (B @ dA + dB @ A_perp) @ M).norm()) < 1e-10 * float(Gs.norm())


def _joint_lstsq(Gs, A, B, s):
    """Eq. (5) as one linear least-squares system in (dA, dB), solved by LAPACK's gelsd (the
    solution of least norm) -> (dA, dB, residual norm)."""
    (r, d_in), d_out = A.shape, B.shape[0]
    eye = lambda n: torch.eye(n, dtype=Gs.dtype, device=Gs.device)
    # row-major vec(P X Q) = (P kron Q^T) vec(X): vec(s B dA) and vec(s dB A) side by side
    L = s * torch.cat([torch.kron(B, eye(d_in)), torch.kron(eye(d_out), A.T.contiguous())], 1)
    L, b = L.cpu(), Gs.flatten().cpu()[:, None]
    x = torch.linalg.lstsq(L, b, driver="gelsd").solution.flatten()
    residual = (b.flatten() - L @ x).norm()
    dA, dB = x[:r * d_in].reshape(r, d_in), x[r * d_in:].reshape(d_out, r)
    return dA.to(Gs.device), dB.to(Gs.device), residual


@pytest.mark.parametrize("device", DEVICES)
def test_gr_attains_the_joint_least_squares_optimum(device):
    G, M, A, B = _gr_problem(device)
    Gs = jm.safe_gradient(G, M)
    dA, dB = rectify(Gs, A, B, 1.3, delta=1e-14)
    ours = float((Gs - 1.3 * (B @ dA + dB @ A)).norm().cpu())
    assert abs(ours - float(_joint_lstsq(Gs, A, B, 1.3)[2])) <= 1e-8 * float(Gs.norm())


@pytest.mark.parametrize("device", DEVICES)
def test_gr_is_finite_for_zero_and_rank_deficient_factors(device):
    G, M, A, B = _gr_problem(device)
    one = torch.tensor([1.0, 0.0, 0.0], dtype=B.dtype, device=device)
    for A_, B_ in [(A, torch.zeros_like(B)), (A, B * one), (torch.zeros_like(A), B),
                   (A[[0, 0, 1]], B)]:
        for dtype in (torch.float64, torch.float32):
            dA, dB = rectify(G.to(dtype), A_.to(dtype), B_.to(dtype), 1.0)
            assert torch.isfinite(dA).all() and torch.isfinite(dB).all()
    dA, dB = rectify(G, A, torch.zeros_like(B), 1.0)
    assert float(dA.abs().max()) == 0.0  # B = 0: no information about dA, so no step on A
    assert rel(dB @ A, G @ torch.linalg.pinv(A) @ A) < 1e-3  # dB alone does G's share on row(A)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_keeps_the_method_in_float32(device):
    """Under bf16 autocast the backbone computes in bf16, but the safe gradient, GR and OE stay in
    float32: A's gradient stays orthogonal to M to float32 round-off."""
    torch.manual_seed(0)
    model = vit.vit_tiny_patch16(img_size=32, patch_size=8).to(device)
    M = orthonormal(192, 40, dtype=torch.float32, device=device)
    for _, _, layer in model.lora_layers():
        layer.reset_lora_(M)
        torch.nn.init.normal_(layer.B, std=0.02)
    with torch.autocast(device, dtype=torch.bfloat16):
        z, kv_inputs = model.encode(torch.randn(4, 3, 32, 32, device=device), [M] * 12)
    assert kv_inputs[0].dtype == torch.bfloat16  # the one bf16 copy q, k, v and OE share
    z.float().pow(2).sum().backward()
    layers = [layer for _, _, layer in model.lora_layers()]
    jm.rectify_gradients_(layers, 1e-4)
    for layer in layers:
        assert layer.A.grad.dtype == torch.float32 and torch.isfinite(layer.A.grad).all()
        assert float((layer.A.grad @ M).norm()) <= 1e-5 * float(layer.A.grad.norm())
    sub = jm.OnlineSubspace(192, 8, device=device)
    sub.basis = sub.fresh_basis(M)
    sub.update(kv_inputs[3].detach().flatten(0, 1), M)
    assert sub.basis.dtype == torch.float32 and float((M.T @ sub.basis).abs().max()) < 1e-5


def _planted(d, k, gap, seed):
    g = torch.Generator().manual_seed(seed)
    Q = orthonormal(d, d, dtype=torch.float32, gen=g)
    sd = torch.cat([torch.full((k,), math.sqrt(gap)), torch.ones(d - k)])
    return Q, sd, g


def _sin_largest_angle(U, V):
    return float((1 - torch.linalg.svdvals(U.T @ V).min() ** 2).clamp_min(0).sqrt())


@pytest.mark.parametrize("device", DEVICES)
def test_gram_systems_stay_positive_definite_where_float32_would_not(device):
    """Inputs of rank one: in float32 a Gram matrix's zero eigenvalues come out +-round-off, below
    OE's ridge, and Cholesky failed (NaN in a fp32 ViT-B run on CUDA). Formed in float64, they
    stay above it; an OE step on such inputs stays finite and orthonormal."""
    g = torch.Generator().manual_seed(0)
    for k, ridge in ((64, 1e-6), (10, 1e-8)):  # OE's ridge at rank k; GR's at a small --delta
        x = 1e3 * torch.randn(8, 4096, 1, generator=g) @ torch.randn(8, 1, k, generator=g)
        S = jm._ridge(jm._gram(x.to(device)), ridge)  # (8, k, k)
        assert (torch.linalg.cholesky_ex(S).info == 0).all()
    oe = jm.OnlineSubspace(256, 64, device=device)
    x = 1e3 * torch.randn(4096, 1, generator=g) @ torch.randn(1, 256, generator=g)  # rank one
    oe.update(x.to(device))
    eye = torch.eye(64, device=device)
    assert torch.isfinite(oe.basis).all() and torch.allclose(oe.basis.mT @ oe.basis, eye, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_oe_converges_to_the_planted_subspace(device):
    """Eqs. (8)-(10) on batches from a planted spectrum: V stays orthonormal and converges."""
    d, k, n = 64, 8, 64
    Q, sd, g = _planted(d, k, gap=10.0, seed=1)
    torch.manual_seed(0)
    sub, trace = jm.OnlineSubspace(d, k, device=device), {}
    for step in range(1, 2001):
        sub.update(((torch.randn(n, d, generator=g) * sd) @ Q.T).to(device))
        V = sub.basis
        assert float((V.T @ V - torch.eye(k, device=device)).norm()) <= 1e-5
        if step in (10, 50, 200, 1000, 2000):
            trace[step] = _sin_largest_angle(Q[:, :k].to(device), V)
    print("OE sin(largest principal angle) vs updates:", trace)
    assert trace[2000] <= 0.05 and trace[2000] < trace[10]


def test_oe_captures_a_vit_tasks_activations_within_an_epoch():
    """One epoch of OE (6 updates) on a random ViT-Ti's K/V inputs captures >= 99% of the energy of
    the best rank-k subspace of all the task's activations (the oracle)."""
    torch.manual_seed(0)
    model = vit.vit_tiny_patch16(img_size=32, patch_size=8).eval()
    task = data.subset(data.load_dataset('synthetic', None, 32, 0.0, 1.0).train, [0, 1, 2, 3])
    k, subs, captured = 8, [jm.OnlineSubspace(192, 8) for _ in model.blocks], {}
    with torch.no_grad():
        images = torch.stack([task[i][0] for i in range(len(task))])
        X_all = [X.flatten(0, 1) for X in model.encode(images)[1]]  # (B*N, D) per block
        best = [torch.linalg.eigvalsh(X.T @ X)[-k:].sum() for X in X_all]
        for step, (batch, _) in enumerate(data.make_loader(task, 16, True, 0, seed=0), 1):
            for sub, X in zip(subs, model.encode(batch)[1]):
                sub.update(X.flatten(0, 1))
            captured[step] = [float((X @ sub.basis).pow(2).sum() / b)
                              for sub, X, b in zip(subs, X_all, best)]
    print("OE energy captured / optimal, worst block, after each update:",
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
    assert float((subs[0].basis - subs[1].basis).abs().max()) < 1e-4  # the same trajectory
    sub, M = subs[0], torch.zeros(d, 0)
    for _ in range(3):  # three tasks
        M = sub.merge(M)
        for X in batches:
            sub.update(X, M)
        assert float((M.T @ M - torch.eye(M.shape[1])).abs().max()) < 1e-5
        assert float((M.T @ sub.basis).abs().max()) < 1e-5
    M = sub.merge(M)
    assert M.shape[1] == 4 * k
    for _ in range(10):  # the memory never exceeds the width; a full one leaves no basis
        M = sub.merge(M)
    assert M.shape[1] == d and sub.basis.shape[1] == 0
    sub.update(batches[0], M)
    layer = vit.LoRALinear(d, 8, 2, 1.0)
    layer.reset_lora_(M)
    assert float(layer.A.detach().abs().max()) == 0.0  # an exact zero, not round-off


def test_oe_update_and_merge_repair_a_planted_leak():
    """update re-projects V off M; merge re-orthonormalises [M, V]: planted a basis that leaks
    into span(M) and is not orthonormal, M^T V = 0 after update and M^T M = I after merge."""
    torch.manual_seed(6)
    sub = jm.OnlineSubspace(16, 3)
    M = orthonormal(16, 4, dtype=torch.float32)
    leak = M[:, :3] * 0.5 + 0.1 * torch.randn(16, 3)  # in span(M) largely, not unit
    sub.basis = leak
    sub.update(torch.randn(50, 16), M)
    assert float((M.T @ sub.basis).abs().max()) < 1e-5
    sub.basis = leak
    M = sub.merge(M)
    assert float((M.T @ M - torch.eye(7)).abs().max()) < 1e-5


def test_dml_terms():
    """Eq. (11): cross-entropy of cosine / tau to the batch's class prototypes, plus the mean hinge
    max(0, s - m) over batch x old prototypes."""
    torch.manual_seed(0)
    z, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    zn = F.normalize(z, dim=1)
    protos = F.normalize(torch.stack([zn[y == c].mean(0) for c in range(3)]), dim=1)
    expected = F.cross_entropy(zn @ protos.T / 0.07, y)
    assert abs(float(jm.dml_loss(z, y, torch.zeros(0, 8), 0.3, 0.07)) - float(expected)) < 1e-5
    old = -protos  # far from every feature of its class
    sims = zn @ old.T
    m = float(sims.max()) + 0.01  # every similarity below the margin: no hinge
    no_old = float(jm.dml_loss(z, y, torch.zeros(0, 8), m, 0.07))
    assert abs(float(jm.dml_loss(z, y, old, m, 0.07)) - no_old) < 1e-6
    hinge = F.relu(sims).mean()
    assert abs(float(jm.dml_loss(z, y, old, 0.0, 0.07)) - float(expected + hinge)) < 1e-5
    one = jm.dml_loss(z[:4], torch.zeros(4, dtype=torch.long), torch.zeros(0, 8))
    assert torch.isfinite(one) and abs(float(one)) < 1e-6  # one class: the intra term is 0


def test_dml_pushes_a_violating_feature_away_from_an_old_prototype():
    p = F.normalize(torch.tensor([[1.0, 0.2, 0.0]]), dim=1)
    z = torch.tensor([[0.9, 0.3, 0.1], [0.1, 1.0, 0.0]], requires_grad=True)
    before = float(F.normalize(z.detach(), dim=1)[0] @ p[0])
    assert before > 0.3
    jm.dml_loss(z, torch.tensor([0, 1]), p, margin=0.3).backward()
    with torch.no_grad():
        assert float(F.normalize(z - 0.1 * z.grad, dim=1)[0] @ p[0]) < before


def test_class_prototypes_are_unit_normalised_class_means():
    torch.manual_seed(7)
    z, y = torch.randn(30, 6) * 5, torch.arange(30) % 3
    protos = jm.class_prototypes(z, y, [0, 1, 2])
    assert torch.allclose(protos.norm(dim=1), torch.ones(3), atol=1e-6)
    zn = F.normalize(z, dim=1)
    expected = torch.stack([F.normalize(zn[y == c].mean(0), dim=0) for c in range(3)])
    assert torch.allclose(protos, expected, atol=1e-6)


def test_metrics_on_a_hand_computed_matrix():
    out = jm.metrics([[90.0, None, None], [80.0, 70.0, None], [60.0, 65.0, 50.0]])
    assert out["ACC"] == pytest.approx((60 + 65 + 50) / 3)
    assert out["MAA"] == pytest.approx((90 + (80 + 70) / 2 + (60 + 65 + 50) / 3) / 3)
    assert out["BWT"] == pytest.approx(((60 - 90) + (65 - 70)) / 2)


def test_evaluate_tells_task_agnostic_from_task_aware():
    """Hand-built heads where task 2's head always dominates: task 1's samples are 0% right
    task-agnostically (the paper's argmax over all heads) and 100% task-aware; the accuracy over
    samples weighs the tasks by their test sizes."""
    class Identity(torch.nn.Module):
        def encode(self, x, memory=None):
            return x.flatten(1), []
    D, tasks = 4, [[0, 1], [2, 3]]
    labels = [0, 1, 2, 3, 2, 3, 2, 3]  # task 1: 2 test samples, task 2: 6
    images = torch.eye(D)[labels].reshape(8, 1, 2, 2)  # z = one-hot of the class
    test = data._Images(list(images), labels, lambda x: x)
    splits = data.Splits(None, None, test, 4, list('abcd'))
    heads = torch.nn.ModuleList([torch.nn.Linear(D, 2, bias=False), torch.nn.Linear(D, 2)])
    with torch.no_grad():
        heads[0].weight.copy_(torch.eye(D)[:2])  # right, on its own classes
        heads[1].weight.copy_(torch.eye(D)[2:])
        heads[1].bias.fill_(10.0)  # dominates every sample
    cfg = jm.Config(batch_size=5, workers=0, device="cpu")
    agnostic, aware, samples = jm.evaluate(Identity(), heads, splits, tasks, cfg)
    assert agnostic == [0.0, 100.0] and aware == [100.0, 100.0]
    assert samples == 75.0  # 6 of 8 samples, where the mean over tasks is 50


def test_violation_is_the_dense_relative_violation():
    torch.manual_seed(4)
    A, B = torch.randn(4, 24), torch.randn(16, 4)
    M = torch.linalg.qr(torch.randn(24, 6))[0]
    dW = 0.5 * B @ A  # formed densely here only
    expected = float((dW @ M).norm() / dW.norm())
    assert expected > 0.1 and abs(jm.violation(A, B, M) - expected) < 1e-5 * expected
    assert jm.violation(A, B, torch.zeros(24, 0)) is None  # undefined: no memory yet
    assert jm.violation(A, torch.zeros(16, 4), M) is None  # undefined: no update


@pytest.mark.parametrize("device", DEVICES)
def test_least_norm_split_is_the_minimum_norm_least_squares_solution(device):
    """Ours (--rectify update): the split equals gelsd's minimum-norm solution of Eq. (5), with
    the same composite as GR's own split; finite at B = 0 and for rank-deficient factors."""
    G, M, A, B = _gr_problem(device)
    Gs = jm.safe_gradient(G, M)
    hA, hB = rectify(Gs, A, B, 1.3, delta=1e-14)
    dA, dB = jm.least_norm_split(hA, hB, A, B)
    oA, oB, _ = _joint_lstsq(Gs, A, B, 1.3)
    assert rel(dA, oA) < 1e-8 and rel(dB, oB) < 1e-8
    assert rel(B @ dA + dB @ A, B @ hA + hB @ A) < 1e-12  # the composite is untouched
    assert dA.norm() ** 2 + dB.norm() ** 2 < hA.norm() ** 2 + hB.norm() ** 2
    for A_, B_ in [(A, torch.zeros_like(B)), (torch.zeros_like(A), torch.zeros_like(B)),
                   (A[[0, 0, 1]], B[:, [0, 0, 2]])]:
        for dtype in (torch.float64, torch.float32):
            A_, B_, hA_, hB_ = (t.to(dtype) for t in (A_, B_, hA, hB))
            a, b = jm.least_norm_split(hA_, hB_, A_, B_)
            composite = B_ @ hA_ + hB_ @ A_
            assert torch.isfinite(a).all() and torch.isfinite(b).all()
            bound = 1e-5 * (1 + float(composite.abs().max()))
            assert float((B_ @ a + b @ A_ - composite).abs().max()) <= bound


def test_rectify_updates_matches_the_dense_reference():
    """Ours: rectify_updates_ = least-norm split of GR applied to the projected composite step
    s (B dA + dB A)(I - M M^T), for an A that is not orthogonal to M."""
    torch.manual_seed(8)
    d_in, d_out, r, s = 18, 11, 3, 0.6
    layer = vit.LoRALinear(d_in, d_out, r, s).double()
    M = orthonormal(d_in, 5)
    with torch.no_grad():
        layer.A.normal_()  # not orthogonal to M
        layer.B.normal_()
    A0, B0 = layer.A.detach().clone(), layer.B.detach().clone()
    with torch.no_grad():
        layer.A.add_(0.01 * torch.randn_like(A0))  # "Adam's step"
        layer.B.add_(0.01 * torch.randn_like(B0))
    dA, dB = layer.A.detach() - A0, layer.B.detach() - B0
    target = jm.safe_gradient(s * (B0 @ dA + dB @ A0), M)  # dense, (d_out, d_in)
    rA, rB = jm.least_norm_split(*rectify(target, A0, B0, s, 1e-4), A0, B0)
    jm.rectify_updates_([layer], [(A0, B0)], [M], 1e-4)
    assert rel(layer.A.detach() - A0, rA) < 1e-10 and rel(layer.B.detach() - B0, rB) < 1e-10


def test_lr_schedule_follows_the_inflora_codebase():
    """InfLoRA's CosineSchedule as its code steps it: epochs 0 and 1 at lr, then
    cos(99 pi (e - 1) / (200 (K - 1))); K = 1: one epoch at lr; --schedule cosine: a half cosine."""
    K = 20
    codebase = [1.0] + [math.cos(99 * math.pi * e / (200 * (K - 1))) for e in range(K - 1)]
    assert [jm.lr_factor(e, K, "inflora") for e in range(K)] == pytest.approx(codebase)
    assert sum(codebase) / K == pytest.approx(0.685, abs=1e-3) and codebase[-1] > 0.09
    assert [jm.lr_factor(e, 1, "inflora") for e in range(2)] == [1.0, 1.0]
    half = [1, 0.8536, 0.5, 0.1464]
    assert [jm.lr_factor(e, 4, "cosine") for e in range(4)] == pytest.approx(half, abs=1e-4)


def _planted_covariance(eigenvalues, seed):
    g = torch.Generator().manual_seed(seed)
    U = orthonormal(len(eigenvalues), len(eigenvalues), gen=g)
    return U @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ U.T, U


def test_gpm_adds_the_fewest_directions_that_reach_the_threshold():
    """GPM on a planted spectrum: the energy (squared eigenvalues of C, as the InfLoRA codebase)
    captured by the memory reaches the threshold, and one direction fewer would not."""
    lam = [5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.1]
    C, U = _planted_covariance(lam, 0)
    e = torch.tensor(lam, dtype=torch.float64) ** 2
    share = lambda M: float((torch.linalg.svdvals(M.T @ C) ** 2).sum() / e.sum())  # captured
    for threshold in (0.5, 0.9, 0.99):
        M = jm.gpm_extend(torch.zeros(8, 0, dtype=torch.float64), C, threshold)
        r = int((torch.cumsum(e, 0) / e.sum() < threshold).sum()) + 1  # the direct count
        assert M.shape[1] == r and share(M) >= threshold > share(M[:, :-1])
        # the leading eigenvectors; a sine from 1 - cos^2 is no finer than sqrt(eps) = 1.5e-8
        assert _sin_largest_angle(U[:, :r], M) < 1e-7
    M1 = jm.gpm_extend(torch.zeros(8, 0, dtype=torch.float64), C, 0.5)
    C2, _ = _planted_covariance([3.0, 2.9, 2.8, 0.5, 0.4, 0.3, 0.2, 0.1], 1)  # the next task
    M2 = jm.gpm_extend(M1, C2, 0.95)
    assert torch.equal(M2[:, :M1.shape[1]], M1)  # the old memory is kept
    assert float((M2.T @ M2 - torch.eye(M2.shape[1], dtype=torch.float64)).abs().max()) < 1e-10
    held = lambda M: float((torch.linalg.svdvals(M.T @ C2) ** 2).sum() /
                           (torch.linalg.svdvals(C2) ** 2).sum())
    assert held(M2) >= 0.95 > held(M2[:, :-1])


def test_inflora_a_is_off_the_memory():
    """InfLoRA's A: orthonormal rows over sqrt(3), off span(M), along (I - M M^T) C's leading
    left singular vectors."""
    C, _ = _planted_covariance([5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.1], 2)
    M = orthonormal(8, 2)
    A = jm.inflora_a(C, M, 3)
    assert A.shape == (3, 8) and float((A @ M).abs().max()) < 1e-12
    assert torch.allclose(A @ A.T * 3, torch.eye(3, dtype=torch.float64), atol=1e-12)


STEP_VARIANTS = {"plain": dict(oe=False, gr=False, dml=False), "janus-grad": {},
                 "janus-update": dict(rectify="update"), "oe-rolling": dict(memory="oe-rolling"),
                 "gpm": dict(memory="gpm"), "fp32": dict(precision="fp32")}


def _step_of(change, device, compile=False):
    """A train_step of a variant in a mid-run state (the benchmark's), on a small ViT."""
    argv = ["--model", "vit_tiny", "--weights", "none", "--img-size", "32", "--patch-size", "8",
            "--k", "8", "--dataset", "synthetic", "--device", device,
            "--compile", "on" if compile else "off"]
    cfg = jm.check_config(jm.parse_args(argv))
    torch.manual_seed(0)
    base = jm.build_model(cfg)
    images, y = torch.randn(4, 3, 32, 32, device=device), torch.tensor([0, 1, 2, 3], device=device)
    return jm.bench_step(cfg, base, change, 16, 4), images, y


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("variant", list(STEP_VARIANTS))
def test_train_step_never_syncs_with_the_host_on_cuda(variant, compile):
    """A training step of every variant, compiled (blocks, and the step as a CUDA graph) and not,
    runs under torch.cuda.set_sync_debug_mode("error")."""
    step, images, y = _step_of(STEP_VARIANTS[variant], "cuda", compile)
    for _ in range(5):  # warm-up: handles, workspaces, first-call checks; the graph's recording
        step(images, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            step(images, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["janus-grad", "janus-update", "oe-rolling", "plain"])
def test_the_cuda_graph_replays_what_train_step_does(variant, monkeypatch):
    """StepGraph (--compile on, CUDA) against train_step itself with the same Adam: through the
    warm-up, the recording, replays on new inputs, an lr change and a batch of another shape, the
    factors, OE's basis and step count, and Adam's moments agree."""
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: None)  # the graph alone
    runs = []
    for graphed in (True, False):
        if not graphed:
            monkeypatch.setattr(jm, "StepGraph", lambda step: step)
        step, images, y = _step_of({**STEP_VARIANTS[variant], "precision": "fp32"}, "cuda", True)
        for i in range(8):
            if i == 6:
                step.opt.param_groups[0]["lr"].fill_(2e-3)
            step(images * (1 + i / 10), y)
        step(images[:3], y[:3])  # another shape: the step as it is
        step(images, y)  # and a replay again
        learner, state = step.learner, step.opt.state.values()
        runs.append([learner.oe.basis, learner.oe.steps, *learner.model.lora_parameters(),
                     *[s[key] for s in state for key in ("exp_avg", "exp_avg_sq")]])
    assert int(runs[0][1]) == (10 if variant != "plain" else 0)
    for a, b in zip(*runs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_compiled_blocks_give_the_same_step(monkeypatch):
    """--compile (torch.compile of each block) gives the steps of the plain model. Traced here by
    TorchDynamo with the eager backend: CI can afford it, and tracing is where blocks can fail."""
    real = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: real(self, backend="eager"))
    losses = []
    for compile in (False, True):
        torch._dynamo.reset()
        step, images, y = _step_of({}, "cpu", compile)
        losses.append([float(step(images, y)[0]) for _ in range(3)])
    assert torch._dynamo.utils.counters["frames"]["ok"] >= 1  # the blocks were traced
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_interference_on_activations_equals_the_dense_computation():
    """Probe, its pass over the seen test images: per layer, ||X dW^T||_F / sqrt(tokens) over the
    past tasks' test inputs and over the current task's; X: the block's K/V input, dW = s B A."""
    torch.manual_seed(9)
    model = vit.vit_tiny_patch16(depth=2, img_size=32, patch_size=8).eval()
    factors = [(torch.randn(3, 192), torch.randn(192, 3)) for _ in range(4)]
    images, y = torch.rand(10, 3, 32, 32), torch.tensor([0, 1, 2, 3, 4] * 2)
    current = torch.tensor([False, False, False, True, True])  # classes 3, 4: the current task
    probe = jm.Probe(factors, 0.5, current, "cpu")
    test = data._Images(list((images * 255).to(torch.uint8)), y.tolist(), lambda x: x)
    probe.read(model, test, jm.Config(device="cpu", batch_size=4, workers=0))
    with torch.no_grad():
        kv = model.encode((images * 255).to(torch.uint8).float() / 255)[1]
    got = probe.interference()
    for j, (A, B) in enumerate(factors):
        dW = 0.5 * B @ A  # dense, (d_out, d_in)
        for key, rows in (("past", ~current[y]), ("current", current[y])):
            X = kv[j // 2][rows].flatten(0, 1)  # (tokens, D)
            assert got[key][j] == pytest.approx(float((X @ dW.T).norm() / X.shape[0] ** 0.5),
                                                rel=1e-4)
        assert got["ratio"][j] == pytest.approx(got["past"][j] / got["current"][j])


def test_interference_is_round_off_when_the_update_is_off_a_memory_spanning_the_past():
    """With --rectify update, dW M = 0; past inputs inside span(M) then see only round-off, and
    those with a part outside see ||X (I - M M^T) dW^T||, which the memory cannot prevent."""
    torch.manual_seed(10)
    d, k = 24, 6
    M = orthonormal(d, k, dtype=torch.float32)
    layer = vit.LoRALinear(d, 12, 3, 1.0)
    layer.reset_lora_(M)
    X2 = torch.randn(512, d)
    _fit(layer, X2, X2 @ torch.randn(12, d).T, 100, gr="update", memory=M)
    X_in = torch.randn(64, k) @ M.T  # past inputs inside span(M)
    outside = 0.3 * jm.safe_gradient(torch.randn(64, d), M)  # a part the memory misses
    dW = (layer.B @ layer.A).detach()
    for X, expected in ((X_in, 0.0), (X_in + outside, float((outside @ dW.T).norm() / 8))):
        probe = jm.Probe([(layer.A.detach(), layer.B.detach())], 1.0, torch.tensor([False]), "cpu")
        probe.add(torch.zeros(1, 12), [X[None]], torch.tensor([0]))  # one "image" of 64 tokens
        past = probe.interference()["past"][0]
        assert past == pytest.approx(expected, abs=1e-5 * float(dW.norm() * X.norm() / 8))


def test_dml_geometry_on_a_hand_built_case():
    """cos_old: the largest similarity to an old class's prototype; cos_own: to its own; the shares
    above 0.5, below 0.2 and of cos_old > cos_own; the histogram of cos_old."""
    prototypes = torch.eye(3)  # classes 0 and 1 are old; class 2 is the task's
    cos_old = torch.tensor([0.62, 0.15, 0.93])
    z = torch.stack([cos_old, torch.zeros(3), (1 - cos_old ** 2).sqrt()], 1) * 3.0  # any norm
    g = jm.dml_geometry(z, torch.tensor([2, 2, 2]), prototypes, old=2)
    assert g["cos_old"] == pytest.approx([0.62, 0.15, 0.93], abs=1e-4)
    assert g["cos_own"] == pytest.approx([0.7846, 0.9887, 0.3676], abs=1e-4)
    assert (g["danger"], g["safe"], g["closer_to_old"]) == pytest.approx((2 / 3, 1 / 3, 1 / 3))
    expected = [0.0] * 20
    for c in (0.62, 0.15, 0.93):  # bins of 0.1 over [-1, 1]
        expected[int((c + 1) / 0.1)] += 1 / 3
    assert g["hist"] == pytest.approx(expected)


def _fit(layer, X, Y, steps, sub=None, gr=None, lr=1e-2, delta=1e-4, memory=None):
    """Adam on one LoRA layer, projecting with memory; gr in (None, 'grad', 'update'); sub: an
    OnlineSubspace to update."""
    opt = torch.optim.Adam([layer.A, layer.B], lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, X.shape[0], (64,), generator=g)
        if sub is not None:
            sub.update(X[idx])
        opt.zero_grad()
        F.mse_loss(layer(X[idx], memory), Y[idx]).backward()
        if gr == "grad":
            jm.rectify_gradients_([layer], delta)
        if gr == "update":
            jm.rectified_adam_step_(opt, [layer], [memory], delta)
        else:
            opt.step()


def test_two_task_violation_and_forgetting_of_the_four_variants(monkeypatch):
    """One LoRA layer, two tasks whose inputs overlap: OE finds task 1's subspace; every variant
    learns task 2; --rectify update protects it to round-off with factors of one size."""
    torch.manual_seed(0)
    d_in, d_out, r, k = 32, 16, 4, 6
    U = orthonormal(d_in, d_in, dtype=torch.float32)
    U1, U2 = U[:, :k], U[:, k:2 * k]
    X1 = torch.randn(2048, k) @ U1.T * 2 + 0.05 * torch.randn(2048, d_in)  # task 1 in span(U1)
    X2 = torch.randn(2048, k) @ U1.T + torch.randn(2048, k) @ U2.T * 2  # task 2 overlaps it
    W1, W2 = torch.randn(d_out, d_in), torch.randn(d_out, d_in)
    Y1, Y2 = X1 @ W1.T, X2 @ W2.T
    layer, sub = vit.LoRALinear(d_in, d_out, r, 1.0), jm.OnlineSubspace(d_in, k)
    _fit(layer, X1, Y1, 300, sub=sub)
    layer.merge_()
    M = sub.merge(torch.zeros(d_in, 0))
    assert _sin_largest_angle(U1, M) < 0.1  # OE found task 1's subspace
    with torch.no_grad():
        loss1, loss2 = float(F.mse_loss(layer(X1), Y1)), float(F.mse_loss(layer(X2), Y2))
    results = {}
    for name, oe, gr in [("all off", False, None), ("OE only", True, None),
                         ("OE+GR grad", True, "grad"), ("OE+GR update", True, "update"),
                         ("update, GR's split", True, "update")]:
        if name == "update, GR's split":  # update mode with Eqs. (6)-(7)'s own split
            monkeypatch.setattr(jm, "least_norm_split", lambda dA, dB, A, B: (dA, dB))
        lay = copy.deepcopy(layer)
        torch.manual_seed(1)
        lay.reset_lora_(M if oe else None)
        _fit(lay, X2, Y2, 300, gr=gr, memory=M if oe else None)
        with torch.no_grad():
            dW = lay.scale * lay.B @ lay.A
            results[name] = (float((dW @ M).norm() / dW.norm()),
                             float(F.mse_loss(lay(X1), Y1)) - loss1, float(F.mse_loss(lay(X2), Y2)),
                             float(lay.A.norm()), float(lay.B.norm()))
    for name, (viol, forget, learned, a, b) in results.items():
        print(f"{name:18s} violation {viol:.2e}  task-1 loss increase {forget:8.4f}  task-2 loss "
              f"{learned:8.3f} (before: {loss2:.3f})  ||A|| {a:7.2f}  ||B|| {b:6.3f}")
    assert results["OE+GR update"][0] <= 1e-3
    assert results["OE+GR grad"][0] < results["all off"][0]
    assert results["OE+GR update"][1] < results["all off"][1]
    assert all(learned <= 0.6 * loss2 for _, _, learned, _, _ in results.values())
    a, b = results["OE+GR update"][3:]
    assert 0.25 <= a / b <= 4  # the least-norm split keeps the factors of one size
    a, b = results["update, GR's split"][3:]
    assert a / b >= 100 and results["update, GR's split"][0] <= 1e-3  # same protection, lopsided


# ==================================================================================================
# janus_min.py, the program: one shared end-to-end run, resume, determinism, bad input
# ==================================================================================================
TINY = ["--dataset", "synthetic", "--model", "vit_tiny", "--weights", "none", "--img-size", "32",
        "--patch-size", "8", "--tasks", "3", "--epochs", "2", "--batch-size", "8", "--k", "8",
        "--workers", "0", "--lr", "5e-3", "--device", "cpu"]  # the CPU: its numbers are compared


STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  "  # log.txt's, before each line


def _results(folder):
    with open(folder / "results.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run of TINY (three tasks), read by every test below that only reads results. It records
    the lr of each step, the memory each K/V layer's forward got in each step, the memory after
    each task, and the memory width that each violation was computed against."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    seen = {"memory": [], "forward": [], "widths": [], "lr": []}
    real_end, real_violation, real_step = jm.end_task, jm.violation, jm.train_step
    real_forward = vit.LoRALinear.forward

    def train_step(learner, opt, *args):
        seen["lr"].append(float(opt.param_groups[0]["lr"]))
        got = seen["in_step"] = []
        out = real_step(learner, opt, *args)
        seen["in_step"] = None
        expected = [M for M in learner.memory for _ in "kv"]  # block i's for its K and V
        seen["forward"].append([a is b for a, b in zip(got, expected)] + [len(got) == 24])
        return out

    def forward(self, x, memory=None):
        if seen.get("in_step") is not None:
            seen["in_step"].append(memory)
        return real_forward(self, x, memory)

    def end_task(learner, t, *args):
        factors = real_end(learner, t, *args)
        seen["memory"].append(torch.stack(learner.memory))
        return factors

    def violation(A, B, M):
        seen["widths"].append(M.shape[1])
        return real_violation(A, B, M)
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as log:
        mp.setattr(jm, "end_task", end_task)
        mp.setattr(jm, "violation", violation)
        mp.setattr(jm, "train_step", train_step)
        mp.setattr(vit.LoRALinear, "forward", forward)
        code = jm.main(TINY + ["--out", str(out)])
    return dict(out=out, code=code, res=_results(out), log=log.getvalue(), **seen)


def test_end_to_end_results_are_consistent(tiny_run):
    res = tiny_run["res"]
    assert tiny_run["code"] == 0 and set(res) == {"config", "environment", "runs", "summary"}
    assert res["environment"]["torch"] == torch.__version__ and res["config"]["out"]
    r = res["runs"][0]
    A = r["acc_matrix"]
    assert len(A) == 3 and all(len(row) == 3 for row in A)
    assert all(A[t][i] is None for t in range(3) for i in range(t + 1, 3))
    assert all(0 <= A[t][i] <= 100 for t in range(3) for i in range(t + 1))
    assert {k: r[k] for k in ("ACC", "MAA", "BWT")} == pytest.approx(jm.metrics(A))
    assert res["summary"]["ACC"]["mean"] == pytest.approx(r["ACC"])
    aware = r["task_aware"]  # right whenever the argmax over all seen classes is: never lower
    assert {k: aware[k] for k in jm.metrics(A)} == pytest.approx(jm.metrics(aware["acc_matrix"]))
    assert all(aware["acc_matrix"][t][i] >= A[t][i] for t in range(3) for i in range(t + 1))
    assert aware["acc_matrix"][0][0] == A[0][0]
    assert [len(v) for v in r["violation"]["k"]] == [12, 12, 12] and len(r["violation"]["v"]) == 3
    assert all(v is None for v in r["violation"]["k"][0])  # task 1: no memory yet, undefined
    assert len(r["task_seconds"]) == 3 and (tiny_run["out"] / "checkpoint.pt").exists()
    assert all(s in tiny_run["log"] for s in ("task 3/3 epoch 2/2", "img/s", "ETA", "ACC"))


def test_each_epoch_runs_at_the_schedules_lr(tiny_run):
    """InfLoRA's schedule at K = 2 keeps both epochs at --lr (a half cosine would halve the 2nd)."""
    per_epoch = 12  # 4 classes x 24 images / batch 8
    lrs = tiny_run["lr"]
    assert len(lrs) == 3 * 2 * per_epoch and lrs == pytest.approx([5e-3] * len(lrs))


def test_the_loop_learns_each_task(tiny_run):
    """Chance is 25% within a task, and its test images number 32 per task: a mean diagonal of 50
    is over five standard deviations above chance, which wrong labels, heads or optimizer wiring
    give. Measured diagonal 100, 96.9, 84.4 (seed 0, CPU, torch 2.14); the GPU machine's CPU
    (torch 2.11, 16 threads) gave 75 on task 1: 24 steps from random weights vary by platform."""
    A = tiny_run["res"]["runs"][0]["acc_matrix"]
    assert sum(A[t][t] for t in range(3)) / 3 >= 50


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_loop_learns_each_task_on_cuda(tmp_path):
    """TINY on CUDA (bf16 autocast, the device pipeline): finite results above the same bound. The
    same command on an H100 gave mean diagonals 83.3, 84.4 and 90.6 for seeds 0, 1, 2."""
    assert jm.main(TINY + ["--device", "cuda", "--out", str(tmp_path)]) == 0
    A = _results(tmp_path)["runs"][0]["acc_matrix"]
    assert sum(A[t][t] for t in range(3)) / 3 >= 50


def test_every_layer_projects_with_its_blocks_memory_in_every_step(tiny_run):
    """In every step, K and V of block i get the learner's memory of block i itself (one owner,
    no copies); after task t it is k (t + 1) wide and orthonormal; the violations of tasks 2..T
    were computed against the memory of their training, non-empty."""
    assert len(tiny_run["forward"]) == 3 * 2 * 12 and all(all(f) for f in tiny_run["forward"])
    for t, M in enumerate(tiny_run["memory"]):  # (blocks, D, m)
        assert M.shape == (12, 192, 8 * (t + 1))
        assert float((M.mT @ M - torch.eye(M.shape[2])).abs().max()) < 1e-5
    widths = tiny_run["widths"]  # 24 layers per task
    assert widths == [0] * 24 + [8] * 24 + [16] * 24


@pytest.mark.parametrize("method", sorted(jm.METHODS))
def test_every_method_runs_end_to_end(method, tmp_path, monkeypatch):
    """Each preset on two short synthetic tasks: valid results; InfLoRA's A stays as designed,
    off the memory, so its update's violation is round-off; GPM's memory grows per block;
    oe-rolling's memory is always one rank-k basis."""
    seen = {"designed": [], "widths": []}
    real_design, real_end = jm.inflora_a, jm.end_task
    monkeypatch.setattr(jm, "inflora_a", lambda *a: seen["designed"].append(real_design(*a)) or
                        seen["designed"][-1])

    def end_task(learner, t, *args):
        layers = [layer for _, _, layer in learner.model.lora_layers()]
        if method == "inflora":  # A after training, before the merge: still the designed one
            designed = seen["designed"][-len(layers) // 2:]  # one per block
            assert all(torch.equal(layer.A, designed[i // 2]) for i, layer in enumerate(layers))
            assert all(float((layer.A @ learner.memory[i // 2]).norm()) < 1e-5
                       for i, layer in enumerate(layers))
        factors = real_end(learner, t, *args)
        seen["widths"].append([m.shape[1] for m in learner.memory])
        return factors
    monkeypatch.setattr(jm, "end_task", end_task)
    real_step, projected = jm.train_step, []

    def train_step(learner, *args):  # rolling: the basis as it stood is the step's memory
        basis = learner.oe.basis.clone()
        out = real_step(learner, *args)
        projected.append(all(torch.equal(M, V) for M, V in zip(learner.memory, basis)))
        return out
    if method == "janus-rolling":
        monkeypatch.setattr(jm, "train_step", train_step)
    argv = _flag(_flag(TINY, "--tasks", "2"), "--epochs", "1") + ["--method", method]
    if method not in ("janus", "janus-rolling"):  # without OE, --k is refused
        argv = argv[:argv.index("--k")] + argv[argv.index("--k") + 2:]
    assert jm.main(argv + ["--out", str(tmp_path)]) == 0
    r = _results(tmp_path)["runs"][0]
    assert {k: r[k] for k in ("ACC", "MAA", "BWT")} == pytest.approx(jm.metrics(r["acc_matrix"]))
    assert len(r["sample_acc"]) == 2 and len(r["task_seconds"]) == 2
    widths = seen["widths"]
    if method == "inflora":
        assert max(r["violation"]["k"][1] + r["violation"]["v"][1]) < 1e-5
    if method.startswith("lora-gpm") or method == "inflora":
        assert 0 < min(widths[0]) and all(b >= a for a, b in zip(widths[0], widths[1]))
    if method == "janus-rolling":  # each step projects with the basis as it stood
        assert widths == [[8] * 12, [8] * 12] and len(projected) == 2 * 18 and all(projected)
    if method == "finetune":
        assert widths == [[0] * 12, [0] * 12]


def test_progress_lines_come_every_30_s_with_an_eta_that_counts_evaluation(monkeypatch, capsys):
    now = [0.0]
    monkeypatch.setattr(jm.time, "time", lambda: now[0])
    clock = jm.Clock(train_images=100, eval_images=30)
    now[0] = 5.0
    due = clock.passed("train", 50)  # 0.1 s an image; evaluation not timed yet: a third of that
    assert not due and clock.eta() == pytest.approx(50 * 0.1 + 30 * 0.1 / 3)
    now[0] = 30.0
    assert clock.passed("train", 0)  # 30 s since the last line: one is due; 0.6 s an image now
    clock.show("task 1/2 epoch 1/1: 3/9 steps")  # ETA 50 * 0.6 + 30 * 0.2 = 36 s
    now[0] = 30.5
    assert not clock.passed("eval", 10)  # evaluation timed: 0.05 s an image
    assert clock.eta() == pytest.approx(50 * 0.6 + 20 * 0.05)
    assert capsys.readouterr().out == "task 1/2 epoch 1/1: 3/9 steps  ETA 0.6 min\n"


def test_evaluation_and_the_prototypes_pass_show_progress_too(tmp_path, monkeypatch, capsys):
    """With a line due after every batch: the passes that do not train say how far they are, in
    the console and in log.txt, and the ETA reaches 0 with the last test image of the run."""
    monkeypatch.setattr(jm.Clock.__init__, "__defaults__", (0.0,))  # every: a line each batch
    argv = _flag(_flag(TINY, "--tasks", "2"), "--epochs", "1")  # 6 classes: 144 / 48 images a task
    assert jm.main(argv + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    log = (tmp_path / "log.txt").read_text()
    for line in ("evaluation: 8/48 images  ETA", "evaluation: 48/48 images  ETA",
                 "task 2's prototypes: 144/144 images  ETA",
                 "evaluation: 96/96 images  ETA 0.0 min"):
        assert f"\n{line}" in out and re.search(rf"^{STAMP}{line}", log, re.M), line


def test_every_console_line_goes_to_log_txt_after_a_timestamp(tmp_path):
    console = io.StringIO()
    with open(tmp_path / "log.txt", "w") as log:
        tee = jm.Tee(console, log)
        print("one\ntw", end="", file=tee)
        print("o", file=tee)
    assert console.getvalue() == "one\ntwo\n"
    assert re.fullmatch(f"{STAMP}one\n{STAMP}two\n", (tmp_path / "log.txt").read_text())


def test_help_lists_every_flag_by_group_with_examples(capsys):
    with pytest.raises(SystemExit) as stop:
        jm.main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "examples:" in out and "ablation (paper Table 1):" in out
    grouped = " ".join(jm.GROUPS.values()).split()
    assert sorted(grouped) == sorted(f.name for f in jm.fields(jm.Config))  # each flag in a group
    assert all(jm._flag(name) in out or "--no-" + name in out for name in grouped)


def test_help_names_readme_sections_that_exist(capsys):
    with pytest.raises(SystemExit):
        jm.main(["--help"])
    named = re.findall(r"README, '(.+?)'\)", " ".join(capsys.readouterr().out.split()))
    readme = Path(jm.__file__).with_name("README.md").read_text(encoding="utf-8")
    titles = [line.lstrip("#").strip() for line in readme.splitlines() if line.startswith("#")]
    assert len(named) >= 3 and all(any(t.startswith(n) for t in titles) for n in named), named


@pytest.mark.parametrize("memory", [True, False])
def test_plots_when_matplotlib_is_installed(tiny_run, tmp_path, monkeypatch, memory):
    """The three plots, also of a run without a memory (every ||dW M|| undefined: a note); each
    names its data set, T and configuration; angular.png draws cos_old = cos_own within axes
    scaled to the data, and says what its right panel plots."""
    matplotlib = pytest.importorskip("matplotlib")  # optional: without it a one-line note instead
    res = copy.deepcopy(tiny_run["res"])
    if not memory:
        res["runs"][0]["violation"] = {n: [[None] * 12] * 3 for n in "kv"}
    figures = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, path, **kwargs):
        figures[os.path.basename(path)] = fig
        return real_savefig(fig, path, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    jm.plot(res, str(tmp_path))
    for name in ("trajectory.png", "violation.png", "angular.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        fig = figures[name]
        titles = " ".join([fig.get_suptitle()] + [ax.get_title() for ax in fig.axes])
        assert jm._title(res["config"]) in titles and "synthetic, T=3" in titles, name
    assert "small: the task's update leaves" in figures["violation.png"].get_suptitle()
    left, right = figures["angular.png"].axes
    g = res["runs"][0]["geometry"][-1]
    values = g["cos_old"] + g["cos_own"]
    assert left.get_xlim() == left.get_ylim() == pytest.approx((min(values) - 0.05,
                                                                max(values) + 0.05))
    assert any(list(line.get_xdata()) == list(line.get_ydata()) == list(left.get_xlim())
               for line in left.lines)  # the diagonal, corner to corner
    assert "per bin" in right.get_ylabel() and "in each bin" in right.get_title()


@pytest.mark.parametrize("stop, code", [("ctrl-c", 130), ("sigterm", 143)])
def test_resume_alone_gives_the_uninterrupted_result(tiny_run, tmp_path, monkeypatch, capsys, stop,
                                                     code):
    """Ctrl-C or SIGTERM at the end of task 3 (task 2's checkpoint written), then --resume DIR
    alone, as the message says: the numbers of the uninterrupted shared run (so runs are also
    deterministic)."""
    calls, real_evaluate = {"n": 0}, jm.evaluate

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 3 and stop == "ctrl-c":
            raise KeyboardInterrupt
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a cluster scheduler does
        return real_evaluate(*args)
    monkeypatch.setattr(jm, "evaluate", interrupted)
    assert jm.main(TINY + ["--out", str(tmp_path / "b")]) == code
    monkeypatch.setattr(jm, "evaluate", real_evaluate)
    said = capsys.readouterr().out
    assert f"continue with: python janus_min.py --resume {tmp_path / 'b'}" in said
    name = {"ctrl-c": "Ctrl-C", "sigterm": "SIGTERM"}[stop]  # the same line in log.txt, stamped
    assert re.search(rf"^{STAMP}interrupted \({name}\): .* continue with: python janus_min.py "
                     rf"--resume {re.escape(str(tmp_path / 'b'))}$",
                     (tmp_path / "b" / "log.txt").read_text(), re.M)
    assert not (tmp_path / "b" / "results.json").exists()
    assert not (tmp_path / "b" / "run.lock").exists()  # released on the way out
    ckpt = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert len(ckpt["current"]["acc"]) == 2
    assert jm.main(["--resume", str(tmp_path / "b" / "checkpoint.pt")]) == 0  # the file: its folder
    a, b = tiny_run["res"]["runs"][0], _results(tmp_path / "b")["runs"][0]
    for key in ("acc_matrix", "task_aware", "violation", "interference", "geometry"):
        assert a[key] == b[key]
    log = (tmp_path / "b" / "log.txt").read_text()
    assert "task 2 accuracy" in log and "seed 0: resumed after task 2" in log  # appended


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:778] . "
                                                  "unexpected pos 6784 vs 6672")])
def test_a_full_disk_keeps_the_last_checkpoint_and_says_how_to_go_on(tmp_path, monkeypatch, capsys,
                                                                     failure):
    """The disk fills while task 2's checkpoint.pt is written (torch.save raises as it does then):
    one line that says so and how to continue, exit 1, task 1's checkpoint.pt intact, no .tmp left;
    --resume then finishes the run."""
    real_save, saves = torch.save, []

    def save(obj, path):
        saves.append(path)
        if len(saves) == 2:  # task 2's checkpoint: the disk is full half-way through
            Path(path).write_bytes(b"PK\x03\x04 half a file")
            raise failure
        return real_save(obj, path)
    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "full"
    assert jm.main(TINY + ["--out", str(out)]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]
    assert "disk is full" in err[0] and f"--resume {out}" in err[0]
    assert not (out / "checkpoint.pt.tmp").exists() and not (out / "run.lock").exists()
    assert len(torch.load(out / "checkpoint.pt", weights_only=True)["current"]["acc"]) == 1
    monkeypatch.setattr(torch, "save", real_save)
    assert jm.main(["--resume", str(out)]) == 0 and len(_results(out)["runs"][0]["acc_matrix"]) == 3


def test_ctrl_c_while_the_data_loads_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the data set loads: one line, exit 130, and the folder left as it was."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(data, "load_dataset", interrupted)
    assert jm.main(TINY + ["--out", str(tmp_path / "new")]) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert err == ["interrupted (Ctrl-C) while starting: nothing was saved"]
    assert not (tmp_path / "new").exists()


def test_ctrl_c_while_torch_loads_says_so_in_one_line():
    """Ctrl-C during `import torch`, the first seconds of `python janus_min.py`: one line, exit 130,
    no traceback. The interrupt is raised by an import hook, so it falls inside the import."""
    code = ("import runpy, sys\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "sys.argv = ['janus_min.py', '--help']\n"
            "runpy.run_path('janus_min.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(jm.__file__).parent)
    assert done.returncode == 130 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "interrupted (Ctrl-C) while starting: nothing was saved"


def test_ctrl_c_in_the_first_task_says_nothing_was_saved(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jm, "end_task", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert jm.main(TINY + ["--out", str(tmp_path / "r")]) == 130
    assert "no task had finished, so nothing was saved" in capsys.readouterr().out
    assert jm.main(["--resume", str(tmp_path / "r")]) == 2
    assert "no checkpoint.pt there" in capsys.readouterr().err


def test_a_finished_runs_checkpoint_holds_its_final_model(tiny_run):
    """load_run rebuilds the final model from checkpoint.pt: it scores the last accuracy row."""
    cfg, learner = jm.load_run(tiny_run["out"])
    splits = data.load_dataset("synthetic", None, 32, (0.0,) * 3, (1.0,) * 3)
    tasks = data.task_classes(12, 3)
    assert len(learner.acc) == 3 and len(learner.heads) == 3 and learner.prototypes.shape[0] == 12
    acc, aware, _ = jm.evaluate(learner.model, learner.heads, splits, tasks, cfg)
    assert acc == tiny_run["res"]["runs"][0]["acc_matrix"][-1]


def test_a_second_run_on_the_same_folder_is_refused_until_its_lock_is_gone(tmp_path, capsys):
    folder = tmp_path / "busy"
    folder.mkdir()
    (folder / "run.lock").write_text(f"process 4242 on {socket.gethostname()}")
    assert jm.main(TINY + ["--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is in use by the run of process 4242" in err and "choose another --out" in err
    assert f"delete {folder / 'run.lock'}" in err and (folder / "run.lock").exists()
    (folder / "run.lock").unlink()  # as the message says, once no run writes there
    assert jm.main(_flag(TINY, "--tasks", "1") + ["--epochs", "1", "--out", str(folder)]) == 0
    assert not (folder / "run.lock").exists()
    run = _results(folder)["runs"][0]
    assert run["BWT"] is None and _results(folder)["summary"]["BWT"]["mean"] is None  # one task


def test_resume_of_a_busy_folder_is_refused_before_anything_loads(tiny_run, tmp_path, monkeypatch,
                                                                  capsys):
    """The lock is checked before the data and the backbone load, and the advice is --resume's."""
    folder = tmp_path / "busy"
    shutil.copytree(tiny_run["out"], folder)
    (folder / "run.lock").write_text("process 4242 on elsewhere")
    loaded = []

    def load_dataset(*args, **kwargs):
        loaded.append(args)
    monkeypatch.setattr(data, "load_dataset", load_dataset)
    assert jm.main(["--resume", str(folder)]) == 2 and not loaded
    err = capsys.readouterr().err
    assert "in use by the run of process 4242 on elsewhere" in err and "--out" not in err
    assert "wait for it to end or stop it, then run --resume again" in err
    assert (folder / "run.lock").read_text() == "process 4242 on elsewhere"


@pytest.mark.parametrize("flag", ["--out", "--resume"])
def test_an_unwritable_folder_is_refused_before_anything_loads(tiny_run, tmp_path, monkeypatch,
                                                                capsys, flag):
    """A read-only folder, as os.access reports one (simulated: root may write anyway)."""
    folder = tmp_path / "read-only"
    shutil.copytree(tiny_run["out"], folder / "run")
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(str(folder)))
    loaded = []
    monkeypatch.setattr(data, "load_dataset", lambda *a, **k: loaded.append(a))
    argv = TINY + ["--out", str(folder / "new")] if flag == "--out" else ["--resume",
                                                                          str(folder / "run")]
    assert jm.main(argv) == 2 and not loaded
    assert "cannot be written (read-only)" in capsys.readouterr().err


def test_resume_of_a_finished_run_and_of_the_default_seeds(tiny_run, tmp_path, capsys):
    shutil.copytree(tiny_run["out"], tmp_path / "r")  # --seeds was left at its default, 0
    assert jm.main(TINY + ["--seeds", "0", "--resume", str(tmp_path / "r")]) == 0  # all done
    after = _results(tmp_path / "r")
    assert after["runs"] == tiny_run["res"]["runs"]
    assert after["summary"] == tiny_run["res"]["summary"]
    assert "ACC" in capsys.readouterr().out


def test_reproduce_dry_run_lists_the_ablations_seven_rows(capsys):
    argv = ["--reproduce", "ablation", "--dataset", "imagenet-r", "--dry-run", "--out", "R"]
    assert jm.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if ": python janus_min" in line]
    flags = {"1": "--no-oe --no-gr --no-dml", "2": "--no-oe --no-gr", "3": "--no-gr --no-dml",
             "4": "--no-oe --no-dml", "5": "--no-dml", "6": "--no-gr", "7": ""}
    assert [r.split(":")[0] for r in rows] == list(flags)
    for row, line in zip(flags, rows):
        assert line.endswith(f"--dataset imagenet-r {flags[row]} --out R/{row}".replace("  ", " "))


def test_reproduce_says_its_data_set_and_t_and_whether_the_paper_gives_numbers(capsys):
    for name in jm.REPRODUCE:  # without --dataset: CIFAR-100, T=10; the paper's numbers for some
        assert jm.main(["--reproduce", name, "--dry-run", "--out", "R"]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert "rows on cifar100, T=10, into R; " in head
        given = name in ("methods", "oe-vs-gpm")  # the others' numbers: ImageNet-R, T=10
        assert ("the paper's numbers: Table" in head) == given, head
        assert ("add --dataset imagenet-r --tasks 10" in head) != given, head
    assert head.endswith("the paper gives no numbers for cifar100, T=10; its settings for this "
                         "set: imagenet-r, T=10 (Tables 2 and 4): add --dataset imagenet-r "
                         "--tasks 10")  # the last set's, backbones
    assert jm.main(["--reproduce", "ablation", "--dataset", "imagenet-r", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("T=10, into runs/ablation-imagenet-r-"
                                                            "T10; the paper's numbers: Table 1")


def test_reproduce_resumes_and_writes_the_table(tmp_path, monkeypatch, capsys):
    """Interrupted during its second row, --reproduce skips the finished first row when started
    again, continues the second, and writes table.md from both."""
    argv = _flag(_flag(TINY, "--tasks", "2"), "--epochs", "1") + [
        "--reproduce", "gr-plugin", "--out", str(tmp_path)]
    calls, real = [], jm.run_seed

    def run_seed(learner, splits, cfg, *args):
        calls.append(cfg.gr)
        if len(calls) == 2:  # Ctrl-C in the second row
            raise KeyboardInterrupt
        return real(learner, splits, cfg, *args)
    monkeypatch.setattr(jm, "run_seed", run_seed)
    assert jm.main(argv) == 130 and not (tmp_path / "table.md").exists()
    assert jm.main(argv) == 0
    assert calls == [False, True, True]  # lora-gpm once; lora-gpm-gr interrupted, then run
    assert "lora-gpm: finished before, skipped" in capsys.readouterr().out
    table = (tmp_path / "table.md").read_text()
    assert "synthetic, T = 2; the paper gives no numbers for synthetic, T=2; its settings for " \
        "this set: imagenet-r, T=10 (Fig. 6, as printed on the figure): add --dataset" in table
    assert "| lora-gpm | `--method lora-gpm` | 1 |" in table and "| lora-gpm-gr |" in table
    assert set(json.loads((tmp_path / "table.json").read_text())["rows"]) == {"lora-gpm",
                                                                              "lora-gpm-gr"}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, small):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty").mkdir()
    (tmp / "junk.pth").write_bytes(b"this is not a checkpoint" * 10)
    (tmp / "text.pth").write_text("hello world\nline two\n")  # torch.load: KeyError 101
    (tmp / "trunc.pth").write_bytes(small["paths"]["timm"].read_bytes()[:5000])
    (tmp / "noresume").mkdir()
    (tmp / "oldformat").mkdir()
    torch.save({"config": {}, "runs": [], "current": None}, tmp / "oldformat" / "checkpoint.pt")
    tv = torchvision.models.VisionTransformer(224, 16, num_layers=12, num_heads=3, hidden_dim=192,
                                              mlp_dim=768)  # fits TINY's ViT-Ti/16
    sd = tv.state_dict()
    sd["encoder.ln.weight"][3] = float("nan")
    torch.save(sd, tmp / "nan.pth")
    torch.save(vit.vit_tiny_patch16(depth=1, img_size=32), tmp / "module.pth")  # a pickled model
    write_safetensors(tv_to_timm(small["sd"]), tmp / "fp8.st")
    raw = bytearray((tmp / "fp8.st").read_bytes())
    at = raw.index(b'"F32"')
    raw[at:at + 5] = b'"F8X"'  # a dtype we do not read, same length
    (tmp / "fp8.st").write_bytes(bytes(raw))
    _fake_fashion(tmp / "swapped", n_train=20, n_test=40)
    (tmp / "afile").write_text("x")
    (tmp / "with space").mkdir()
    return tmp


def _flag(argv, name, value):
    """argv with one flag's value replaced."""
    return [value if prev == name else a for prev, a in zip([None] + argv, argv)]


CKPT = _flag(TINY, "--patch-size", "16")  # the checkpoints are ViT-*/16
BAD_INPUTS = {  # id: (argv, what the one line must say); {tmp} is the bad_files folder
    "unknown-dataset": (["--dataset", "nope"], "invalid choice"),
    "unknown-model": (["--model", "vit_huge"], "invalid choice"),
    "cifar-empty-dir": (["--dataset", "cifar100", "--data-dir", "{tmp}/empty"], "--data-dir"),
    "cifar-absent-dir": (["--dataset", "cifar100", "--data-dir", "{tmp}/absent"], "--data-dir"),
    "fashion-missing": (["--dataset", "fashion-mnist", "--data-dir", "{tmp}/none"], "--data-dir"),
    "weights-truncated": (CKPT + ["--weights", "{tmp}/trunc.pth"], "trunc.pth"),
    "weights-junk": (CKPT + ["--weights", "{tmp}/junk.pth"], "junk.pth"),
    "weights-a-text-file": (CKPT + ["--weights", "{tmp}/text.pth"], "text.pth is not a checkpoint: "
                            "neither a zip (torch.save), a pickle, an .npz nor a .safetensors"),
    "weights-misfit": (CKPT + ["--weights", "SMALL"], "does not fit this ViT"),
    "input-range-of-a-file": (CKPT + ["--weights", "SMALL", "--input-range", "checkpoint"],
                              "--input-range half"),
    "k-zero": (TINY + ["--k", "0"], "--k"), "k-too-wide": (TINY + ["--k", "193"], "--k"),
    "rank-zero": (TINY + ["--rank", "0"], "--rank"),
    "tasks-not-dividing": (TINY + ["--tasks", "5"], "does not divide"),
    "tasks-of-one-class": (TINY + ["--tasks", "12"], "--tasks 12 leaves one class per task"),
    "epochs-zero": (TINY + ["--epochs", "0"], "--epochs"),
    "batch-zero": (TINY + ["--batch-size", "0"], "--batch-size"),
    "lr-negative": (TINY + ["--lr", "-1"], "--lr"),
    "margin-negative": (TINY + ["--margin", "-0.1"], "--margin"),
    "tau-negative": (TINY + ["--tau", "-1"], "--tau"),
    "resume-without-checkpoint": (TINY + ["--resume", "{tmp}/noresume"], "no checkpoint.pt"),
    "resume-old-format": (TINY + ["--resume", "{tmp}/oldformat"], "another version"),
    "device-absent-gpu": (TINY + ["--device", f"cuda:{torch.cuda.device_count() + 7}"], "cuda"),
    "device-unknown": (TINY + ["--device", "tpu"], "--device"),
    "delta-zero": (TINY + ["--delta", "0"], "--delta"),
    "lambda-nan": (TINY + ["--lambda-dml", "nan"], "finite"),
    "scale-inf": (TINY + ["--lora-scale", "inf"], "finite"),
    "lambda-negative": (TINY + ["--lambda-dml", "-1"], "--lambda-dml"),
    "patch-zero": (TINY + ["--patch-size", "0"], "--patch-size"),
    "img-size-negative": (TINY + ["--img-size", "-16"], "--img-size"),
    "seed-too-large": (TINY + ["--seeds", "99999999999999999999"], "--seeds"),
    "seed-above-2^32": (TINY + ["--seeds", str(2**32)], "0 .. 2^32 - 1"),
    "seeds-duplicated": (TINY + ["--seeds", "0", "1", "0"], "each seed once"),
    "rank-too-wide": (TINY + ["--rank", "193"], "--rank must lie in 1..192"),
    "lr-zero": (TINY + ["--lr", "0"], "--lr must be positive"),
    "weights-nan": (CKPT + ["--weights", "{tmp}/nan.pth"], "NaN or inf values (encoder.ln.weight)"),
    "weights-pickled-module": (CKPT + ["--weights", "{tmp}/module.pth"], "pickled model object"),
    "weights-safetensors-dtype": (CKPT + ["--weights", "{tmp}/fp8.st"], "safetensors dtype F8X"),
    "fashion-swapped": (["--dataset", "fashion-mnist", "--data-dir", "{tmp}/swapped"], "swapped"),
    "data-dir-a-file": (["--dataset", "cifar100", "--data-dir", "{tmp}/afile"], "is a file"),
    "path-with-a-space": (["--dataset", "fashion-mnist", "--data-dir", "{tmp}/with space/x"],
                          "--data-dir '"),
    "out-empty": (TINY + ["--out", ""], '--out "": name a folder'),
    "out-under-a-file": (TINY + ["--out", "{tmp}/afile/run"], "afile is a file, not a folder"),
    "reproduce-unknown-row": (TINY + ["--reproduce", "gr-plugin", "--row", "7"],
                              "has the rows lora-gpm, lora-gpm-gr"),
    "dry-run-without-reproduce": (TINY + ["--dry-run"], "add --reproduce NAME, or drop --dry-run"),
    "dry-run-with-method": (["--method", "finetune", "--dry-run"], "drop --dry-run to train"),
    "flag-a-preset-makes-meaningless": (["--method", "finetune", "--memory", "gpm"], "--memory "
                                        "has no effect with --method finetune (its --no-oe)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_one_clear_line_and_leaves_dir_alone(case, bad_files, small, tmp_path,
                                                            capsys):
    argv, needle = BAD_INPUTS[case]
    argv = [a.format(tmp=bad_files).replace("SMALL", str(small["paths"]["timm"])) for a in argv]
    out = tmp_path / "previous"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    try:
        code = jm.main(argv + ["--out", str(out)] * ("--out" not in argv))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0] and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    assert not (bad_files / "absent").exists()  # a failed download leaves no folder behind


def test_a_folder_with_a_run_a_changed_resume_a_file_out_and_a_diverging_run(tiny_run, tmp_path,
                                                                              capsys):
    assert jm.main(TINY + ["--out", str(tiny_run["out"])]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert jm.main(TINY + ["--resume", str(tiny_run["out"]), "--rank", "4"]) == 2
    assert "the run there has --rank 10; drop those flags" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert jm.main(TINY + ["--out", str(tmp_path / "afile")]) == 2
    assert "is a file" in capsys.readouterr().err
    # a non-finite loss stops the run with one line, not a results.json of nonsense
    assert jm.main(TINY + ["--lr", "1e30", "--out", str(tmp_path / "nan")]) == 2
    assert "the loss is nan" in capsys.readouterr().err
    assert not (tmp_path / "nan" / "results.json").exists()


def test_a_loss_grown_by_orders_of_magnitude_is_flagged_not_written_up_as_valid(tmp_path):
    big = tmp_path / "big"
    assert jm.main(_flag(TINY, "--tasks", "1") + ["--lr", "10", "--out", str(big)]) == 0
    assert "WARNING: the loss is diverging" in (big / "log.txt").read_text()
    assert "not a valid run" in _results(big)["runs"][0]["warnings"][0]


def test_bwt_is_undefined_with_one_task():
    assert jm.metrics([[80.0]])["BWT"] is None
    run = {"ACC": 80.0, "MAA": 80.0, "BWT": None, "sample_acc": [80.0],
           "task_aware": {"ACC": 80.0, "MAA": 80.0, "BWT": None}}
    assert jm.summarize([run])["BWT"] == {"mean": None, "std": None}


def test_resume_of_a_folder_with_results_but_no_checkpoint(tiny_run, tmp_path, capsys):
    shutil.copytree(tiny_run["out"], tmp_path / "r")
    (tmp_path / "r" / "checkpoint.pt").unlink()
    assert jm.main(["--resume", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "its results.json stays as it is" in err and "start a new run with --out" in err


def test_resume_adds_seeds_to_a_finished_run_and_refuses_dropping_them(tiny_run, tmp_path, capsys):
    shutil.copytree(tiny_run["out"], tmp_path / "r")
    assert jm.main(["--resume", str(tmp_path / "r"), "--seeds", "1"]) == 2
    assert "its seeds are 0; give those (and more, to add seeds)" in capsys.readouterr().err
    assert jm.main(["--resume", str(tmp_path / "r"), "--seeds", "0", "1", "--workers", "3"]) == 0
    res = _results(tmp_path / "r")
    assert [r["seed"] for r in res["runs"]] == [0, 1]
    assert res["runs"][0] == tiny_run["res"]["runs"][0]  # the finished seed is kept as it was
    assert res["config"]["seeds"] == [0, 1] and res["config"]["out"] == str(tmp_path / "r")


def test_reproduce_row_runs_that_row_alone(capsys):
    argv = ["--reproduce", "gr-plugin", "--row", "lora-gpm-gr", "--dry-run", "--out", "R"]
    assert jm.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if ": python janus_min" in line]
    assert rows == ["lora-gpm-gr: python janus_min.py --method lora-gpm-gr --out R/lora-gpm-gr"]


def test_reproduce_leaves_out_the_flags_a_rows_preset_makes_meaningless(capsys):
    """The README shares --k 32 among --reproduce's rows: a preset without OE's basis (finetune,
    GPM's memory) or without DML does not get --k or --margin, and each command runs as printed."""
    assert jm.main(["--reproduce", "methods", "--k", "32", "--margin", "0.2", "--dry-run"]) == 0
    lines = [line.split(": python janus_min.py ") for line in capsys.readouterr().out.splitlines()]
    rows = {line[0]: shlex.split(line[1]) for line in lines if len(line) == 2}
    assert [argv[:-2] for argv in rows.values()] == [["--method", "finetune"],
                                                     ["--method", "lora-gpm"],
                                                     ["--method", "inflora"],
                                                     ["--k", "32", "--margin", "0.2", "--method",
                                                      "janus"]]
    assert all(jm.configure(argv)[0].method == row for row, argv in rows.items())
    assert jm.configure(["--method", "lora-gpm", "--memory", "oe", "--k", "16"])[0].k == 16


def test_reproduce_prints_commands_that_paste_with_a_space_in_out(capsys):
    assert jm.main(["--reproduce", "gr-plugin", "--dry-run", "--out", "dir x/abl"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if ": python janus_min" in line]
    argvs = [shlex.split(line.partition(": python janus_min.py ")[2]) for line in rows]
    rows = ("lora-gpm", "lora-gpm-gr")
    assert argvs == [["--method", m, "--out", f"dir x/abl/{m}"] for m in rows]


@pytest.mark.parametrize("flags, mean_std", [
    ([], (0.0, 1.0)), (["--input-range", "checkpoint"], vit.MEAN_STD["half"]),
    (["--input-range", "checkpoint", "--weights", "dino"], vit.MEAN_STD["imagenet"]),
    (["--input-range", "imagenet"], vit.MEAN_STD["imagenet"])])
def test_input_range_reaches_the_data(monkeypatch, flags, mean_std):
    seen = []

    def load_dataset(name, data_dir, img_size, mean, std, **kw):
        seen.append((mean, std))
        raise data.DataError("stop here")
    monkeypatch.setattr(data, "load_dataset", load_dataset)
    assert jm.main(["--dataset", "cifar100", "--model", "vit_base"] + flags) == 2
    assert seen == [mean_std]
