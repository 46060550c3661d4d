"""Property checks for Janus-LoRA minimal: each asserts an identity, an oracle or a bound that
breaks when the code is wrong. CPU, random weights, files the tests write; the method on CUDA too.
"""
import contextlib
import copy
import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import io
import itertools
import json
import math
import multiprocessing
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

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
def no_network(monkeypatch):  # every test runs offline: no data set or checkpoint downloads
    def offline(*args, **kwargs):
        raise urllib.error.URLError("the tests run offline")
    monkeypatch.setattr(urllib.request, "urlopen", offline)  # torchvision's dataset downloads
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)  # vit.load_pretrained


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def orthonormal(d, m, dtype=torch.float64, device="cpu", gen=None):
    return torch.linalg.qr(torch.randn(d, m, dtype=dtype, generator=gen).to(device)).Q


# ============================ vit.py: the backbone, checkpoint loading ============================
_TV_TO_TIMM = [(r"^class_token$", "cls_token"), (r"^encoder\.pos_embedding$", "pos_embed"),
               (r"^conv_proj\.", "patch_embed.proj."), (r"^encoder\.ln\.", "norm."),
               (r"^heads\.head\.", "head."), (r"\.ln_1\.", ".norm1."), (r"\.ln_2\.", ".norm2."),
               (r"^encoder\.layers\.encoder_layer_(\d+)\.", r"blocks.\1."),
               (r"\.self_attention\.in_proj_", ".attn.qkv."), (r"\.mlp\.0\.", ".mlp.fc1."),
               (r"\.self_attention\.out_proj\.", ".attn.proj."), (r"\.mlp\.3\.", ".mlp.fc2.")]


def tv_to_timm(sd):  # a torchvision state dict in the timm layout (fused qkv, patch_embed.proj)
    return {functools.reduce(lambda k, rule: re.sub(*rule, k), _TV_TO_TIMM, k): v.clone()
            for k, v in sd.items()}


def write_npz(sd, path, heads):  # AugReg's layout: HWIO conv, (in, out) dense, per-head q/k/v/out
    d, e = sd["class_token"].shape[-1], "Transformer/encoder"
    a = {"embedding/kernel": sd["conv_proj.weight"].permute(2, 3, 1, 0), "cls": sd["class_token"],
         "embedding/bias": sd["conv_proj.bias"], e + "_norm/bias": sd["encoder.ln.bias"],
         "Transformer/posembed_input/pos_embedding": sd["encoder.pos_embedding"],
         e + "_norm/scale": sd["encoder.ln.weight"],
         "head/kernel": sd["heads.head.weight"].T, "head/bias": sd["heads.head.bias"]}
    for i in range(sum(k.endswith("ln_1.weight") for k in sd)):
        t, g = f"encoder.layers.encoder_layer_{i}.", f"{e}block_{i}/"
        m, att = g + "MultiHeadDotProductAttention_1/", t + "self_attention."
        for ln, j in (("ln_1", 0), ("ln_2", 2)):
            a[f"{g}LayerNorm_{j}/scale"] = sd[t + ln + ".weight"]
            a[f"{g}LayerNorm_{j}/bias"] = sd[t + ln + ".bias"]
        ws, bs = sd[att + "in_proj_weight"].chunk(3), sd[att + "in_proj_bias"].chunk(3)
        for name, w, b in zip(("query", "key", "value"), ws, bs):
            a[m + name + "/kernel"] = w.T.reshape(d, heads, d // heads)
            a[m + name + "/bias"] = b.reshape(heads, d // heads)
        a[m + "out/kernel"] = sd[att + "out_proj.weight"].T.reshape(heads, d // heads, d)
        a[m + "out/bias"] = sd[att + "out_proj.bias"]
        for n, j in ((0, 0), (1, 3)):
            a[f"{g}MlpBlock_3/Dense_{n}/kernel"] = sd[f"{t}mlp.{j}.weight"].T
            a[f"{g}MlpBlock_3/Dense_{n}/bias"] = sd[f"{t}mlp.{j}.bias"]
    with open(path, "wb") as f:  # a file object: np.savez adds no .npz suffix to it
        np.savez(f, **{k: v.numpy() for k, v in a.items()})


def features(model, x):
    if isinstance(model, torchvision.models.VisionTransformer):
        model.heads = torch.nn.Identity()  # its forward then returns the normed class token
    with torch.no_grad():
        return model.eval()(x)


def load(model, source):
    """vit.load_pretrained's one printed line, which names the path it returns (a file: itself)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        path = vit.load_pretrained(model, source)
    line = out.getvalue()
    assert line.count("\n") == 1, line
    if source == "none":
        assert path is None
    else:
        assert line.startswith(f"[vit] {path}: ")
    assert source in vit.URLS or source == "none" or path == str(source)
    return line


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-block Ti-width torchvision ViT: its weights in each key layout and file, an input x,
    and torchvision's features of x (ref)."""
    torch.manual_seed(1)
    tv = torchvision.models.VisionTransformer(224, 16, 2, 3, 192, 768)  # 2 layers, 3 heads
    x = torch.randn(3, 3, 224, 224)
    sd = {k: v.clone() for k, v in tv.state_dict().items()}
    folder = tmp_path_factory.mktemp("small")
    paths = {layout: folder / f"w.{layout}" for layout in ("npz", "timm", "ours")}
    write_npz(sd, paths["npz"], heads=3)
    torch.save(tv_to_timm(sd), paths["timm"])
    plain = vit.PRESETS["vit_tiny"](depth=2)
    load(plain, paths["timm"])
    torch.save(plain.state_dict(), paths["ours"])  # a plain ViT's own state dict
    return dict(tv=sd, timm=tv_to_timm(sd), ours=plain.state_dict(), x=x, ref=features(tv, x),
                paths=paths)


def _bytes(edit, layout):  # writes edit(the bytes of the small file in layout); bytes: a copy
    return lambda small, path: path.write_bytes(edit(small["paths"][layout].read_bytes()))


def _torch(edit, layout="timm", **kwargs):  # torch.save(edit(a copy of a small state dict))
    return lambda small, path: torch.save(edit(dict(small[layout])), path, **kwargs)


def _with_pre_logits(small, path):  # the small npz file plus a pre-logits layer, as some have
    with np.load(small["paths"]["npz"]) as z:
        arrays = dict(z)
    arrays.update({"pre_logits/kernel": np.zeros((192, 192), np.float32),
                   "pre_logits/bias": np.zeros(192, np.float32)})
    with open(path, "wb") as f:
        np.savez(f, **arrays)


HEADS = {"npz": "head/bias, head/kernel", "timm": "head.bias, head.weight", "ours": "none"}
GOOD = {  # id: (how to write the file w, its container, its key layout, the keys it ignores)
    "npz": (_bytes(bytes, "npz"), "npz", "npz", HEADS["npz"]),
    "npz-pre-logits": (_with_pre_logits, "npz", "npz",
                       HEADS["npz"] + ", pre_logits/bias, pre_logits/kernel"),
    "timm": (_bytes(bytes, "timm"), "torch", "timm", HEADS["timm"]),
    "ours": (_bytes(bytes, "ours"), "torch", "ours", HEADS["ours"]),
    "model-wrapper": (_torch(lambda sd: {"model": sd, "epoch": 3}), "torch", "timm", HEADS["timm"]),
    "state_dict-wrapper": (_torch(lambda sd: {"state_dict": sd}, "ours"), "torch", "ours",
                           HEADS["ours"]),
    "legacy-pickle": (_torch(dict, _use_new_zipfile_serialization=False), "torch", "timm",
                      HEADS["timm"])}


@pytest.mark.parametrize("case", GOOD)
def test_every_format_loads_the_same_weights(small, tmp_path, case):
    """Each container and key layout fills all 38 tensors: torchvision's features within 1e-5."""
    write, container, layout, ignored = GOOD[case]
    write(small, tmp_path / "w")
    model = vit.PRESETS["vit_tiny"](depth=2)
    line = load(model, tmp_path / "w")
    assert line.endswith(f"w: {container} file, {layout} key layout, 38 tensors loaded, ignored "
                         f"checkpoint keys: {ignored}\n")
    assert (features(model, small["x"]) - small["ref"]).abs().max() <= 1e-5


def test_vit_b16_matches_torchvision(tmp_path):
    """ViT-B/16 from torchvision's weights in timm's layout: its features, and as many parameters
    as torchvision's ViT-B/16 less its classifier."""
    torch.manual_seed(0)
    tv = torchvision.models.vit_b_16()
    x = torch.randn(2, 3, 224, 224)
    torch.save(tv_to_timm(tv.state_dict()), tmp_path / "w")
    model = vit.PRESETS["vit_base"]()
    assert load(model, tmp_path / "w").endswith("w: torch file, timm key layout, 198 tensors "
                                                "loaded, ignored checkpoint keys: head.bias, "
                                                "head.weight\n")
    backbone = sum(p.numel() for name, p in tv.named_parameters() if not name.startswith("heads."))
    assert sum(p.numel() for p in model.parameters()) == backbone == 85_798_656
    assert (features(model, x) - features(tv, x)).abs().max() <= 1e-4


class LoRAish(torch.nn.Linear):
    """nn.Linear plus a parameter of its own, A, as the method's LoRA layer; it keeps its inputs."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.A = torch.nn.Parameter(torch.zeros(out_features, in_features))
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x)
        return super().forward(x) + F.linear(x, self.A)


def test_a_kv_layer_with_parameters_of_its_own_loads(small):
    """kv_layer builds K and V, both fed h = norm1(x), encode's K/V input (bf16 under autocast);
    loading fills the ViT's tensors, leaves the K/V layer's own, and A = 0 is the plain ViT."""
    model = vit.PRESETS["vit_tiny"](depth=2, kv_layer=LoRAish)
    plain = vit.PRESETS["vit_tiny"](depth=2)
    kv = [layer for block in model.blocks for layer in (block.attn.k, block.attn.v)]
    assert all(type(layer) is LoRAish for layer in kv)
    q_proj = [layer for block in model.blocks for layer in (block.attn.q, block.attn.proj)]
    assert all(type(layer) is torch.nn.Linear for layer in q_proj)
    with torch.no_grad():
        for layer in kv:
            layer.A.normal_()
    own = [layer.A.clone() for layer in kv]
    load(model, small["paths"]["npz"])
    load(plain, small["paths"]["npz"])
    assert all(torch.equal(layer.A, a) for layer, a in zip(kv, own))
    assert (features(model, small["x"]) - small["ref"]).abs().max() > 1e-2  # A is in K and V
    with torch.no_grad():
        for layer in kv:
            layer.A.zero_()
            layer.inputs.clear()
        z, kv_inputs = model.encode(small["x"])
    assert torch.equal(z, features(plain, small["x"]))
    assert len(kv_inputs) == 2 and kv_inputs[0].shape == (3, 197, 192)
    assert all(layer.inputs == [kv_inputs[j // 2]] for j, layer in enumerate(kv))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        kv_inputs = model.encode(small["x"][:1])[1]
    assert all(h.dtype == torch.bfloat16 for h in kv_inputs)
    assert all(layer.inputs[-1] is kv_inputs[j // 2] for j, layer in enumerate(kv))


def test_seeded_construction_draws_in_the_documented_order():
    """A seeded ViT draws as patch_embed, cls_token, pos_embed, then per block q, proj, k, v, fc1,
    fc2 (LayerNorms draw nothing), and nothing more: seeded runs repeat across versions."""
    torch.manual_seed(0)
    sd = vit.PRESETS["vit_tiny"](depth=2, img_size=32).state_dict()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    d = 192
    expected = {"patch_embed.weight": torch.nn.Conv2d(3, d, 16, stride=16).weight}
    expected["cls_token"] = torch.nn.init.trunc_normal_(torch.empty(1, 1, d), std=0.02)
    expected["pos_embed"] = torch.nn.init.trunc_normal_(torch.empty(1, 5, d), std=0.02)
    for i in range(2):
        for name, shape in [("attn.q", (d, d)), ("attn.proj", (d, d)), ("attn.k", (d, d)),
                            ("attn.v", (d, d)), ("mlp.fc1", (d, 4 * d)), ("mlp.fc2", (4 * d, d))]:
            layer = torch.nn.Linear(*shape)
            expected[f"blocks.{i}.{name}.weight"] = layer.weight
            expected[f"blocks.{i}.{name}.bias"] = layer.bias
    assert torch.equal(torch.get_rng_state(), after)
    assert all(torch.equal(sd[k], v) for k, v in expected.items())


def _with_nan(sd):  # a NaN in V's rows of block 1's fused qkv
    qkv = sd["blocks.1.attn.qkv.weight"].clone()
    qkv[-1, 0] = float("nan")
    return {**sd, "blocks.1.attn.qkv.weight": qkv}


NOT_A_NAME = r"is neither a known name \(in21k, sam, dino, none\) nor a file; pass another file"
BAD = {  # id: (how to write the file w, what the error must say[, preset, depth: not vit_tiny, 2])
    "missing": (_torch(lambda sd: {k: v for k, v in sd.items() if k != "blocks.1.norm2.bias"}),
                r"\(timm layout\).*missing keys \(1\): blocks\.1\.norm2\.bias;"),
    "unexpected": (_torch(lambda sd: {**sd, "blocks.0.extra": torch.zeros(1)}),
                   r"unexpected keys \(1\): blocks\.0\.extra;"),
    "lora-keys": (_torch(lambda sd: {**sd, "blocks.0.attn.k.A": torch.zeros(4, 192),
                                     "blocks.0.attn.k.B": torch.zeros(192, 4)}, "ours"),
                  r"\(ours layout\).*unexpected keys \(2\): blocks\.0\.attn\.k\.A, blocks\.0\."),
    "wider": (_torch(dict), r"width 384, 2 blocks.*shape mism.*cls_token \(1, 1, 192\) vs "
              r"cls_token \(1, 1, 384\)", "vit_small", 2),
    "deeper": (_bytes(bytes, "npz"), r"missing keys \(16\): Transformer/encoderblock_2/",
               "vit_tiny", 3),
    "no-vit": (_torch(lambda sd: {"foo": torch.zeros(2)}),  # not "(npz layout)", the first one's
               r"w fits none of the key layouts \(npz, timm, ours\), .*; its keys \(1\): foo;"),
    "no-dict": (_torch(lambda sd: list(sd.values())), r"w fits none .*; its keys \(0\): none;"),
    "nan": (_torch(_with_nan), r"NaN or inf values \(blocks\.1\.attn\.qkv\.weight\);"),
    "a-module": (_torch(lambda sd: torch.nn.Linear(2, 2)), "w: it pickles a Python object"),
    "text": (lambda small, path: path.write_text("notes\n"), "w is not a checkpoint"),
    "absent": (lambda small, path: None, r"^--weights /\S+/w " + NOT_A_NAME),
    "unknown-name": (lambda small, path: None, r"^--weights imagenet " + NOT_A_NAME),
    **{f"truncated-{layout}": (_bytes(lambda raw: raw[:len(raw) // 2], layout),
                               "w: truncated or corrupt") for layout in ("npz", "timm", "ours")}}


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoints_fail_with_a_named_problem(small, tmp_path, case):
    """Each bad file or source: a CheckpointError that names the problem; the model untouched."""
    write, pattern, preset, depth = (BAD[case] + ("vit_tiny", 2))[:4]
    write(small, tmp_path / "w")
    source = "imagenet" if case == "unknown-name" else tmp_path / "w"
    model = vit.PRESETS[preset](depth=depth)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(vit.CheckpointError, match=pattern):
        vit.load_pretrained(model, source)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("img_size, grid", [(384, 24), (32, 2)])
def test_position_embedding_is_resized(small, img_size, grid):
    """Another resolution: the 14x14 grid resized as timm's (bicubic, antialiased), class kept."""
    model = vit.PRESETS["vit_tiny"](depth=2, img_size=img_size)
    assert f"resized 14x14 -> {grid}x{grid}, " in load(model, small["paths"]["timm"])
    pos = small["timm"]["pos_embed"]
    tokens = pos[:, 1:].reshape(1, 14, 14, 192).permute(0, 3, 1, 2)
    tokens = F.interpolate(tokens, (grid, grid), mode="bicubic", antialias=True).flatten(2).mT
    assert torch.allclose(model.pos_embed, torch.cat([pos[:, :1], tokens], 1), atol=1e-6)
    assert torch.isfinite(features(model, torch.randn(2, 3, img_size, img_size))).all()


def test_named_sources_offline_and_in_the_hub_cache(small, tmp_path, monkeypatch):
    """Offline, a name says where to put its file; once in the hub cache, it loads from there
    (one download); 'none' leaves the model as it is."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    for preset, source in [("vit_tiny", "in21k"), ("vit_base", "sam"), ("vit_base", "dino")]:
        url = vit.URLS[source][vit.PRESETS[preset].keywords["embed_dim"]]
        with pytest.raises(vit.CheckpointError) as e:  # the no_network fixture's URLError
            vit.load_pretrained(vit.PRESETS[preset](depth=1), source)
        for needle in (url, f'{tmp_path}/checkpoints/{url.rsplit("/", 1)[1]}', "--weights PATH",
                       "--weights none"):  # where to put the file; a quick try without it
            assert needle in str(e.value)
    with pytest.raises(vit.CheckpointError, match="no 'dino' weights for a ViT of width 192"):
        vit.load_pretrained(vit.PRESETS["vit_tiny"](depth=1), "dino")
    model = vit.PRESETS["vit_tiny"](depth=1)
    before = copy.deepcopy(model.state_dict())
    assert "--weights none" in load(model, "none")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    in21k = vit.URLS["in21k"][192]
    cached = f'{tmp_path}/checkpoints/{in21k.rsplit("/", 1)[1]}'
    calls = []

    def download(url, dst, **kwargs):  # stands in for the network
        calls.append((url, dst))
        shutil.copyfile(small["paths"]["npz"], dst)
    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    for _ in range(2):  # the second call finds the cached file
        model = vit.PRESETS["vit_tiny"](depth=2)
        assert load(model, "in21k").startswith(f"[vit] {cached}: npz file")
        assert (features(model, small["x"]) - small["ref"]).abs().max() <= 1e-5
    assert calls == [(in21k, cached)]


# ======================== data.py: data sets, task splits, seeded loaders ========================
MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")
WNIDS = [f"n{c:08d}" for c in range(200)]  # data sets from files the tests write


def _load(name, root, size=32, **kw):
    return data.load_dataset(name, root, size, *MEAN_STD, download=False, **kw)


def test_task_classes_the_synthetic_set_and_thin():
    """task_classes: contiguous, disjoint, covering; synthetic: seeded, disjoint; thin: a seeded
    draw per class, in the set's order."""
    for classes, tasks in [(100, 10), (200, 20), (345, 5), (12, 3), (10, 5)]:
        split = data.task_classes(classes, tasks)
        assert len(split) == tasks and all(len(t) == classes // tasks for t in split)
        assert sorted(c for t in split for c in t) == list(range(classes))  # disjoint, covering
        assert all(t == list(range(t[0], t[0] + len(t))) for t in split)  # contiguous, in order
    for classes, tasks in [(100, 7), (10, 0), (10, -2), (10, 10)]:  # 10: one class per task
        with pytest.raises(data.DataError, match=f"pick a divisor of {classes} up to"):
            data.task_classes(classes, tasks)
    a, b, c = (_load("synthetic", None, seed=s) for s in (3, 3, 4))
    assert a.num_classes == 12 and (len(a.train), len(a.test)) == (12 * 24, 12 * 8)
    x, y = a.train[5]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and isinstance(y, int)
    assert torch.equal(a.train.source, b.train.source) and torch.equal(a.test.source, b.test.source)
    assert not torch.equal(a.train.source, c.train.source)
    assert sorted(set(a.train.targets)) == list(range(12)) == sorted(set(a.test.targets))
    train, test = a.train.source.flatten(1), a.test.source.flatten(1)
    assert not (train[:, None] == test[None]).all(-1).any()  # no test image is a training image
    assert torch.equal(a.train_eval[3][0], a.train[3][0])  # synthetic: no augmentation
    assert _load("synthetic", None, 48).train[0][0].shape == (3, 48, 48)
    five, again, other = (data.thin(a, 5, seed) for seed in (0, 0, 1))
    assert np.bincount(five.train.targets).tolist() == [5] * 12
    assert torch.equal(five.train.source, again.train.source)  # the seed's draw ...
    assert not torch.equal(five.train.source, other.train.source)  # ... and another seed's
    where = {tuple(t.flatten().tolist()): i for i, t in enumerate(a.train.source)}
    kept = [where[tuple(t.flatten().tolist())] for t in five.train.source]  # a KeyError if new
    assert kept == sorted(kept) and five.train.targets == [a.train.targets[i] for i in kept]
    assert torch.equal(five.train_eval.source, five.train.source) and five.test is a.test
    assert five.train_eval.transform is a.train_eval.transform
    assert len(data.thin(a, 99, 0).train) == len(a.train) and data.thin(a, None, 0) is a


def _pipeline(source, spec, device, batch_size=64, train=True, seed=0):  # the device pipeline
    ds = data._Images(source, list(range(len(source))), None, spec)  # label i: image i
    return data.DeviceLoader(ds, batch_size, train, seed, torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
def test_device_loader_draws_depend_on_the_seed_only(device):
    """Order, crops and flips from the seed alone, new each epoch; eval: the set's order, as is."""
    src = np.random.default_rng(0).integers(0, 256, (30, 3, 12, 12), dtype=np.uint8)  # CIFAR's
    train, test = data.Batched(16, True, True, *MEAN_STD), data.Batched(16, False, False, *MEAN_STD)

    def epoch(spec, seed, loader=None):  # [images, labels] of a new loader's first epoch
        loader = _pipeline(src, spec, device, 8, spec is train, seed) if loader is None else loader
        return [torch.cat(t).cpu() for t in zip(*loader)]

    def same(u, v):
        return all(torch.equal(p, q) for p, q in zip(u, v))
    state, a = torch.get_rng_state(), _pipeline(src, train, device, 8, True, 5)
    assert len(a) == 4 and [len(y) for _, y in a] == [8, 8, 8, 6]  # a's first epoch
    first, second = epoch(train, 5), epoch(train, 5, a)
    assert same(first, epoch(train, 5)) and not same(first, epoch(train, 6))
    assert not same(first, second)  # each epoch: a new order and new crops
    assert sorted(first[1].tolist()) == list(range(30)) != first[1].tolist()  # shuffled
    assert torch.equal(state, torch.get_rng_state())  # the loader draws from its own generator
    x, y = epoch(test, 5)
    assert y.tolist() == list(range(30)) and same([x], epoch(test, 6))
    crops = first[0][first[1].argsort()]  # image i in row i, as x: cropped, not only flipped
    assert not all(torch.equal(c, p) or torch.equal(c, p.flip(-1)) for c, p in zip(crops, x))


def _ks(a, b):  # two-sample Kolmogorov-Smirnov statistic: largest gap of the CDFs
    a, b = a.double().sort().values, b.double().sort().values
    both = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, both, right=True) / len(a)
    cdf_b = torch.searchsorted(b, both, right=True) / len(b)
    return float((cdf_a - cdf_b).abs().max())


# on 4 x 40 px most draws fall back to torchvision's centre box of ratio 4/3: (0, 17, 4, 5)
@pytest.mark.parametrize("height, width, fallback", [(32, 32, None), (4, 40, [0, 17, 4, 5])])
def test_crop_boxes_follow_torchvisions_distribution(height, width, fallback):
    """crop_boxes draws as RandomResizedCrop.get_params: KS-close laws, the fallback as often."""
    n, m = 20000, 4000
    ours = data.crop_boxes(torch.Generator().manual_seed(1), n, height, width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        img = torch.zeros(1, height, width)
        theirs = torch.tensor([torchvision.transforms.RandomResizedCrop.get_params(
            img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(m)])  # (m, 4) top, left, h, w
    # KS critical value c sqrt(1/n + 1/m), c = sqrt(ln(2 / alpha) / 2) = 1.95 at alpha = 1e-3
    bound = 1.95 * math.sqrt(1 / n + 1 / m)
    laws = ([*t.double().T, t[:, 2] * t[:, 3], t[:, 3] / t[:, 2]] for t in (ours, theirs))
    for a, b in zip(*laws):  # top, left, h, w, area, aspect
        assert _ks(a, b) < bound
    if fallback:  # its share: a step of the CDFs, within the same bound
        share = [float((t == torch.tensor(fallback)).all(1).double().mean()) for t in
                 (ours, theirs)]
        assert share[1] > 0.5 and abs(share[0] - share[1]) < bound


@pytest.mark.parametrize("device", DEVICES)
def test_device_transforms_are_torchvisions_crops_exact_flips_and_the_normalised_image(device):
    """resized_crops = torchvision's box by box; flips: exact, half the time; (x / 255 - m) / s."""
    gen = torch.Generator().manual_seed(0)
    x, boxes = torch.rand(64, 3, 20, 24, generator=gen), data.crop_boxes(gen, 64, 20, 24)
    boxes[0] = torch.tensor([0, 0, 20, 24])  # the whole image too
    no_flip = torch.zeros(64, dtype=torch.bool, device=device)
    for size in (48, 8):  # 8 px: most crops of the 20 x 24 image downsample; bilinear, antialiased
        out = data.resized_crops(x.to(device), boxes.to(device), size, no_flip).cpu()
        ref = torch.stack([torchvision.transforms.functional.resized_crop(
            img, *box.tolist(), [size, size], antialias=True) for img, box in zip(x, boxes)])
        # float32 round-off on [0, 1] values is ~1e-6 (2e-6 seen); a wrong weight or shift ~1e-2
        assert float((out - ref).abs().max()) < 1e-5
    n, gen = 2000, torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (n, 3, 6, 6), dtype=torch.uint8, generator=gen)  # never symmetric
    mirrored = []
    for x, y in _pipeline(src, data.Batched(6, False, True, 0.0, 1.0), device, batch_size=500):
        x, plain = x.cpu(), src[y.cpu()].float() / 255  # (B, 3, 6, 6)
        # CUDA's x / 255 is x * (1 / 255): a rounding apart, far below a pixel's 1/255 to its mirror
        same, flipped = (((x - v).abs() < 1e-6).flatten(1).all(1) for v in (plain, plain.flip(-1)))
        assert (same ^ flipped).all()
        mirrored.append(flipped)
    # Binomial(2000, 1/2): standard deviation 0.011, five of them allowed
    assert abs(float(torch.cat(mirrored).double().mean()) - 0.5) < 5 * 0.5 / math.sqrt(n)
    rng = np.random.default_rng(0)
    for channels, mean, std in ((3, (0.1, 0.4, 0.7), (0.2, 0.5, 2.0)), (1, 0.3, 0.5)):  # grey:
        src = rng.integers(0, 256, (5, channels, 9, 9), dtype=np.uint8)  # 3 channels, whatever
        spec = data.Batched(9, False, False, mean, std)
        x, _ = next(iter(_pipeline(src, spec, device, 5, False)))
        m, s = (torch.tensor(v, device=device).view(-1, 1, 1) for v in (mean, std))
        chw = torch.from_numpy(src).expand(-1, 3, -1, -1).to(device)  # the mean and std's shape
        assert torch.equal(x, (chw.float() / 255 - m) / s)  # weights 0 and 1: exact


def _folders(root, wnids, per_class=1):  # root/<wnid>/<i>.png, coloured by class and index
    for c, w in enumerate(wnids):
        (root / w).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 6), (c % 256, i * 40, 0)).save(root / w / f"{i}.png")
    return root


def _fake_fashion(folder, n_train=40, n_test=20):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        for kind, x in (("images-idx3", rng.integers(0, 256, (n, 28, 28))),
                        ("labels-idx1", np.arange(n) % 10)):
            head = struct.pack(f">I{x.ndim}I", 0x800 + x.ndim, *x.shape)  # uint8 data, its shape
            idx = gzip.compress(head + x.astype(np.uint8).tobytes())
            (folder / f"{prefix}-{kind}-ubyte.gz").write_bytes(idx)
    return folder


def _fake_cifar(root):  # torchvision's pickled cifar-100-python: 2 training, 1 test image a class
    rng, folder = np.random.default_rng(0), Path(root) / "cifar-100-python"
    train, test = (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8) for n in (200, 100))
    folder.mkdir(parents=True, exist_ok=True)
    for name, x in (("train", train), ("test", test)):
        rows = np.ascontiguousarray(x.transpose(0, 3, 1, 2)).reshape(len(x), -1)  # (N, 3072)
        labels = [c % 100 for c in range(len(x))]
        entry = {"data": rows, "fine_labels": labels, "coarse_labels": [0] * len(x)}
        (folder / name).write_bytes(pickle.dumps(entry))
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": list(map(str, range(100)))}))
    return folder, train, test


def _fake_domainnet(root):  # 12 lists (domain i: classes i mod 6), empty files in class_<344 - c>/
    for i, domain in enumerate(data.DOMAINS):
        for part, n in (("train", 2), ("test", 1)):
            paths = [f"{domain}/class_{344 - c:03d}/{part}_{c}_{k}.jpg" for c in range(i, 345, 6)
                     for k in range(n)]
            (root / f"{domain}_{part}.txt").write_text("".join(f'{p} {p.split("_")[-2]}\n'
                                                               for p in paths))
            for p in paths:
                (root / p).parent.mkdir(parents=True, exist_ok=True)
                (root / p).touch()


def test_fashion_mnist_files_and_the_batched_pipeline(tmp_path):
    """idx files, gzipped or not; batched: torchvision's resize, + flips to train; workers alike."""
    f = _load("fashion-mnist", _fake_fashion(tmp_path))
    assert (len(f.train), len(f.test), f.num_classes) == (40, 20, 10)
    x, y = f.test[13]
    assert x.shape == (3, 32, 32) and y == 3
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])  # grey copied to three channels
    for d in _fake_fashion(tmp_path / "unpacked").iterdir():  # idx files as gunzip leaves them
        d.with_suffix("").write_bytes(gzip.decompress(d.read_bytes()))
        d.unlink()
    assert torch.equal(_load("fashion-mnist", tmp_path / "unpacked").test[13][0], x)
    grey = torch.from_numpy(f.train.source).float() / 255  # (40, 1, 28, 28)
    ref = (torchvision.transforms.functional.resize(grey, [32, 32], antialias=True) - 0.5) / 0.5
    x, y = next(iter(data.make_loader(f.train_eval, 40, False, 0, seed=0)))  # test transform
    # the crop test's round-off, doubled by the division by std 0.5
    assert x.shape == (40, 3, 32, 32) and y.tolist() == f.train.targets
    assert float((x - ref).abs().max()) < 2e-5
    assert f.train.batched == data.Batched(32, False, True, *MEAN_STD)  # to train: + flips, no crop
    assert data.thin(f, 2, 0).train_eval.batched == f.train_eval.batched  # the test transform's
    s = _load("synthetic", None, 16)  # its test set: 8 images a class, in class order
    by_workers = data._Images(s.test.source, s.test.targets, s.test.transform)  # no batched spec
    parts = [data.subset(ds, [2, 3, 4]) for ds in (s.test, by_workers)]
    assert parts[0].targets == sorted([2, 3, 4] * 8)
    assert torch.equal(parts[0].source, s.test.source[2 * 8:5 * 8])
    loaders = [data.make_loader(part, 8, False, 0, seed=0) for part in parts]
    assert isinstance(loaders[0], data.DeviceLoader) and len(loaders[0]) == len(loaders[1]) == 3
    for (x, y), (u, v) in zip(*loaders):
        assert torch.equal(x, u) and torch.equal(y, v)


@pytest.mark.skipif(not (DEBIAN_FASHION / "train-images-idx3-ubyte.gz").is_file(),
                    reason="no dataset-fashion-mnist")
def test_fashion_mnist_debian():
    s = _load("fashion-mnist", DEBIAN_FASHION, 224)
    assert (len(s.train), len(s.test)) == (60000, 10000)
    assert np.bincount(s.train.targets).tolist() == [6000] * 10
    assert s.test[0][0].shape == (3, 224, 224) and s.test[0][1] == 9  # an ankle boot


@pytest.mark.parametrize("inside", [False, True])  # --data-dir: its parent, or the folder itself
def test_cifar100_reads_the_pickled_folder_without_its_md5(tmp_path, inside):
    """A copy in torchvision's format, not the official one (its MD5 differs), loads exactly."""
    folder, train, test = _fake_cifar(tmp_path)
    s = _load("cifar100", folder if inside else tmp_path)
    for source, hwc in ((s.train.source, train), (s.test.source, test)):
        assert np.array_equal(source, hwc.transpose(0, 3, 1, 2))  # (N, C, H, W)
    assert s.train.targets == [c % 100 for c in range(200)] and s.num_classes == 100
    assert s.train.batched.crop and s.train.batched.flip and not s.test.batched.crop  # InfLoRA's


def test_imagenet_r_split_tar_and_ready_layout(tmp_path):
    """80/20 split saved, reused, redrawn alike; a stale split file, a cut tar named; LAE's layout
    used as it is."""
    _folders(tmp_path / "imagenet-r", WNIDS, 5)
    (tmp_path / "imagenet-r" / ".ipynb_checkpoints").mkdir()  # hidden: no class, no image
    Image.new("RGB", (8, 6)).save(tmp_path / "imagenet-r" / WNIDS[0] / "._0.png")
    a = _load("imagenet-r", tmp_path)
    assert (len(a.train), len(a.test), a.num_classes) == (800, 200, 200)
    assert np.bincount(a.test.targets).tolist() == [1] * 200  # 80/20 in every class
    assert set(a.train.source).isdisjoint(a.test.source)
    assert all(y == int(Path(p).parent.name[1:]) for p, y in zip(a.test.source, a.test.targets))
    assert isinstance(data.make_loader(a.train, 8, True, 0, seed=0, device="cpu"),
                      data._Batches)  # files: the workers' loader, always
    split_file = tmp_path / "imagenet-r_split.json"
    split = json.loads(split_file.read_text())
    assert sorted(split["train"] + split["test"]) == sorted(
        f"{Path(p).parent.name}/{Path(p).name}" for p in a.train.source + a.test.source)
    split_file.unlink()  # drawn again, whatever the run's seed: the same split
    assert _load("imagenet-r", tmp_path, seed=5).test.source == a.test.source
    split["train"], split["test"] = split["train"][1:], split["test"] + split["train"][:1]
    split_file.write_text(json.dumps(split))  # a saved split is reused
    assert len(_load("imagenet-r", tmp_path).test) == 201
    (tmp_path / "imagenet-r" / split["test"][0]).unlink()
    with pytest.raises(data.DataError) as err:  # a listed image gone: the split file named, now
        _load("imagenet-r", tmp_path)
    assert str(err.value).startswith(f"{split_file} cannot be read")
    assert str(err.value).endswith("delete it to split again.")
    split_file.unlink()  # as the message says: split again, from the files that are there
    assert len(_load("imagenet-r", tmp_path).train) == 799
    src, ready = _folders(tmp_path / "src" / "imagenet-r", WNIDS, 5), tmp_path / "ready/imagenet-r"
    with tarfile.open(tmp_path / "full.tar", "w") as tar:
        tar.add(src, arcname="imagenet-r")
    with tarfile.open(tmp_path / "full.tar") as tar:
        cut = tar.getmembers()[600].offset_data + 3  # inside a file's data: 500 images before it
    (tmp_path / "data").mkdir()
    for size in (cut, 3):  # 3 bytes: tarfile's reason, a line per method it tried
        tar = (tmp_path / "full.tar").read_bytes()[:size]
        (tmp_path / "data" / "imagenet-r.tar").write_bytes(tar)
        with pytest.raises(data.DataError) as err:
            _load("imagenet-r", tmp_path / "data")
        assert str(err.value).startswith(f"{tmp_path}/data/imagenet-r.tar cannot be read")
        assert "\n" not in str(err.value)
        assert str(err.value).endswith(f"delete it and fetch it again from {data.IMAGENET_R_URL}.")
        assert os.listdir(tmp_path / "data") == ["imagenet-r.tar"]  # no half a folder left
    shutil.copy(tmp_path / "full.tar", tmp_path / "data" / "imagenet-r.tar")  # fetched again
    assert len(_load("imagenet-r", tmp_path / "data").train) == 800
    ready.mkdir(parents=True)  # LAE's layout, as InfLoRA reads it: used as it is
    src.rename(ready / "train")
    shutil.copytree(ready / "train", ready / "test")
    s = _load("imagenet-r", ready.parent)
    assert (len(s.train), len(s.test)) == (1000, 1000)
    assert not (ready.parent / "imagenet-r_split.json").exists()


def test_domainnet_lists_and_imagenet100_class_list(tmp_path):
    _fake_domainnet(tmp_path)
    Image.new("RGB", (10, 12)).save(tmp_path / "real" / "class_340" / "test_4_0.jpg")
    s = _load("domainnet", tmp_path)
    assert (len(s.train), len(s.test), s.num_classes) == (345 * 2, 345, 345)
    x, y = s.test[s.test.source.index(str(tmp_path / "real/class_340/test_4_0.jpg"))]
    assert x.shape == (3, 32, 32) and y == 4
    assert all(y == int(p.split("_")[-2]) for p, y in zip(s.train.source, s.train.targets))
    wnids = WNIDS[:120]
    for part in ("train", "val"):
        _folders(tmp_path / "in100" / part, wnids)

    def wnid(split):
        return [Path(p).parent.name for p in split.source]
    s = _load("imagenet100", tmp_path / "in100")
    assert wnid(s.train) == wnid(s.test) == wnids[:100] and s.test.targets == list(range(100))
    (tmp_path / "in100" / "imagenet100_classes.txt").write_text("\n".join(wnids[20:]) + "\n")
    s = _load("imagenet100", tmp_path / "in100")
    assert wnid(s.test) == wnids[20:] and s.test.targets == list(range(100))


FM, CP = "train-images-idx3-ubyte.gz", "cifar-100-python"
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
FAKE = {"fashion-mnist": _fake_fashion, "cifar100": _fake_cifar, "domainnet": _fake_domainnet,
        "imagenet100": lambda r: [_folders(r / p, map(str, range(100))) for p in ("train", "val")],
        "imagenet-r": lambda r: _folders(r / "imagenet-r", WNIDS[:20], 5)}


REREAD, FETCH = "delete it and fetch it again", "fetch it again"
# data set, damage to the copy FAKE writes, what the DataError names (a file or folder, the fix)
DAMAGE = [
    ("fashion-mnist", lambda r: (r / FM).write_bytes(gzip.compress(gzip.decompress(
        (r / FM).read_bytes())[:-100])), [f"{FM} cannot be read", REREAD]),
    ("fashion-mnist", lambda r: (r / FM).write_bytes((r / FM).read_bytes()[:30]),
     [f"{FM} cannot be read", REREAD]),  # a truncated gzip stream
    ("fashion-mnist", lambda r: (r / FM).unlink(), [FM, "--data-dir", "dataset-fashion-mnist"]),
    ("cifar100", lambda r: (r / CP / "train").write_bytes(b"\x80\x04truncated"),
     [f"{CP}/train cannot be read", REREAD]),
    ("cifar100", lambda r: (r / CP / "test").unlink(), [f"{CP}/test", "--data-dir", CIFAR100_URL]),
    ("cifar100", lambda r: shutil.rmtree(r / CP) or (r / f"{CP}.tar.gz").write_bytes(
        b"half a download"),
     [f"{CP}.tar.gz cannot be read", f"fetch it again from {CIFAR100_URL}"]),
    ("domainnet", lambda r: (r / "clipart_train.txt").write_bytes(b"\xff\xfe c\x00l\x00"),
     ["clipart_train.txt cannot be read", FETCH]),  # UTF-16
    ("domainnet", lambda r: (r / "sketch_test.txt").write_text("no label here\n"),
     ["sketch_test.txt cannot be read", FETCH]),
    ("domainnet", lambda r: (r / "sketch_test.txt").write_text(""),  # 57 classes without a test
     ["345 training and 288 test classes, not 345", "--data-dir"]),
    ("fashion-mnist", lambda r: shutil.copy(r / "train-labels-idx1-ubyte.gz",
                                            r / "t10k-labels-idx1-ubyte.gz"),
     ["numbers of images and labels differ", "fashion-mnist in"]),
    ("imagenet100", lambda r: shutil.rmtree(r / "val" / "7"), ["val/7", "image-net.org"]),
    ("imagenet-r", lambda r: None, ["20 training and 20 test classes, not 200", "imagenet-r.tar"]),
] + [("imagenet-r", lambda r, text=text: (r / "imagenet-r_split.json").write_bytes(text),
      ["imagenet-r_split.json cannot be read", "delete it to split again."])  # another's file
     for text in (b'{"train": [', b"[]", b'"train"', b'{"train": []}', b"\xff{}", b'{"a": []}',
                  b'{"train": [1], "test": []}', b'{"train": "n00000000/0.png", "test": []}',
                  b'{"train": ["n00000000/0.png"], "test": []}')]


@pytest.mark.parametrize("name, damage, words", DAMAGE)
def test_damaged_data_gives_one_line_naming_the_file_and_the_fix(tmp_path, name, damage, words):
    FAKE[name](tmp_path)
    damage(tmp_path)
    with pytest.raises(data.DataError) as err:
        _load(name, tmp_path)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("workers", [0, 1])  # 1: raised in a worker, raised again in the main one
def test_a_damaged_image_met_in_training_ends_the_run_in_one_line(tmp_path, workers, capsys):
    """An image file cut short: exit 2, one line that names it and the fix; task 1's checkpoint
    kept, for --resume once the file is replaced."""
    FAKE["imagenet100"](tmp_path)  # one image per class in train/<c>/ and val/<c>/
    cut = tmp_path / "train" / "99" / "0.png"  # the last class's: met in task 2
    cut.write_bytes(cut.read_bytes()[:50])  # of 75 bytes: PIL opens it, and fails in its pixels
    argv = _without(_without(SHORT, "--dataset"), "--workers") + [
        "--dataset", "imagenet100", "--data-dir", str(tmp_path), "--workers", str(workers),
        "--out", str(tmp_path / "run")]
    assert jm.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cut} cannot be read (OSError: ") and err.count("\n") == 1, err
    assert err.endswith("replace it with an intact copy (fetch the data set again).\n"), err
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    assert not multiprocessing.active_children()  # the run's workers ended with it


def test_file_loaders_give_the_same_batches_under_every_start_method(tmp_path, monkeypatch):
    """Workers started by fork or spawn (as forkserver, Python 3.14's default on Linux) make the
    batches, crops and flips that _Draws and the images make here, epoch after epoch, for training
    and evaluation loaders in turn, and leave the run's generator alone; one set of workers serves
    them all, until end_workers. A pass begun within another is refused."""
    paths = [str(tmp_path / f"{i}.png") for i in range(12)]
    for i, path in enumerate(paths):  # noise: each crop and flip shows
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (12, 16, 3), np.uint8)).save(path)
    (crops, resize), _ = data._transforms("imagenet-r", 16, *MEAN_STD)  # random, and fixed
    train, test = (data._Images(paths, list(range(12)), tf) for tf in (crops, resize))  # label i
    # (images, batch size, train, seed) of three loaders, used in turn, two epochs each
    passes = [(data.subset(train, range(9)), 4, True, 3),  # a task's training
              (data.subset(test, range(3, 12)), 5, False, 0),  # an evaluation
              (train, 4, True, 4)]

    def made_here(ds, batch_size, shuffle, seed):  # two epochs: each image under its seed
        draws, epochs = data._Draws(len(ds), shuffle, seed), []
        for _ in range(2):
            rows = []
            for i, s in draws:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(s)
                    x, y = ds[i]
                rows.append(torch.cat([x.flatten(), torch.tensor([float(y)])]))
            epochs.append([torch.stack(rows[k:k + batch_size])
                           for k in range(0, len(rows), batch_size)])
        return epochs
    expected = [made_here(*p) for p in passes]
    first, second = (torch.cat(e) for e in expected[0])
    order = first[:, -1].tolist()
    assert sorted(order) == list(range(9)) != order  # each image once an epoch, shuffled
    first, second = (t[t[:, -1].argsort()] for t in (first, second))  # each: image i in row i
    assert not torch.equal(first, second)  # training: cropped anew each epoch
    assert all(map(torch.equal, *expected[1]))  # evaluation: the same each epoch
    assert not torch.equal(torch.cat(made_here(train, 4, True, 5)[0]), torch.cat(expected[2][0]))
    state = torch.get_rng_state()
    for workers, start in ((0, None), (2, "fork"), (1, "spawn")):  # spawn: seconds a worker
        data.end_workers()
        monkeypatch.setattr(data, "DataLoader", functools.partial(
            torch.utils.data.DataLoader, multiprocessing_context=start))
        loaders = [data.make_loader(ds, size, shuffle, workers, seed)
                   for ds, size, shuffle, seed in passes]
        pids = set()  # the workers alive after each pass
        for epoch in range(2):
            for loader, made in zip(loaders, expected):
                batches = [torch.cat([x.flatten(1), y[:, None]], 1) for x, y in loader]
                assert len(batches) == len(made[epoch]), start
                assert all(map(torch.equal, batches, made[epoch])), start
                pids.add(frozenset(p.pid for p in multiprocessing.active_children()))
        assert len(pids) == 1 and len(pids.pop()) == workers, start
    assert torch.equal(state, torch.get_rng_state())  # the loaders draw from their own generators
    cut = tmp_path / "cut.png"  # a damaged image: PIL opens it, and fails in its pixels
    cut.write_bytes(Path(paths[0]).read_bytes()[:50])
    with pytest.raises(data.DataError) as err:  # raised in the worker, shown here in its line
        list(data.make_loader(data._Images([str(cut)], [0], resize), 1, False, workers, 0))
    assert str(err.value).startswith(f"{cut} cannot be read (") and "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match="a pass over a file-based set began before"):
        for _ in itertools.islice(loaders[0], 2):  # else, unrefused, each pass restarts the other
            next(iter(loaders[1]))
    data.end_workers()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("download", [False, True])  # True: the download fails, offline
@pytest.mark.parametrize("where", ["absent", "a file"])
@pytest.mark.parametrize("name", list(FAKE))
def test_missing_data_names_the_folder_the_source_and_the_flag(tmp_path, monkeypatch, name, where,
                                                                 download):
    """One line: which set, where, what to put there and the flag; a download only if asked."""
    def offline(url, root):
        fetched.append(url)
        raise OSError("offline")
    fetched, root = [], tmp_path / where
    monkeypatch.setattr(torchvision.datasets.utils, "download_url", offline)
    if where == "a file":
        root.write_text("")
    with pytest.raises(data.DataError) as err:
        data.load_dataset(name, root, 32, *MEAN_STD, download=download)
    message = str(err.value)
    assert "\n" not in message and f"{name} in {root} cannot be read" in message  # which, where
    assert f"--data-dir {shlex.quote(str(root))}" in message and data._LOADERS[name][1] in message
    assert bool(fetched) == (download and name in ("cifar100", "imagenet-r", "fashion-mnist"))


# ============== janus_min.py, the method: LoRA and Theorem 3.1, GR, OE, DML, ours ===============
def lora_vit(scale=1.0, **kwargs):  # a ViT-Ti with the method's LoRA on K and V
    kv_layer = functools.partial(jm.LoRALinear, rank=10, scale=scale)
    return vit.PRESETS["vit_tiny"](kv_layer=kv_layer, **kwargs)


def test_lora_lifecycle(small):
    """Loading leaves A and B; B = 0 changes nothing; the memory changes no output; merge_ keeps
    the output, its fresh A is off M, B = 0."""
    torch.manual_seed(2)
    model, x = lora_vit(scale=0.5, depth=2), small["x"]
    layers = jm.lora_layers(model)
    params = [p for layer in layers for p in (layer.A, layer.B)]
    ab = [p.detach().clone() for p in params]
    load(model, small["paths"]["npz"])
    assert all(torch.equal(a, p) for a, p in zip(ab, params))
    assert layers == [model.blocks[0].attn.k, model.blocks[0].attn.v,
                      model.blocks[1].attn.k, model.blocks[1].attn.v]
    assert (features(model, x) - small["ref"]).abs().max() <= 1e-5  # B = 0
    memory = torch.linalg.qr(torch.randn(192, 20))[0]  # (d_in, m) orthonormal: block 1's
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model.encode(x)[0].pow(2).sum().backward()
        opt.step()
    before = features(model, x)
    assert (before - small["ref"]).abs().max() > 1e-3  # the adapters did change the features
    for layer in layers[2:]:  # K and V of block 1 share its memory
        layer.M = memory
    assert (features(model, x) - before).abs().max() <= 1e-5  # the memory: the same output
    for j, layer in enumerate(layers):
        layer.merge_(memory if j >= 2 else None)
    assert all(layer.B.abs().max() == 0 for layer in layers)
    assert (features(model, x) - before).abs().max() <= 1e-5
    for layer in layers[2:]:
        assert (layer.A @ memory).abs().max() <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_lora_forward_gives_the_safe_gradient_of_theorem_3_1(device):
    """Theorem 3.1 via autograd: out, dx of W0 + s B A; dA = s B^T G_safe, dB = s G_safe A^T."""
    torch.manual_seed(3)
    s, M = 0.7, orthonormal(24, 6, device=device)
    layer = jm.LoRALinear(24, 20, 4, s).double().to(device)
    layer.M = M
    for p in (layer.B, layer.A):  # A deliberately NOT orthogonal to M: the general case
        torch.nn.init.normal_(p)
    x = torch.randn(7, 5, 24, dtype=torch.float64, device=device, requires_grad=True)
    upstream = torch.randn(7, 5, 20, dtype=torch.float64, device=device)
    out = layer(x)
    dx, dA, dB = torch.autograd.grad((out * upstream).sum(), (x, layer.A, layer.B))
    W = (layer.weight + s * layer.B @ layer.A).detach().requires_grad_()
    out_ref = F.linear(x, W, layer.bias)
    dx_ref, G = torch.autograd.grad((out_ref * upstream).sum(), (x, W))
    G_safe = G - G @ M @ M.T
    assert torch.allclose(out, out_ref, atol=1e-12) and torch.allclose(dx, dx_ref, atol=1e-12)
    assert torch.allclose(dA, s * layer.B.T @ G_safe, atol=1e-12)
    assert torch.allclose(dB, s * G_safe @ layer.A.T, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d_out", [20, 12])  # square, so that a projection on the wrong side runs
def test_safe_gradient_is_the_constrained_optimum(device, d_out):
    """G (I - M M^T): feasible (dW X_past = 0), the Lagrangian form, no feasible point closer."""
    g = torch.Generator().manual_seed(0)
    G = torch.randn(d_out, 20, dtype=torch.float64, generator=g).to(device)
    X_past = torch.randn(20, 5, dtype=torch.float64, generator=g).to(device)  # not orthonormal
    S = jm.rows_off_span(G, torch.linalg.qr(X_past).Q)
    assert float((S @ X_past).abs().max()) < 1e-12
    lagrange = G - G @ X_past @ torch.linalg.solve(X_past.T @ X_past, X_past.T)  # Appendix A
    assert rel(S, lagrange) < 1e-12
    null = torch.linalg.svd(X_past).U[:, 5:]  # (20, 15): the feasible set is {Y null null^T}
    for _ in range(200):
        D = (torch.randn(d_out, 15, dtype=torch.float64, generator=g).to(device) @ null.T) * 0.1 + S
        assert float((D @ X_past).abs().max()) < 1e-12 and (G - D).norm() >= (G - S).norm() - 1e-12
    assert torch.equal(jm.rows_off_span(G, X_past[:, :0]), G)  # an empty memory: unchanged


def rectify(G_safe, A, B, s, delta=1e-4):  # Eqs. (6)-(7) for a dense G_safe (d_out, d_in)
    return jm.rectify_factors(B.mT @ G_safe, G_safe @ A.mT, A, B, s, delta)


def _joint_lstsq(Gs, A, B, s):  # Eq. (5) as one system in (dA, dB) by gelsd -> dA, dB, residual
    (r, d_in), d_out = A.shape, B.shape[0]
    I_in, I_out = (torch.eye(n, dtype=Gs.dtype, device=Gs.device) for n in (d_in, d_out))
    # row-major vec(P X Q) = (P kron Q^T) vec(X): vec(s B dA) and vec(s dB A) side by side
    L = s * torch.cat([torch.kron(B, I_in), torch.kron(I_out, A.T.contiguous())], 1)
    L, b = L.cpu(), Gs.flatten().cpu()[:, None]
    x = torch.linalg.lstsq(L, b, driver="gelsd").solution.flatten()
    residual = (b.flatten() - L @ x).norm()
    dA, dB = x[:r * d_in].reshape(r, d_in), x[r * d_in:].reshape(d_out, r)
    return dA.to(Gs.device), dB.to(Gs.device), residual


@pytest.mark.parametrize("device", DEVICES)
def test_gr_and_the_least_norm_split_against_the_joint_least_squares(device):
    """GR = P_B G + G P_A - P_B G P_A, Eq. (5)'s optimum; ours: its least norm; both finite."""
    g, (d_out, d_in, r) = torch.Generator().manual_seed(0), (14, 11, 3)
    M = orthonormal(d_in, 4, gen=g).to(device)
    G, A, B = (torch.randn(*shape, dtype=torch.float64, generator=g).to(device)
               for shape in ((d_out, d_in), (r, d_in), (d_out, r)))
    s, Gs = 0.7, jm.rows_off_span(G, M)
    dA, dB = rectify(Gs, A, B, s, delta=1e-14)
    composite = s * (B @ dA + dB @ A)
    P_B, P_A = B @ torch.linalg.pinv(B), torch.linalg.pinv(A) @ A
    assert rel(composite, P_B @ Gs + Gs @ P_A - P_B @ Gs @ P_A) < 1e-8
    assert float((dA @ M).abs().max()) < 1e-10 * float(dA.abs().max())  # dA's rows stay off M
    I = torch.eye(B.shape[0], dtype=B.dtype, device=device)
    assert rel(composite @ M, (I - P_B) @ Gs @ P_A @ M) < 1e-8
    A_perp = jm.rows_off_span(A, M)
    dA, dB = rectify(Gs, A_perp, B, s, delta=1e-14)
    assert float((s * (B @ dA + dB @ A_perp) @ M).norm()) < 1e-10 * float(Gs.norm())
    hA, hB = rectify(Gs, A, B, 1.3, delta=1e-14)
    oA, oB, residual = _joint_lstsq(Gs, A, B, 1.3)
    ours = float((Gs - 1.3 * (B @ hA + hB @ A)).norm().cpu())
    assert abs(ours - float(residual)) <= 1e-8 * float(Gs.norm())
    dA, dB = jm.least_norm_split(hA, hB, A, B)  # ours (--rectify update): gelsd's least norm
    assert rel(dA, oA) < 1e-8 and rel(dB, oB) < 1e-8
    assert rel(B @ dA + dB @ A, B @ hA + hB @ A) < 1e-12  # the composite is untouched
    assert dA.norm() ** 2 + dB.norm() ** 2 < hA.norm() ** 2 + hB.norm() ** 2
    one = torch.tensor([1.0, 0.0, 0.0], dtype=B.dtype, device=device)
    for A_, B_ in [(A, torch.zeros_like(B)), (A, B * one), (torch.zeros_like(A), B),
                   (A[[0, 0, 1]], B)]:
        for dtype in (torch.float64, torch.float32):
            dA, dB = rectify(G.to(dtype), A_.to(dtype), B_.to(dtype), 1.0)
            assert torch.isfinite(dA).all() and torch.isfinite(dB).all()
    dA, dB = rectify(G, A, torch.zeros_like(B), 1.0)
    assert float(dA.abs().max()) == 0.0  # B = 0: no information about dA, so no step on A
    assert rel(dB @ A, G @ torch.linalg.pinv(A) @ A) < 1e-3  # dB alone does G's share on row(A)
    for A_, B_ in [(A, torch.zeros_like(B)), (torch.zeros_like(A), torch.zeros_like(B)),
                   (A[[0, 0, 1]], B[:, [0, 0, 2]])]:
        for dtype in (torch.float64, torch.float32):
            A_, B_, hA_, hB_ = (t.to(dtype) for t in (A_, B_, hA, hB))
            a, b = jm.least_norm_split(hA_, hB_, A_, B_)
            composite = B_ @ hA_ + hB_ @ A_
            assert torch.isfinite(a).all() and torch.isfinite(b).all()
            bound = 1e-5 * (1 + float(composite.abs().max()))
            assert float((B_ @ a + b @ A_ - composite).abs().max()) <= bound


def one_block_oe(d, k, device="cpu"):  # OE of a single block: L = 1
    return jm.OnlineSubspace(1, d, k, device=device)


def oe_step(sub, X, M=None):  # one OE update of a single block on X (n, d), off M (d, m)
    sub.update([X], [torch.zeros(X.shape[-1], 0, device=X.device) if M is None else M])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_keeps_the_method_in_float32(device):
    """bf16 autocast: the safe gradient and GR in float32, A's gradient off M; OE's products in
    float32 too: bf16 inputs give the step their float32 copies give."""
    torch.manual_seed(0)
    model = lora_vit(img_size=32, patch_size=8).to(device)
    M = orthonormal(192, 40, dtype=torch.float32, device=device)
    for layer in jm.lora_layers(model):
        layer.reset_(M)
        layer.M = M
        torch.nn.init.normal_(layer.B, std=0.02)
    with torch.autocast(device, dtype=torch.bfloat16):
        z, kv_inputs = model.encode(torch.randn(4, 3, 32, 32, device=device))
    assert kv_inputs[0].dtype == torch.bfloat16  # the one bf16 copy q, k, v and OE share
    z.float().pow(2).sum().backward()
    layers = jm.lora_layers(model)
    jm.rectify_gradients_(layers, 1e-4)
    for layer in layers:
        assert layer.A.grad.dtype == torch.float32 and torch.isfinite(layer.A.grad).all()
        assert float((layer.A.grad @ M).norm()) <= 1e-5 * float(layer.A.grad.norm())
    X = kv_inputs[3].detach()
    subs, V = [one_block_oe(192, 8, device) for _ in range(2)], jm.fresh_basis(M[None], 8)
    for sub, x in zip(subs, (X, X.float())):
        sub.V = V.clone()
        oe_step(sub, x, M)
    assert subs[0].V.dtype == torch.float32 and float((M.T @ subs[0].V[0]).abs().max()) < 1e-5
    assert torch.equal(subs[0].V, subs[1].V)


def _oe_oracle(V, X, M, t, products, lr=1.0, decay=5):
    """One OE step (Eqs. (8)-(10) as we read them) in float64, dense, with the products X V and
    X^T (X V) rounded to `products`: X_p = X (I - M M^T); a step on (1/2) ||X_p - X_p V V^T||^2
    preconditioned by S = V^T X_p^T X_p V, at eta = lr decay / (decay + t) (--oe-lr,
    --oe-decay-steps); QR with R's diagonal > 0; off M."""
    P = torch.eye(len(M), dtype=torch.float64) - M @ M.T
    XV = (X.to(products) @ V.to(products)).double()
    C = P @ (X.to(products).T @ XV.to(products)).double()  # X_p^T X_p V
    S = XV.T @ XV
    S = S + (1e-6 * S.diagonal().mean() + torch.finfo(S.dtype).tiny) * torch.eye(len(S))
    grad = -(C - V @ (V.T @ C)) @ torch.linalg.inv(S)
    Q, R = torch.linalg.qr(V - lr * decay / (decay + t) * grad)
    return P @ (Q * R.diagonal().sign())


def test_oe_follows_its_float64_oracle_on_bf16_activations():
    """Under bf16 autocast OE's inputs X are bf16; its products take their float32 copies. Over 40
    steps its basis stays with a float64 oracle; the same steps with bf16 products drift (printed:
    pytest -s). The activations have a mean, as a ViT's do, which is what bf16 products lose."""
    d, k = 96, 12
    Q, sd, g = _planted(d, k, gap=1.5, seed=3)
    M = orthonormal(d, 8, gen=g)
    offset = 3.0 * torch.randn(d, generator=g) / math.sqrt(d)
    X = [((torch.randn(256, d, generator=g) * sd) @ Q.T + offset).bfloat16() for _ in range(40)]
    sub = one_block_oe(d, k)
    sub.V = jm.fresh_basis(M[None].float(), k)
    exact, bf16 = sub.V[0].double(), sub.V[0].double()
    for t, x in enumerate(X):
        oe_step(sub, x, M.float())
        exact = _oe_oracle(exact, x.double(), M, t, torch.float64)
        bf16 = _oe_oracle(bf16, x.double(), M, t, torch.bfloat16)
    ours, theirs = (_sin_largest_angle(exact, V) for V in (sub.V[0].double(), bf16))
    print(f"\nOE on bf16 activations, the sine of the largest angle to the float64 oracle after 40 "
          f"steps: float32 products (ours) {ours:.1e}, bf16 products {theirs:.1e}")
    assert ours < 1e-3 and theirs > 10 * ours
    assert float((M.T.float() @ sub.V[0]).abs().max()) < 1e-6


def test_oe_at_eta_1_is_one_step_of_subspace_iteration():
    """A task's first OE step (eta = 1) spans X_p^T X_p V, off M; a later, smaller step does not."""
    d, k = 32, 4
    Q, sd, g = _planted(d, k, gap=4.0, seed=5)
    M = orthonormal(d, 6, dtype=torch.float32, gen=g)
    X = (torch.randn(200, d, generator=g) * sd) @ Q.T
    P = torch.eye(d) - M @ M.T
    sub = one_block_oe(d, k)
    sub.V = jm.fresh_basis(M[None], k)
    for t in range(2):
        V = sub.V[0].double()
        target = torch.linalg.qr(P.double() @ X.double().T @ X.double() @ V).Q  # one iteration
        oe_step(sub, X, M)
        outside = sub.V[0].double() - target @ (target.T @ sub.V[0].double())  # off the target
        sin = float(torch.linalg.matrix_norm(outside, 2))  # the sine of the largest angle
        assert sin < 1e-5 if t == 0 else sin > 1e-2  # t = 1: eta = 5/6, short of the iteration


def _planted(d, k, gap, seed):
    g = torch.Generator().manual_seed(seed)
    Q = orthonormal(d, d, dtype=torch.float32, gen=g)
    return Q, torch.cat([torch.full((k,), math.sqrt(gap)), torch.ones(d - k)]), g


def _sin_largest_angle(U, V):
    return float((1 - torch.linalg.svdvals(U.T @ V).min() ** 2).clamp_min(0).sqrt())


@pytest.mark.parametrize("device", DEVICES)
def test_oe_stays_positive_definite_and_orthonormal_and_converges(device):
    """Rank-one inputs: float64 Grams above the ridge (fp32 gave NaN); Eqs. (8)-(10) converge."""
    g = torch.Generator().manual_seed(0)
    for k, ridge in ((64, 1e-6), (10, 1e-8)):  # OE's ridge at rank k; GR's at a small --delta
        x = 1e3 * torch.randn(8, 4096, 1, generator=g) @ torch.randn(8, 1, k, generator=g)
        S = jm.ridge(jm.gram(x.to(device)), ridge)  # (8, k, k)
        assert (torch.linalg.cholesky_ex(S).info == 0).all()
    sub = one_block_oe(256, 64, device)
    x = 1e3 * torch.randn(4096, 1, generator=g) @ torch.randn(1, 256, generator=g)  # rank one
    oe_step(sub, x.to(device))
    V, eye = sub.V[0], torch.eye(64, device=device)
    assert torch.isfinite(V).all() and torch.allclose(V.mT @ V, eye, atol=1e-5)
    d, k, n = 64, 8, 64
    Q, sd, g = _planted(d, k, gap=10.0, seed=1)
    torch.manual_seed(0)
    sub, trace = one_block_oe(d, k, device), {}
    for step in range(1, 2001):
        oe_step(sub, ((torch.randn(n, d, generator=g) * sd) @ Q.T).to(device))
        V = sub.V[0]
        assert float((V.T @ V - torch.eye(k, device=device)).norm()) <= 1e-5
        if step in (10, 50, 200, 1000, 2000):
            trace[step] = _sin_largest_angle(Q[:, :k].to(device), V)
    print("OE sin(largest principal angle) vs updates:", trace)
    assert trace[2000] <= 0.05 and trace[2000] < trace[10]


def test_oe_captures_a_vit_tasks_activations_within_an_epoch():
    """An epoch of OE on ViT-Ti K/V inputs, all 12 blocks as one stack, captures >= 99% of the
    best rank-k subspace's energy in every block."""
    torch.manual_seed(0)
    model = vit.PRESETS["vit_tiny"](img_size=32, patch_size=8).eval()
    task = data.subset(data.load_dataset("synthetic", None, 32, 0.0, 1.0).train, [0, 1, 2, 3])
    k, sub, captured = 8, jm.OnlineSubspace(12, 192, 8), {}
    empty = [torch.zeros(192, 0)] * 12
    with torch.no_grad():
        images = torch.stack([task[i][0] for i in range(len(task))])
        X_all = [X.flatten(0, 1) for X in model.encode(images)[1]]  # (B*N, D) per block
        best = [torch.linalg.eigvalsh(X.T @ X)[-k:].sum() for X in X_all]
        for step, (batch, _) in enumerate(data.make_loader(task, 16, True, 0, seed=0), 1):
            sub.update(model.encode(batch)[1], empty)
            captured[step] = [float((X @ V).pow(2).sum() / b)
                              for V, X, b in zip(sub.V, X_all, best)]
    print("OE captured / best energy, worst block:", [round(min(c), 4) for c in captured.values()])
    assert len(captured) == 6 and min(captured[6]) >= 0.99


def test_oe_is_scale_free_merges_into_an_orthonormal_memory_and_repairs_a_leak():
    """OE is scale-free; merge keeps M orthonormal up to the width; update, merge repair a leak."""
    d, k = 32, 4
    Q, sd, g = _planted(d, k, gap=8.0, seed=2)
    batches = [(torch.randn(40, d, generator=g) * sd) @ Q.T for _ in range(30)]
    subs = []
    for c in (1.0, 1000.0):
        torch.manual_seed(0)
        subs.append(one_block_oe(d, k))
        for X in batches:
            oe_step(subs[-1], X * c)
    assert float((subs[0].V - subs[1].V).abs().max()) < 1e-4  # the same trajectory
    sub, M = subs[0], torch.zeros(d, 0)
    for _ in range(3):  # three tasks
        M = sub.merge([M])[0]
        for X in batches:
            oe_step(sub, X, M)
        assert float((M.T @ M - torch.eye(M.shape[1])).abs().max()) < 1e-5
        assert float((M.T @ sub.V[0]).abs().max()) < 1e-5
    M = sub.merge([M])[0]
    assert M.shape[1] == 4 * k
    for _ in range(10):  # the memory never exceeds the width; a full one leaves no basis
        M = sub.merge([M])[0]
    assert M.shape[1] == d and sub.V.shape[-1] == 0
    oe_step(sub, batches[0], M)
    layer = jm.LoRALinear(d, 8, 2, 1.0)
    layer.reset_(M)
    assert float(layer.A.detach().abs().max()) == 0.0  # an exact zero, not round-off
    torch.manual_seed(6)
    sub, M = one_block_oe(16, 3), orthonormal(16, 4, dtype=torch.float32)
    leak = M[:, :3] * 0.5 + 0.1 * torch.randn(16, 3)  # in span(M) largely, not unit
    sub.V = leak[None].clone()
    oe_step(sub, torch.randn(50, 16), M)
    assert float((M.T @ sub.V[0]).abs().max()) < 1e-5
    sub.V = leak[None].clone()
    M = sub.merge([M])[0]
    assert float((M.T @ M - torch.eye(7)).abs().max()) < 1e-5


def test_dml_terms_direction_and_prototypes():
    """Eq. (11): CE to the batch's prototypes + mean hinge to old ones; its step; unit means."""
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
    p = F.normalize(torch.tensor([[1.0, 0.2, 0.0]]), dim=1)
    z = torch.tensor([[0.9, 0.3, 0.1], [0.1, 1.0, 0.0]], requires_grad=True)
    before = float(F.normalize(z.detach(), dim=1)[0] @ p[0])
    assert before > 0.3
    jm.dml_loss(z, torch.tensor([0, 1]), p, margin=0.3).backward()
    with torch.no_grad():
        assert float(F.normalize(z - 0.1 * z.grad, dim=1)[0] @ p[0]) < before
    torch.manual_seed(7)
    z, y = torch.randn(30, 6) * 5, torch.arange(30) % 3
    protos = jm.class_prototypes(z, y, [0, 1, 2])
    assert torch.allclose(protos.norm(dim=1), torch.ones(3), atol=1e-6)
    zn = F.normalize(z, dim=1)
    expected = torch.stack([F.normalize(zn[y == c].mean(0), dim=0) for c in range(3)])
    assert torch.allclose(protos, expected, atol=1e-6)


def _images(x, y):  # uint8 images (N, C, H, W) that the loaders give as floats in [0, 1]
    return data._Images(x, y, torch.nn.Identity())


class Identity(torch.nn.Module):  # a backbone: its feature is the image; its K/V input given
    kv = None

    def encode(self, x):
        return x.flatten(1), [self.kv if self.kv is not None else x.flatten(2).mT]


def test_metrics_and_evaluate_on_hand_built_cases():
    """ACC, MAA, BWT; evaluate: task 2's head dominates: task 1 0% agnostic, 100% aware."""
    one_task = [{"ACC": 90.0, "MAA": 90.0, "BWT": None, "sample_acc": [90.0],
                 "task_aware": {"ACC": 95.0, "MAA": 95.0, "BWT": None}}] * 2
    assert jm.summarize(one_task)["BWT"] == {"mean": None, "std": None}  # undefined for T = 1
    assert jm.summarize(one_task)["ACC"] == {"mean": 90.0, "std": 0.0}
    out = jm.metrics([[90.0, None, None], [80.0, 70.0, None], [60.0, 65.0, 50.0]])
    assert out["ACC"] == pytest.approx((60 + 65 + 50) / 3)
    assert out["MAA"] == pytest.approx((90 + (80 + 70) / 2 + (60 + 65 + 50) / 3) / 3)
    assert out["BWT"] == pytest.approx(((60 - 90) + (65 - 70)) / 2)
    D, tasks = 4, [[0, 1], [2, 3]]
    labels = [0, 1, 2, 3, 2, 3, 2, 3]  # task 1: 2 test samples, task 2: 6
    one_hot = torch.eye(D, dtype=torch.uint8)[labels].reshape(8, 1, 2, 2) * 255  # 1.0 when read
    splits = SimpleNamespace(test=_images(one_hot, labels))
    heads = torch.nn.ModuleList([torch.nn.Linear(D, 2, bias=False), torch.nn.Linear(D, 2)])
    with torch.no_grad():
        heads[0].weight.copy_(torch.eye(D)[:2])  # right, on its own classes
        heads[1].weight.copy_(torch.eye(D)[2:])
        heads[1].bias.fill_(10.0)  # dominates every sample
    cfg = jm.Config(batch_size=5, workers=0, device="cpu")
    agnostic, aware, samples = jm.evaluate(Identity(), heads, splits, tasks, cfg)
    assert agnostic == [0.0, 100.0] and aware == [100.0, 100.0]
    assert samples == 75.0  # 6 of 8 samples, where the mean over tasks is 50


def test_violation_and_dml_geometry_on_hand_built_cases():
    """violation: ||dW M|| / ||dW||; dml_geometry: cos_old, cos_own, the shares, the histogram."""
    torch.manual_seed(4)
    A, B, M = torch.randn(4, 24), torch.randn(16, 4), torch.linalg.qr(torch.randn(24, 6))[0]
    dW = 0.5 * B @ A  # formed densely here only
    expected = float((dW @ M).norm() / dW.norm())
    assert expected > 0.1 and abs(jm.violation(A, B, M) - expected) < 1e-5 * expected
    assert jm.violation(A, B, torch.zeros(24, 0)) is None  # undefined: no memory yet
    assert jm.violation(A, torch.zeros(16, 4), M) is None  # undefined: no update
    cos_old = torch.tensor([0.62, 0.15, 0.93])
    z = torch.stack([cos_old, torch.zeros(3), (1 - cos_old ** 2).sqrt()], 1) * 3.0  # any norm
    g = jm.dml_geometry(z, torch.tensor([2, 2, 2]), torch.eye(3), old=2)  # classes 0, 1: old
    assert g["cos_old"] == pytest.approx([0.62, 0.15, 0.93], abs=1e-4)
    assert g["cos_own"] == pytest.approx([0.7846, 0.9887, 0.3676], abs=1e-4)
    assert (g["danger"], g["safe"], g["closer_to_old"]) == pytest.approx((2 / 3, 1 / 3, 1 / 3))
    expected = [0.0] * 20
    for c in (0.62, 0.15, 0.93):  # bins of 0.1 over [-1, 1]
        expected[int((c + 1) / 0.1)] += 1 / 3
    assert g["hist"] == pytest.approx(expected)


def test_rectify_updates_matches_the_dense_reference():
    """Ours: the least-norm GR split of the projected step s (B dA + dB A)(I - M M^T)."""
    torch.manual_seed(8)
    d_in, d_out, r, s = 18, 11, 3, 0.6
    layer, M = jm.LoRALinear(d_in, d_out, r, s).double(), orthonormal(d_in, 5)
    with torch.no_grad():
        layer.A.normal_()  # not orthogonal to M
        layer.B.normal_()
        A0, B0 = layer.A.detach().clone(), layer.B.detach().clone()
        layer.A.add_(0.01 * torch.randn_like(A0))  # "Adam's step"
        layer.B.add_(0.01 * torch.randn_like(B0))
    dA, dB = layer.A.detach() - A0, layer.B.detach() - B0
    target = jm.rows_off_span(s * (B0 @ dA + dB @ A0), M)  # dense, (d_out, d_in)
    rA, rB = jm.least_norm_split(*rectify(target, A0, B0, s, 1e-4), A0, B0)
    jm.rectify_updates_([layer], [(A0, B0)], [M], 1e-4)
    assert rel(layer.A.detach() - A0, rA) < 1e-10 and rel(layer.B.detach() - B0, rB) < 1e-10


def test_lr_schedule_follows_the_inflora_codebase():
    """InfLoRA's CosineSchedule as its code steps it; K = 1: one epoch; cosine: a half cosine."""
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


def test_gpm_adds_the_fewest_directions_and_inflora_a_is_off_the_memory():
    """GPM: fewest directions reaching the threshold; InfLoRA's A: orthonormal / sqrt(3), off M."""
    lam = [5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.1]
    C, U = _planted_covariance(lam, 0)
    e = torch.tensor(lam, dtype=torch.float64) ** 2

    def share(M):  # the share of C's energy that span(M) captures
        return float((torch.linalg.svdvals(M.T @ C) ** 2).sum() / e.sum())
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

    def held(M):
        return float((torch.linalg.svdvals(M.T @ C2) ** 2).sum() /
                     (torch.linalg.svdvals(C2) ** 2).sum())
    assert held(M2) >= 0.95 > held(M2[:, :-1])
    C, _ = _planted_covariance(lam, 2)
    M = orthonormal(8, 2)
    A = jm.inflora_a(C, M, 3)
    assert A.shape == (3, 8) and float((A @ M).abs().max()) < 1e-12
    assert torch.allclose(A @ A.T * 3, torch.eye(3, dtype=torch.float64), atol=1e-12)


STEP_VARIANTS = {"plain": dict(oe=False, gr=False, dml=False), "janus-grad": {},
                 "janus-update": dict(rectify="update"), "oe-rolling": dict(memory="oe-rolling"),
                 "gpm": dict(memory="gpm"), "fp32": dict(precision="fp32")}


def _step_of(change, device, compile=False):  # a variant's mid-run learner and its step
    argv = ["--model", "vit_tiny", "--weights", "none", "--img-size", "32", "--patch-size", "8",
            "--k", "8", "--dataset", "synthetic", "--device", device,
            "--compile", "on" if compile else "off"]
    cfg = dataclasses.replace(jm.configure(argv)[0], **change)
    torch.manual_seed(0)
    learner = jm.mid_run_learner(cfg, jm.build_model(cfg)[0], 16, 4)
    images, y = torch.randn(4, 3, 32, 32, device=device), torch.tensor([0, 1, 2, 3], device=device)
    return learner, functools.partial(jm.train_step, learner, jm.adam(learner, cfg), images, y,
                                      cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("variant", list(STEP_VARIANTS))
def test_train_step_never_syncs_with_the_host_on_cuda(variant, compile):
    """Every variant's step, with compiled blocks or not, runs in sync debug mode 'error'."""
    _, step = _step_of(STEP_VARIANTS[variant], "cuda", compile)
    for _ in range(5):  # warm-up: handles, workspaces, first-call checks, compilation
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("variant", list(STEP_VARIANTS))
def test_every_variants_mid_run_learner_and_step_on_a_cpu(variant):
    """The CUDA test's learners and steps on a CPU: a memory of m columns a block where OE is on
    (GPM's too), V off it where OE runs, each layer's M what it protects; the steps are finite,
    train the current head and keep the memory and the old prototypes."""
    learner, step = _step_of(STEP_VARIANTS[variant], "cpu")
    cfg = dataclasses.replace(jm.Config(), **STEP_VARIANTS[variant])
    assert [M.shape for M in learner.memory] == [(192, 16 if cfg.oe else 0)] * 12
    if learner.oe is not None:
        leaks = [float((M.T @ V).abs().max()) for M, V in zip(learner.memory, learner.oe.V)]
        assert max(leaks) < 1e-5

    def follows():  # each layer's M: what protected() says now (under M = V: V as it moves)
        M = jm.protected(learner, cfg)
        return all(torch.equal(layer.M, M[j // 2])
                   for j, layer in enumerate(jm.lora_layers(learner.model)))
    before = copy.deepcopy((learner.memory, learner.prototypes, learner.heads[-1].weight))
    assert follows()
    losses = [float(step()[0]) for _ in range(2)]
    assert all(math.isfinite(loss) for loss in losses) and follows()
    assert all(torch.equal(a, b) for a, b in zip(before[0], learner.memory))
    assert torch.equal(before[1], learner.prototypes)
    assert not torch.equal(before[2], learner.heads[-1].weight)


def test_compiled_blocks_give_the_same_steps_on_every_torch_admitted(monkeypatch):
    """--compile: the plain model's steps (TorchDynamo traces the blocks, its eager backend runs
    them) as the memory grows; the dynamo setting it makes has its name in torch 2.4 too."""
    real = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: real(self, backend="eager"))

    class Torch24DynamoConfig:  # the setting's name in that version: cache_size_limit
        def __getattr__(self, name):
            return getattr(dynamo_config, name)

        def __setattr__(self, name, value):
            if name == "recompile_limit":  # as any name a config does not know
                raise AttributeError(f"{name} does not exist")
            setattr(dynamo_config, name, value)
    dynamo_config = torch._dynamo.config
    cfg = jm.configure(["--model", "vit_tiny", "--weights", "none", "--img-size", "32",
                        "--patch-size", "8", "--device", "cpu", "--compile", "on"])[0]
    with monkeypatch.context() as old:
        old.setattr(torch._dynamo, "config", Torch24DynamoConfig())
        jm.start_learner(cfg, 0, jm.build_model(cfg)[0])
    losses = []
    for compile in (False, True):
        torch._dynamo.reset()
        learner, step = _step_of({}, "cpu", compile)
        losses.append([float(step()[0]) for _ in range(3)])
        for m in (24, 40, 56, 72):  # the memory of the tasks to come, a new width each
            memory = torch.linalg.qr(torch.randn(192, m)).Q
            for layer in jm.lora_layers(learner.model):
                layer.M = memory
            losses[-1].append(float(step()[0]))
    assert torch._dynamo.utils.counters["frames"]["ok"] >= 1  # the blocks were traced
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_interference_equals_the_dense_computation_and_is_round_off_inside_the_memory():
    """probe: per layer ||X dW^T||_F^2 / tokens over past and current K/V inputs, dW = s B A."""
    torch.manual_seed(9)
    model = vit.PRESETS["vit_tiny"](depth=2, img_size=32, patch_size=8).eval()
    factors = [(torch.randn(3, 192), torch.randn(192, 3)) for _ in range(4)]
    images = torch.randint(0, 256, (10, 3, 32, 32), dtype=torch.uint8)
    y = torch.tensor([0, 1, 2, 3, 4] * 2)
    cfg = jm.Config(device="cpu", batch_size=4, workers=0, lora_scale=0.5)
    energy, z, z_y = jm.probe(model, factors, _images(images, y.tolist()), [3, 4], cfg)
    with torch.no_grad():
        z_all, kv = model.encode(images.float() / 255)
    current = y >= 3  # classes 3, 4: the current task
    assert torch.allclose(z, z_all[current], atol=1e-6) and torch.equal(z_y, y[current])
    for j, (A, B) in enumerate(factors):
        dW = 0.5 * B @ A  # dense, (d_out, d_in)
        for row, rows in enumerate((~current, current)):  # past, then current
            X = kv[j // 2][rows].flatten(0, 1)  # (tokens, D)
            assert float(energy[row, j]) == pytest.approx(float((X @ dW.T).norm() ** 2 /
                                                                X.shape[0]), rel=1e-4)
    # --rectify update: past inputs in span(M) see round-off, a part outside ||X_out dW^T||
    torch.manual_seed(10)
    d, k = 24, 6
    M, layer = orthonormal(d, k, dtype=torch.float32), jm.LoRALinear(d, 12, 3, 1.0)
    layer.reset_(M)
    X2 = torch.randn(512, d)
    _fit(layer, X2, X2 @ torch.randn(12, d).T, 100, gr="update", memory=M)
    X_in = torch.randn(64, k) @ M.T  # past inputs inside span(M)
    outside = 0.3 * jm.rows_off_span(torch.randn(64, d), M)  # a part the memory misses
    dW = (layer.B @ layer.A).detach()
    cfg = jm.Config(device="cpu", batch_size=1, workers=0)
    for X, expected in ((X_in, 0.0), (X_in + outside, float((outside @ dW.T).norm() / 8))):
        model = Identity()
        model.kv = X[None]  # one "image" of 64 tokens, of a past class
        energy = jm.probe(model, [(layer.A.detach(), layer.B.detach())], _images(
            torch.zeros(1, 1, 1, 1, dtype=torch.uint8), [0]), [1], cfg)[0]
        past = float(energy[0, 0].sqrt())
        assert past == pytest.approx(expected, abs=1e-5 * float(dW.norm() * X.norm() / 8))


def _fit(layer, X, Y, steps, sub=None, gr=None, lr=1e-2, delta=1e-4, memory=None):
    """Adam on one LoRA layer that protects memory; gr: None, 'grad', 'update'; sub: an OE."""
    opt, g = torch.optim.Adam([layer.A, layer.B], lr=lr), torch.Generator().manual_seed(0)
    layer.M = torch.zeros(X.shape[1], 0) if memory is None else memory
    for _ in range(steps):
        idx = torch.randint(0, X.shape[0], (64,), generator=g)
        if sub is not None:
            oe_step(sub, X[idx])
        opt.zero_grad()
        F.mse_loss(layer(X[idx]), Y[idx]).backward()
        if gr == "grad":
            jm.rectify_gradients_([layer], delta)
        if gr == "update":
            jm.rectified_adam_step_(opt, [layer], delta)
        else:
            opt.step()


def test_two_task_violation_and_forgetting_of_the_four_variants(monkeypatch):
    """Two overlapping tasks: all variants learn; --rectify update protects, factors of one size."""
    torch.manual_seed(0)
    d_in, d_out, r, k = 32, 16, 4, 6
    U = orthonormal(d_in, d_in, dtype=torch.float32)
    U1, U2 = U[:, :k], U[:, k:2 * k]
    X1 = torch.randn(2048, k) @ U1.T * 2 + 0.05 * torch.randn(2048, d_in)  # task 1 in span(U1)
    X2 = torch.randn(2048, k) @ U1.T + torch.randn(2048, k) @ U2.T * 2  # task 2 overlaps it
    Y1, Y2 = X1 @ torch.randn(d_out, d_in).T, X2 @ torch.randn(d_out, d_in).T
    layer, sub = jm.LoRALinear(d_in, d_out, r, 1.0), one_block_oe(d_in, k)
    _fit(layer, X1, Y1, 300, sub=sub)
    layer.merge_(None)
    M = sub.merge([torch.zeros(d_in, 0)])[0]
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
        lay.reset_(M if oe else None)
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


# ---- What a green suite let through: a measurement of something else, initial values drawn
# otherwise than their references draw them, and the rare batches of a real run
BENCHMARK_SWITCHES = {"plain": dict(oe=False, gr=False, dml=False), "janus-grad": {},
                      "janus-update": dict(rectify="update")}  # beside Janus-LoRA's (JANUS)


def test_each_benchmark_variant_takes_the_step_its_name_says_and_its_numbers_count_it(tmp_path):
    """Each variant's first step, taken again on a copy of its learner under the switches its name
    says, leaves the same factors, W0, V, memory and head, bit for bit; Janus-LoRA's two steps
    differ from one start. A clock that each step moves by a set time: ms/step is the median of
    the variant's timed steps (not its warm-up's), x plain the median of the per-round ratios,
    images/s the batch over it."""
    seconds = {"plain": [1, 1, 4], "janus-grad": [2, 3, 4], "janus-update": [3, 6, 2]}  # rounds
    warm_up = 5  # the steps that benchmark takes with each variant before the timed rounds
    names, first, calls, clock = {}, {}, {}, [0.0]
    real = jm.train_step

    def train_step(learner, opt, images, y, cfg):
        if id(learner) not in names:  # the variants' learners are built in this order
            names[id(learner)] = list(seconds)[len(names)]
        name = names[id(learner)]
        start = copy.deepcopy((learner, images, y)) if name not in first else None
        out = real(learner, opt, images, y, cfg)
        if start:
            first[name] = start, _tensors(learner)
        calls[name] = calls.get(name, 0) + 1
        timed = calls[name] - warm_up  # the benchmark's warm-up steps come first, untimed
        clock[0] += seconds[name][timed - 1] if timed > 0 else 1e3  # a timed warm-up shows
        return out
    argv = SMALL + ["--method", "finetune", "--benchmark", "--steps", "3", "--out", str(tmp_path)]
    with _small_world() as mp:
        mp.setattr(jm, "train_step", train_step)
        mp.setattr(jm, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=time.time,
                                               strftime=time.strftime))
        assert jm.main(argv) == 0
        cfg = jm.configure(argv)[0]
    report = json.loads((tmp_path / "benchmark.json").read_text())["variants"]
    assert calls == {name: warm_up + 3 for name in seconds}  # --steps 3 timed rounds
    for name, times in seconds.items():
        ratios = [t / p for t, p in zip(times, seconds["plain"])]
        assert report[name]["ms_per_step"] == pytest.approx(1e3 * statistics.median(times))
        assert report[name]["x_plain"] == pytest.approx(statistics.median(ratios))
        assert report[name]["images_per_s"] == pytest.approx(16 / statistics.median(times))
    janus = [_tensors(first[name][0][0]) for name in ("janus-grad", "janus-update")]
    assert _same(*janus)  # Janus-LoRA's two variants start from one learner
    after = {}
    for name, ((learner, images, y), taken) in first.items():
        vcfg = dataclasses.replace(cfg, **{**JANUS, **BENCHMARK_SWITCHES[name]})
        real(learner, jm.adam(learner, vcfg), images, y, vcfg)
        after[name] = _tensors(learner)
        assert _same(after[name], taken), name
    assert not _same(after["janus-grad"], after["janus-update"])


def _uneven(splits, train, test):  # the first train[c] training, test[c] test images of class c
    def first(ds, counts):
        targets = torch.tensor(ds.targets)
        keep = torch.cat([torch.nonzero(targets == c)[:n, 0] for c, n in enumerate(counts)])
        return data._Images(ds.source[keep], targets[keep].tolist(), ds.transform, ds.batched)
    return splits._replace(train=first(splits.train, train), test=first(splits.test, test),
                           train_eval=first(splits.train_eval, train))


def _dml_direct(z, y, old, margin, tau):  # Eq. (11) term by term, its softmax over C_t present
    z = F.normalize(z.detach().double(), dim=1)
    present = sorted(set(y.tolist()))
    p = torch.stack([F.normalize(z[y == c].mean(0), dim=0) for c in present])  # (|C_t|, D)
    own = torch.stack([z[i] @ p[present.index(int(c))] for i, c in enumerate(y)])
    intra = (torch.logsumexp(z @ p.T / tau, 1) - own / tau).mean()
    hinge = [max(0.0, float(z[i] @ o) - margin) for i in range(len(z)) for o in old.double()]
    return intra + (sum(hinge) / len(hinge) if hinge else 0.0)


def _gr_direct(BtG, GAt, A, B, s, delta):  # Eqs. (6)-(7) from B^T G_safe, G_safe A^T; our ridge
    def ridged(S):  # S + delta * mean(eig S) * I
        lam = delta * S.trace() / len(S) + torch.finfo(S.dtype).tiny
        return S + lam * torch.eye(len(S), dtype=S.dtype)
    dA = torch.linalg.solve(ridged(B.T @ B), BtG) / s
    RAt = GAt - s * B @ dA @ A.T  # R A^T, with R = G_safe - s B dA
    return dA, RAt @ torch.linalg.inv(ridged(A @ A.T)) / s


def _keep(inputs, grads, j, layer, args, out):  # a forward hook: a layer's input, its output's grad
    inputs[j] = args[0].detach()
    out.register_hook(lambda g: grads.__setitem__(j, g))


@pytest.fixture(scope="module")
def rare_run():
    """Two tasks of a 2-block ViT-Ti in batches of 7: task 1 has 6 training images (fewer than a
    batch) and 48 test images, task 2 has 15 (7, 7, then one image) and 18; k = 24 exceeds one
    image's 17 tokens; the final LayerNorm's random gain and bias give the features unequal norms.
    Each step is checked against direct formulas and each task's numbers against direct
    computations on the images they name, under a clock that each phase moves by a set time."""
    argv = ["--dataset", "synthetic", "--model", "vit_tiny", "--weights", "none", "--img-size",
            "16", "--patch-size", "4", "--tasks", "2", "--epochs", "2", "--batch-size", "7",
            "--k", "24", "--lora-scale", "0.5", "--lr", "5e-3", "--workers", "0", "--device",
            "cpu"]
    tick = {"start_task": 1, "train_step": 11, "end_task": 4, "evaluate": 1000,
            "record_analyses": 10000}  # seconds each call takes on the clock
    seen = {"steps": [], "tasks": [], "factors": [], "fresh": []}
    clock, real = [0.0], {name: getattr(jm, name) for name in (*tick, "rectify_gradients_")}

    def timed(name):
        def call(*args):
            clock[0] += tick[name]
            return real[name](*args)
        return call

    def train_step(learner, opt, images, y, cfg):
        layers, head = jm.lora_layers(learner.model), learner.heads[-1]
        with torch.no_grad():
            z = learner.model.encode(images)[0]
            expected = F.cross_entropy(head(z), y) + cfg.lambda_dml * _dml_direct(
                z, y, learner.prototypes, cfg.margin, cfg.tau)
        before = [(layer.A.detach().double(), layer.B.detach().double(), layer.M.double())
                  for layer in layers]
        V, t = learner.oe.V.double(), learner.oe.t
        if t == 0:  # a task's first step: its fresh factors and basis, against the memory now
            memory = [M.double() for M in learner.memory]
            seen["fresh"].append(dict(
                A_on_M=max(float((A @ M).norm() / A.norm()) for A, _, M in before),
                B=max(float(B.abs().max()) for _, B, _ in before),
                V_orthonormal=max(float((v.T @ v - torch.eye(v.shape[1])).abs().max()) for v in V),
                V_on_M=max(float((M.T @ v).norm()) for v, M in zip(V, memory))))
        inputs, grads = {}, {}
        hooks = [layer.register_forward_hook(functools.partial(_keep, inputs, grads, j))
                 for j, layer in enumerate(layers)]
        loss, right = timed("train_step")(learner, opt, images, y, cfg)
        for hook in hooks:
            hook.remove()
        safe, gr, s = [], [], cfg.lora_scale  # per layer, the distances to the direct formulas
        for j, (layer, (A, B, M), (gA, gB)) in enumerate(zip(layers, before, seen["chain"])):
            g, x = (v.flatten(0, 1).double() for v in (grads[j], inputs[j]))
            G_safe = g.T @ x - (g.T @ x) @ M @ M.T  # G = dL/dW, summed over the batch's tokens
            safe += [rel(gA, s * B.T @ G_safe), rel(gB, s * G_safe @ A.T)]
            dA, dB = _gr_direct(gA / s, gB / s, A, B, s, cfg.delta)
            gr += [rel(layer.A.grad.double(), dA), rel(layer.B.grad.double(), dB)]
        oe = [rel(learner.oe.V[i].double(), _oe_oracle(
            V[i], inputs[2 * i].flatten(0, 1).double(), learner.memory[i].double(), t,
            torch.float64, cfg.oe_lr, cfg.oe_decay_steps)) for i in range(len(V))]
        seen["steps"].append(dict(task=len(learner.heads) - 1, y=y.tolist(), loss=float(loss),
                                  expected=float(expected), right=int(right), safe=safe, gr=gr,
                                  oe=oe, tokens=inputs[0].shape[0] * inputs[0].shape[1]))
        return loss, right

    def rectify_gradients_(layers, delta):  # what GR receives: autograd's factor gradients
        seen["chain"] = [(layer.A.grad.double(), layer.B.grad.double()) for layer in layers]
        return real["rectify_gradients_"](layers, delta)

    def record_analyses(record, learner, t, factors, *args):
        seen["factors"].append(factors)
        return timed("record_analyses")(record, learner, t, factors, *args)

    def after_task(learner, record):  # each number of the task against a direct computation
        seen["tasks"].append(_direct_numbers(learner, record, splits, seen["factors"][-1], cfg))
    with _small_world() as mp, contextlib.redirect_stdout(io.StringIO()) as log:
        for name in tick:
            mp.setattr(jm, name, timed(name))
        mp.setattr(jm, "train_step", train_step)
        mp.setattr(jm, "record_analyses", record_analyses)
        mp.setattr(jm, "rectify_gradients_", rectify_gradients_)
        mp.setattr(jm, "time", SimpleNamespace(time=lambda: clock[0], strftime=time.strftime))
        cfg = jm.configure(argv)[0]
        splits = _uneven(data.load_dataset("synthetic", None, 16, 0.0, 1.0),
                         [1] * 6 + [3] * 3 + [2] * 3, [8] * 6 + [3] * 6)
        backbone = jm.build_model(cfg)[0]
        with torch.no_grad():
            backbone.norm.weight.uniform_(0.5, 1.5)
            backbone.norm.bias.normal_(0.0, 0.5)
        learner, record = jm.start_learner(cfg, 0, backbone), jm.new_record(0)
        jm.run_seed(learner, record, splits, cfg, after_task)
    return dict(seen, record=record, log=log.getvalue(), tick=tick, cfg=cfg)


def _direct_numbers(learner, record, splits, factors, cfg):
    """Task t's row of each accuracy matrix, its prototypes, interference and geometry as
    recorded, and the same computed here, from each item of the split they name."""
    model, t = learner.model, len(record["acc_matrix"]) - 1
    tasks = data.task_classes(splits.num_classes, cfg.tasks)

    def encode(ds, classes):  # z, K/V inputs and labels of the images of these classes, one pass
        part = data.subset(ds, classes)
        with torch.no_grad():
            z, kv = model.encode(torch.stack([part[i][0] for i in range(len(part))]))
        return z, kv, torch.tensor(part.targets)
    seen = [c for classes in tasks[:t + 1] for c in classes]
    z, kv, y = encode(splits.test, seen)
    logits = torch.cat([head(z) for head in learner.heads], 1)
    task_of = torch.tensor([i for i, classes in enumerate(tasks[:t + 1]) for _ in classes])
    agnostic = logits.argmax(1) == y
    aware = logits.masked_fill(task_of[None] != task_of[y][:, None], -math.inf).argmax(1) == y
    got = dict(acc=record["acc_matrix"][t], aware=record["task_aware"][t],
               sample=record["sample_acc"][t], prototypes=learner.prototypes[tasks[t]])
    expected = dict(acc=[100 * float(agnostic[task_of[y] == i].double().mean())
                         for i in range(t + 1)],
                    aware=[100 * float(aware[task_of[y] == i].double().mean())
                           for i in range(t + 1)], sample=100 * float(agnostic.double().mean()))
    train_z, _, train_y = encode(splits.train_eval, tasks[t])  # the test transform
    expected["prototypes"] = torch.stack([F.normalize(F.normalize(train_z[train_y == c], dim=1)
                                                      .mean(0), dim=0) for c in tasks[t]])
    if t:  # Fig. 2 on real activations: per K/V layer, the root mean ||x dW^T||^2 over tokens
        now, old = task_of[y] == t, learner.prototypes
        for name, rows in (("past", ~now), ("current", now)):
            X = [x[rows].flatten(0, 1) for x in kv]
            expected[name] = [float((X[j // 2] @ (cfg.lora_scale * B @ A).T).pow(2).sum()
                                    / len(X[0])) ** 0.5 for j, (A, B) in enumerate(factors)]
            got[name] = record["interference"][t][name]
        zn = F.normalize(z[now], dim=1)
        expected.update(cos_old=(zn @ old[:tasks[t][0]].T).amax(1).tolist(),
                        cos_own=(zn * old[y[now]]).sum(1).tolist())
        got.update({key: record["geometry"][t][key] for key in ("cos_old", "cos_own")})
    return got, expected


def test_each_update_on_the_rare_batches_of_a_run_is_its_definitions(rare_run):
    """A task of fewer images than a batch, a last batch of one image (one class), batches that
    miss a class: at every step the loss is CE + lambda DML by Eq. (11) term by term (its softmax
    over the classes present, its hinge's mean over the batch and the old prototypes); the
    gradients GR receives are s B^T G_safe and s G_safe A^T of the dense G_safe = G (I - M M^T),
    and those it leaves its Eqs. (6)-(7) of them; V is OE's step by its float64 oracle, also on one
    image's 17 tokens, fewer than k = 24."""
    steps = rare_run["steps"]
    assert [(s["task"], len(s["y"])) for s in steps] == [(0, 6)] * 2 + [(1, 7), (1, 7), (1, 1)] * 2
    assert any(len(set(s["y"])) < 6 and len(s["y"]) > 1 for s in steps)  # a class missing
    assert min(s["tokens"] for s in steps) == 17 < rare_run["cfg"].k
    for s in steps:
        assert s["loss"] == pytest.approx(s["expected"], rel=1e-5)
        # float32's round-off: autograd's sums over the tokens, and the float32 X V of OE, which
        # one image's tokens, close to low-rank, grow
        assert max(s["safe"]) < 1e-3 and max(s["gr"]) < 1e-6 and max(s["oe"]) < 1e-2, s
    torch.manual_seed(0)
    z, old = torch.randn(5, 8, requires_grad=True), F.normalize(torch.randn(3, 8), dim=1)
    for y in ([2, 2, 2, 2, 2], [4], [0, 3, 3, 0, 4]):  # one class; one image; classes missing
        y = torch.tensor(y)
        loss = jm.dml_loss(z[:len(y)], y, old, 0.1, 0.07, num_classes=6)
        assert float(loss.detach()) == pytest.approx(float(_dml_direct(z[:len(y)], y, old, 0.1,
                                                                       0.07)))
        assert torch.isfinite(torch.autograd.grad(loss, z)[0]).all()


def test_each_task_starts_from_fresh_factors_and_a_basis_off_the_memory_it_starts_with(rare_run):
    """At each task's first step, A is off the memory as it stands after the last task's merge
    (not as it stood before it), B is 0, and OE's V is orthonormal and off that memory: the draws
    that the initial values' test checks alone, here where a run makes them."""
    fresh = rare_run["fresh"]
    assert len(fresh) == 2  # one a task
    assert all(f["A_on_M"] < 1e-6 and f["B"] == 0 for f in fresh), fresh
    assert all(f["V_orthonormal"] < 1e-5 and f["V_on_M"] < 1e-6 for f in fresh), fresh


def test_a_runs_numbers_measure_the_images_and_the_time_they_name(rare_run):
    """After each task: each accuracy row over the seen classes' test images, task-agnostic and
    task-aware, the accuracy over those samples, the prototypes of the task's training images
    under the test transform, the interference over past and current test images, and the
    geometry of the current ones, all as direct computations; each epoch's loss and accuracy are
    the means over its images, its throughput its images over its steps' time, and a task's
    time its start, training and end, not the evaluation or the analyses."""
    record, tick, log = rare_run["record"], rare_run["tick"], rare_run["log"]
    keys = {"acc", "aware", "sample", "prototypes"}  # and from task 2 on, the analyses'
    analyses = {"past", "current", "cos_old", "cos_own"}
    assert [set(e) for _, e in rare_run["tasks"]] == [keys, keys | analyses]
    for got, expected in rare_run["tasks"]:
        assert torch.allclose(got.pop("prototypes"), expected.pop("prototypes"), atol=1e-5)
        for key in expected:  # the cosines as results.json rounds them, to 4 places
            close = dict(abs=1e-4) if key.startswith("cos") else dict(rel=1e-5)
            assert got[key] == pytest.approx(expected[key], **close), key
    lines = re.findall(r"^seed 0 task \d/2 epoch \d/2  loss (\S+)  train acc +(\S+)%  +(\S+) "
                       r"img/s$", log, re.M)
    expected = []
    for t in range(2):  # each task's steps: its first epoch's, then its second's
        steps = [s for s in rare_run["steps"] if s["task"] == t]
        for epoch in (steps[:len(steps) // 2], steps[len(steps) // 2:]):
            n = sum(len(s["y"]) for s in epoch)
            expected.append((f"{sum(s['loss'] * len(s['y']) for s in epoch) / n:.4f}",
                             f"{100 * sum(s['right'] for s in epoch) / n:.2f}",
                             f"{n / (tick['train_step'] * len(epoch)):.1f}"))
    assert lines == expected
    step = tick["train_step"]  # 6 images in one step an epoch, then 15 in three
    assert record["throughput"] == [[6 / step] * 2, [15 / (3 * step)] * 2]
    assert record["task_seconds"] == [tick["start_task"] + tick["end_task"] + step * n
                                      for n in (2, 6)]


def test_initial_values_are_drawn_as_their_references_draw_them():
    """A fresh A is nn.Linear's weight (Kaiming-uniform, bound 1/sqrt(d_in)), the same draw then
    moved off M; B = 0; a new head is nn.Linear's weight and bias (bound 1/sqrt(D)); OE's first V
    is uniform (Haar) on the orthonormal k-frames off M, as the polar factor of a Gaussian draws
    them: two-sample KS statistics against the references' own draws, and their bounds."""
    gen = torch.Generator().manual_seed(0)
    layer, M = jm.LoRALinear(768, 8, 16, 1.0), orthonormal(768, 40, dtype=torch.float32, gen=gen)
    torch.manual_seed(1)
    reference = torch.nn.Linear(768, 16).weight.detach()
    for seed in (2, 3):
        torch.manual_seed(seed)
        layer.reset_()
        A = layer.A.detach().clone()
        assert _ks(A.flatten(), reference.flatten()) < 3 / math.sqrt(A.numel())
        assert not layer.B.detach().any()
        assert 0.99 < float(A.abs().max()) * math.sqrt(768) <= 1
    torch.manual_seed(3)
    layer.reset_(M)  # the draw of seed 3, off M
    assert torch.allclose(layer.A.detach(), A - A @ M @ M.T, atol=1e-6)
    torch.manual_seed(4)
    model, cfg = lora_vit(depth=1, img_size=16, patch_size=4), jm.Config(device="cpu", k=8)
    learner = jm.start_learner(cfg, 0, model)
    jm.start_task(learner, 0, [list(range(400))], None, cfg)
    reference = torch.nn.Linear(192, 400)
    for p, q in zip(learner.heads[0].parameters(), reference.parameters()):
        p, q = p.detach().flatten(), q.detach().flatten()
        assert _ks(p, q) < 3 / math.sqrt(len(p))
        assert 0.95 < float(p.abs().max()) * math.sqrt(192) <= 1
    L, D, m, k = 4000, 6, 2, 2
    M = orthonormal(D, m, dtype=torch.float32, gen=gen)
    V = jm.fresh_basis(M.expand(L, D, m), k)  # (L, D, k)
    assert torch.allclose(V.mT @ V, torch.eye(k).expand(L, k, k), atol=1e-5)
    assert float((M.T @ V).abs().max()) < 1e-5
    U = torch.linalg.svd(torch.eye(D) - M @ M.T).U[:, :D - m]  # an orthonormal basis off M
    P, _, Qh = torch.linalg.svd(torch.randn(L, D - m, k, generator=gen), full_matrices=False)
    haar = U @ P @ Qh  # the polar factor of a Gaussian: Haar, as O G is G for every orthogonal O
    ks = max(_ks(V[:, i, j], haar[:, i, j]) for i in range(D) for j in range(k))  # each entry's
    assert ks < 3 / math.sqrt(L)


def test_gpm_and_inflora_covariances_weigh_every_token_alike_over_a_short_last_batch():
    """kv_covariance over 10 images in batches of 4 (the last of 2): X^T X / n over every token,
    not a mean of the batches' covariances."""
    torch.manual_seed(5)
    x = 20 * torch.arange(10)[:, None, None, None] + torch.randint(0, 50, (10, 3, 2, 2))
    x = x.to(torch.uint8)  # images unlike from batch to batch, as the loaders take them
    X = (x / 255).flatten(2).mT.flatten(0, 1)  # the Identity backbone's K/V inputs, (40, 3)
    cfg = jm.Config(device="cpu", batch_size=4, workers=0)
    C = jm.kv_covariance(Identity(), _images(x, list(range(10))), cfg)
    assert C.shape == (1, 3, 3)
    assert rel(C[0], X.T @ X / len(X)) < 1e-6


# ========= janus_min.py, the protocol and the program: runs, the run folder, bad input ==========
TINY = ["--dataset", "synthetic", "--model", "vit_tiny", "--weights", "none", "--img-size", "32",
        "--patch-size", "8", "--tasks", "3", "--epochs", "2", "--batch-size", "16", "--k", "8",
        "--workers", "0", "--lr", "5e-3", "--device", "cpu"]  # the CPU: its numbers are compared


def _without(argv, flag, values=1):
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + values:]


# two tasks, an epoch each of 2 steps of 16 images: for the contracts that need a run, not numbers
SHORT = _without(_without(_without(TINY, "--tasks"), "--epochs"), "--batch-size") + [
    "--tasks", "2", "--epochs", "1", "--batch-size", "16", "--limit-per-class", "8"]


def _results(folder):
    return json.loads((folder / "results.json").read_text())


@contextlib.contextmanager
def ctrl_c_at_task(t):  # Ctrl-C as task t (from 1) starts: after the checkpoint of task t - 1
    real = jm.start_task

    def start_task(learner, index, *args):
        if index + 1 == t:
            raise KeyboardInterrupt
        return real(learner, index, *args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jm, "start_task", start_task)
        yield


@pytest.fixture
def no_plots(monkeypatch):  # matplotlib's drawing is half of a short run's time
    monkeypatch.setattr(jm, "plot", lambda results, out: [])
    monkeypatch.setattr(jm, "plot_set", lambda *args: [])  # a --reproduce set's figures


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):  # one TINY run, recording each step's lr, memories and OE's basis
    out = tmp_path_factory.mktemp("tiny") / "run"
    seen = {"lr": [], "protected": [], "leak": []}
    real_step = jm.train_step

    def train_step(learner, opt, *args):
        seen["lr"].append(float(opt.param_groups[0]["lr"]))
        layers = jm.lora_layers(learner.model)  # block j // 2's memory in its K and V layers
        seen["protected"].append(all(layer.M is learner.memory[j // 2]
                                     for j, layer in enumerate(layers)))
        out = real_step(learner, opt, *args)
        seen["leak"] += [float((M.T @ V).norm()) for M, V in zip(learner.memory, learner.oe.V)]
        return out
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as log:
        mp.setattr(jm, "train_step", train_step)
        code = jm.main(TINY + ["--out", str(out)])
    return dict(out=out, code=code, res=_results(out), log=log.getvalue(), **seen)


def test_end_to_end_results_lr_memory_and_learning(tiny_run):
    """Consistent results (fp32 on CPU); the schedule's lr; each block's memory; tasks learned."""
    res = tiny_run["res"]
    assert tiny_run["code"] == 0 and set(res) == {"config", "environment", "runs", "summary"}
    assert res["environment"]["torch"] == torch.__version__ and res["config"]["out"]
    assert res["environment"]["precision"] == "cpu fp32"  # what ran: autocast is CUDA's only
    r, A = res["runs"][0], res["runs"][0]["acc_matrix"]
    assert all(A[t][i] is None for t in range(3) for i in range(t + 1, 3))
    assert {k: r[k] for k in ("ACC", "MAA", "BWT")} == pytest.approx(jm.metrics(A))
    assert res["summary"]["ACC"] == {"mean": pytest.approx(r["ACC"]), "std": None}  # one seed
    aware = r["task_aware"]["acc_matrix"]  # right whenever the argmax over all seen classes is
    assert all(aware[t][i] >= A[t][i] for t in range(3) for i in range(t + 1))
    assert min(aware[t][t] for t in range(3)) >= 50
    assert [len(v) for v in r["violation"]["k"]] == [12, 12, 12]
    assert all(v is None for v in r["violation"]["k"][0])  # task 1: no memory yet, undefined
    assert all(0 < v < 0.2 for v in r["violation"]["k"][2])  # GR keeps the update off M
    assert r["interference"][0] is None and len(r["interference"][2]["past"]) == 24
    assert 0 <= r["geometry"][2]["danger"] <= 1 and len(r["task_seconds"]) == 3
    assert all(s in tiny_run["log"] for s in ("seed 0 task 3/3 epoch 2/2", "img/s", "Janus-LoRA;",
                                              "seed 0 task 3 accuracy per task: "))
    steps = len(tiny_run["lr"]) // 6  # 3 tasks x 2 epochs
    assert tiny_run["lr"] == pytest.approx([5e-3 * jm.lr_factor(e, 2, "inflora") for _ in range(3)
                                            for e in range(2) for _ in range(steps)])
    assert len(tiny_run["protected"]) == 6 * steps and all(tiny_run["protected"])
    assert max(tiny_run["leak"]) < 1e-5  # OE's V stays off the memory M, at every step


@pytest.mark.parametrize("method", list(jm.METHODS))
def test_every_method_runs_end_to_end(method, tmp_path, monkeypatch, no_plots):
    """Each preset: valid results; InfLoRA's violation is round-off; GPM's memory grows; each
    task's violation is against the M it started with, under M = V too, where V then moves."""
    widths, starts, ends, analysed, follows = [], [], [], [], []
    real_start, real_end, real_analyses = jm.start_task, jm.end_task, jm.record_analyses
    real_step = jm.train_step

    def train_step(learner, opt, images, y, cfg):  # each step's M: what protected() says now
        M = jm.protected(learner, cfg)
        follows.append(all(torch.equal(layer.M, M[j // 2])
                           for j, layer in enumerate(jm.lora_layers(learner.model))))
        return real_step(learner, opt, images, y, cfg)

    def start_task(learner, t, tasks, splits, cfg):
        real_start(learner, t, tasks, splits, cfg)
        starts.append([M.clone() for M in jm.protected(learner, cfg)])

    def end_task(learner, t, tasks, splits, cfg):
        ends.append([M.clone() for M in jm.protected(learner, cfg)])
        factors = real_end(learner, t, tasks, splits, cfg)
        widths.append([M.shape[1] for M in learner.memory])
        return factors

    def record_analyses(record, learner, t, factors, memory, *args):
        analysed.append(memory)
        return real_analyses(record, learner, t, factors, memory, *args)
    for name, spy in (("start_task", start_task), ("end_task", end_task),
                      ("record_analyses", record_analyses), ("train_step", train_step)):
        monkeypatch.setattr(jm, name, spy)
    assert jm.main(SHORT + ["--method", method, "--out", str(tmp_path)]) == 0
    r = _results(tmp_path)["runs"][0]
    assert {k: r[k] for k in ("ACC", "MAA", "BWT")} == pytest.approx(jm.metrics(r["acc_matrix"]))
    if method == "inflora":
        assert max(r["violation"]["k"][1] + r["violation"]["v"][1]) < 1e-5
    if method in ("lora-gpm", "lora-gpm-gr", "inflora"):
        assert 0 < min(widths[0]) and all(b >= a for a, b in zip(widths[0], widths[1]))
    expected = {"janus": [[8] * 12, [16] * 12], "janus-rolling": [[0] * 12] * 2,
                "finetune": [[0] * 12] * 2}
    assert widths == expected.get(method, widths)
    assert all(torch.equal(a, b) for a, b in zip(analysed[1], starts[1])) and all(follows)
    if method == "janus-rolling":  # M = V: it moved during the task
        assert not torch.equal(starts[1][0], ends[1][0])


def test_the_memory_keeps_the_past_tasks_outputs_on_the_generated_tasks_in_every_seed(
        tmp_path, monkeypatch, no_plots):
    """The first run's comparison, for the paper's reason: the generated tasks occupy different
    input subspaces, so Janus-LoRA's update, kept off the memory, leaves the past tasks' K/V
    outputs nearly as they were while it changes the current task's, in every seed; Fine-Tuning's
    update, and Janus-LoRA's with the memory switched off, change both alike. A 2-block ViT-Ti."""
    monkeypatch.setitem(vit.PRESETS, "vit_tiny",
                        functools.partial(vit.PRESETS["vit_tiny"], depth=2))
    ratios = {}  # per run, each seed's change of the past tasks' outputs over the current task's
    for name, flags in (("janus", []), ("finetune", ["--method", "finetune"]),
                        ("no memory", ["--no-oe"])):
        argv = _without(TINY, "--lr") + ["--seeds", "0", "1", "2", "--limit-per-class", "12"]
        assert jm.main(argv + flags + ["--out", str(tmp_path / name)]) == 0
        ratios[name] = [statistics.fmean(sum(i["past"]) / sum(i["current"])
                                         for i in r["interference"][1:])
                        for r in _results(tmp_path / name)["runs"]]
        print(name, "past / current output change per seed:", [f"{x:.2f}" for x in ratios[name]])
    assert max(ratios["janus"]) < 0.4 < 0.8 < min(ratios["finetune"] + ratios["no memory"])
    # what the past tasks' outputs keep, their heads keep: each finished task's task-aware accuracy
    for r in _results(tmp_path / "janus")["runs"]:
        aware = r["task_aware"]["acc_matrix"]
        assert all(aware[2][i] >= aware[i][i] - 100 / 32 for i in range(2))  # 1 image of 32 at most


def test_resume_alone_gives_the_uninterrupted_result(tiny_run, tmp_path, monkeypatch, capsys,
                                                     no_plots):
    """Ctrl-C as task 3 starts, then --resume DIR alone (CUDA visible): the uninterrupted run's
    numbers, bit for bit; the run's device kept, and its precision for a later resume on CUDA."""
    with ctrl_c_at_task(3):
        assert jm.main(TINY + ["--out", str(tmp_path / "b")]) == 130
    assert f"continue with: python janus_min.py --resume {tmp_path}/b" in capsys.readouterr().err
    assert not (tmp_path / "b" / "results.json").exists()
    with monkeypatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        assert jm.configure(["--resume", str(tmp_path / "b")])[0].device == "cpu"
        assert jm.configure(["--resume", str(tmp_path / "b"), "--device", "cuda"])[0].precision \
            == "bf16"  # the default's: a CPU runs in fp32 without changing the run
    assert jm.main(["--resume", str(tmp_path / "b")]) == 0
    assert "seed 0: resumed after task 2" in capsys.readouterr().out
    a, b = tiny_run["res"]["runs"][0], _results(tmp_path / "b")["runs"][0]
    for key in ("acc_matrix", "task_aware", "violation", "interference", "geometry"):
        assert a[key] == b[key]
    assert _results(tmp_path / "b")["environment"]["precision"] == "cpu fp32"


def test_a_run_folder_is_claimed_once_and_resumed_with_its_own_flags(
        tiny_run, tmp_path, capsys, monkeypatch):
    """A second run on a folder, even one started while the first loads, is refused; a folder
    with a stray run file too; a resume takes only the flags that may change, and more seeds."""
    out, second = str(tmp_path / "new"), []
    real_load = jm.load_data_and_model

    def load_and_start_another(cfg):
        second.append(jm.main(SHORT + ["--out", out]))  # the second run, while the first loads
        raise data.DataError("the first run stops here")
    monkeypatch.setattr(jm, "load_data_and_model", load_and_start_another)
    assert jm.main(SHORT + ["--out", out]) == 2 and second == [2]
    assert f"{out} holds a run: continue it with --resume {out}" in capsys.readouterr().err
    assert not os.path.exists(out)  # a failed start leaves nothing: the same command works
    monkeypatch.setattr(jm, "load_data_and_model", real_load)
    os.mkdir(out)
    shutil.copy(tiny_run["out"] / "checkpoint.pt", out)
    assert jm.main(SHORT + ["--out", out]) == 2  # a stray checkpoint is never adopted
    assert "holds checkpoint.pt of another run" in capsys.readouterr().err
    done = str(tiny_run["out"])
    for argv, said in ((TINY + ["--out", done], f"holds a run: continue it with --resume {done}"),
                       (["--resume", done, "--out", "x"], f"its own --out {done}: for --out x, "
                        "start a new run in a new folder"),
                       (["--resume", done, "--epochs", "3"], "its own --epochs 2: for --epochs 3,"),
                       (["--resume", done, "--seeds", "1"], "the run has the seeds 0")):
        assert jm.main(argv) == 2 and said in capsys.readouterr().err
    cfg = jm.configure(TINY)[0]  # a CUDA bf16 run resumed on a CPU is the same run, in fp32
    assert jm.differ({**dataclasses.asdict(cfg), "device": "cuda", "precision": "bf16"}, cfg) == ""
    assert jm.differ({**dataclasses.asdict(cfg), "epochs": 9}, cfg) == "--epochs"


def test_a_resume_refuses_damaged_files_a_foreign_checkpoint_and_another_backbone(
        tiny_run, tmp_path, capsys, monkeypatch):
    """--resume: a damaged config.json, results.json or checkpoint.pt, a checkpoint of other flags
    and a changed backbone file each get one line that names the file and what to do."""
    def copy_of_run(name):
        folder = tmp_path / name
        shutil.copytree(tiny_run["out"], folder)
        (folder / "results.json").unlink()  # seed 0 unfinished: its checkpoint is read
        return folder
    config = copy_of_run("config")
    (config / "config.json").write_text('{"argv": [')
    damaged = copy_of_run("checkpoint")
    (damaged / "checkpoint.pt").write_bytes((damaged / "checkpoint.pt").read_bytes()[:999])
    results = copy_of_run("results")
    (results / "results.json").write_text("{")
    foreign = copy_of_run("foreign")
    saved = json.loads((foreign / "config.json").read_text())
    saved["config"]["k"] = 16
    (foreign / "config.json").write_text(json.dumps(saved))
    for folder, said in ((config, "config.json is damaged (Expecting value: line 1 column 11 "
                                  "(char 10)): restore it, or start the run again with another "
                                  "--out"),
                         (damaged, "checkpoint.pt cannot be read (RuntimeError): restore it, "
                                   "or move it out of the folder"),
                         (results, "results.json is damaged"),
                         (foreign, "config.json has --k 16, not the --k 8 that checkpoint.pt was "
                                   "made with: put that back in it")):
        assert jm.main(["--resume", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    weights = tmp_path / "vit.pt"  # a run from a backbone file, interrupted after task 1
    torch.save(vit.PRESETS["vit_tiny"](img_size=32, patch_size=8).state_dict(), weights)
    original = weights.read_bytes()
    monkeypatch.chdir(tmp_path)  # the weights named by a relative path; the resume from elsewhere
    argv = _without(SHORT, "--weights") + ["--weights", "vit.pt", "--out", str(tmp_path / "w")]
    with ctrl_c_at_task(2):
        assert jm.main(argv) == 130
    monkeypatch.undo()
    sd = torch.load(weights, weights_only=True)
    torch.save({**sd, "head.weight": torch.zeros(3, 192)}, weights)  # another file of that name
    assert jm.main(["--resume", str(tmp_path / "w")]) == 2
    theirs, ours = hashlib.sha256(original).hexdigest()[:16], jm.sha256(weights)[:16]
    assert (f"the run started from the backbone {weights} (SHA-256 {theirs}...), not {weights} "
            f"(SHA-256 {ours}...): pass that file") in capsys.readouterr().err
    other = vit.PRESETS["vit_tiny"](img_size=32, patch_size=8)  # other numbers, the same size
    other.cls_token.data += 1
    torch.save(other.state_dict(), weights)
    assert len(weights.read_bytes()) == len(original) and weights.read_bytes() != original
    assert jm.main(["--resume", str(tmp_path / "w")]) == 2
    assert "the run started from the backbone" in capsys.readouterr().err
    weights.write_bytes(original)  # the run's file back: the run goes on
    assert jm.main(["--resume", str(tmp_path / "w")]) == 0


def _edit(name, change):  # the run file `name` edited as a person would: change(its content)
    def edit(folder):
        path = folder / name
        if name.endswith(".pt"):
            torch.save(change(torch.load(path, weights_only=True)), path)
        else:
            path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return edit


def _set(obj, where, value):  # obj with obj[where[0]][where[1]]... = value
    *inner, last = where
    functools.reduce(lambda d, k: d[k], inner, obj)[last] = value
    return obj


NOT_WRITTEN = "is not as this program writes it"
EDITED = {  # id: (how a person edited the finished TINY run's folder, what the one line says)
    "config-empty": (_edit("config.json", lambda c: {}),
                     f"config.json {NOT_WRITTEN} (it lacks argv, config): restore it"),
    "config-list": (_edit("config.json", lambda c: []), "(it has type list, not dict)"),
    "config-type": (_edit("config.json", lambda c: _set(c, ["config", "k"], "eight")),
                    "(config.k has type str, not int)"),
    "config-seed": (_edit("config.json", lambda c: _set(c, ["config", "seeds"], [0.5])),
                    "(config.seeds[0] has type float, not int)"),
    "config-field": (_edit("config.json", lambda c: _set(c, ["config", "colour"], 1)),
                     "(config has colour, which no flag sets)"),
    "results-empty": (_edit("results.json", lambda r: {}),
                      f"results.json {NOT_WRITTEN} (it lacks config, runs): restore it, or move it "
                      "out of the folder"),
    "results-entry": (_edit("results.json", lambda r: _set(r, ["runs", 0, "task_aware"], [])),
                      "(runs[0].task_aware has type list, not dict)"),
    "results-foreign": (_edit("results.json", lambda r: _set(r, ["config", "k"], 16)),
                        "results.json belongs to another run (its --k 16, not config.json's "
                        "--k 8)"),
    "results-seed": (_edit("results.json", lambda r: _set(r, ["config", "seeds"], [1])),
                     "(its seeds [0] are not among its config's seeds [1], each once)"),
    "checkpoint-empty": (_edit("checkpoint.pt", lambda c: {}), f"checkpoint.pt {NOT_WRITTEN} "
                         "(it lacks config, backbone, record, kv, heads, V, memory, prototypes, "
                         "rng): restore it, or move it out of the folder to run its seed again "
                         "from its first task"),
    "checkpoint-key": (_edit("checkpoint.pt", lambda c: _set(c, ["rng"], None)),
                       "(rng has type NoneType, not Tensor)"),
    "checkpoint-record": (_edit("checkpoint.pt", lambda c: _set(c, ["record", "seed"], "0")),
                          "(record.seed has type str, not int)"),
    "config-choice": (_edit("config.json", lambda c: _set(c, ["config", "dataset"], "mnist")),
                      "(config.dataset is 'mnist', not one of cifar100, domainnet, fashion-mnist"),
    "results-renamed": (_edit("results.json", lambda r: _set(r, ["runs", 0, "seed"], 7)),
                        "(its seeds [7] are not among its config's seeds [0], each once)"),
    "results-metric": (_edit("results.json", lambda r: _set(r, ["runs", 0, "MAA"], 99.0)),
                       "(runs[0].MAA is not what its accuracy rows give)"),
    "results-matrix": (_edit("results.json", lambda r: _set(r, ["runs", 0, "acc_matrix"],
                                                            [[1.0]])),
                       "(runs[0] is not a record of its 3 tasks: an item a task in each list"),
    "checkpoint-rows": (_edit("checkpoint.pt", lambda c: _set(c, ["record", "task_aware", 0],
                                                              [1.0, 2.0])),
                        "(record.task_aware is not what its accuracy rows give)"),
    "file": (None, "results.json: a file: name the run's folder, which holds its config.json"),
    "benchmark": (lambda folder: [os.remove(folder / "config.json"),
                                  (folder / "benchmark.json").write_text("{}")],
                  "holds a --benchmark's timings, which have no run to continue"),
}


@pytest.mark.parametrize("case", EDITED)
def test_a_run_file_a_person_edited_or_copied_gets_one_line_and_is_left_alone(
        case, tiny_run, tmp_path, capsys):
    """--resume on a run folder whose files a person edited, or copied from another run: each
    file is checked in one place against its shape and the run's config, and a file that fails
    gets one line that names it and what to do; the folder is left as it was."""
    edit, said = EDITED[case]
    folder = tmp_path / "run"
    shutil.copytree(tiny_run["out"], folder)
    if edit:
        edit(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert jm.main(["--resume", str(folder / "results.json" if case == "file" else folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


# ---- A run folder's contract: the advice of every refusal, followed, keeps each finished result;
# a folder holds one kind; the run files' values; moved paths; the data; the last tracebacks.
def _two_seeds(name):  # results.json and checkpoint.pt of a run of seeds 0 and 1: one more seed
    return _edit(name, lambda c: _set(c, ["config", "seeds"], [0, 1]))


ADVICE = {  # id: (how the finished TINY run's folder was edited, the flags of the resume, its line)
    "config-epochs": ([_edit("config.json", lambda c: _set(c, ["config", "epochs"], 3))], [],
                      "config.json has --epochs 3, not the --epochs 2 that results.json was made "
                      "with: put that back in it to continue the run"),
    "config-seed": ([_two_seeds("results.json"), _two_seeds("checkpoint.pt")], [],
                    "config.json has --seeds 0, not the --seeds 0 1 that results.json was made"),
    "config-refused": ([_edit("config.json", lambda c: _set(c, ["config", "lr"], -1)),
                        lambda folder: [(folder / n).unlink() for n in ("results.json",
                                                                        "checkpoint.pt")]],
                       [], f"config.json {NOT_WRITTEN} (--lr -1: must be positive): restore it, or "
                       "start the run again with another --out"),
    "config-free": ([_edit("config.json", lambda c: _set(c, ["config", "workers"], -1))], [],
                    "--workers -1: must be 0 or more (config.json's value, which a resume may "
                    "change: --resume "),
    "typed": ([], ["--lr", "5e-4"], "--resume continues the run with its own --lr 0.005: for --lr "
              "0.0005, start a new run in a new folder"),
    "results-foreign": ([_edit("results.json", lambda r: _set(r, ["config", "k"], 16))], [],
                        "results.json belongs to another run (its --k 16, not config.json's --k "
                        "8): restore it, or move it out of the folder (it keeps its seeds' "
                        "numbers)"),
    "checkpoint-foreign": ([_edit("checkpoint.pt", lambda c: _set(c, ["config", "k"], 16))], [],
                           "checkpoint.pt belongs to another run (its --k 16, not config.json's"),
    "results-metric": ([_edit("results.json", lambda r: _set(r, ["runs", 0, "ACC"], 99.0))], [],
                       "(runs[0].ACC is not what its accuracy rows give)"),
    "stray": ([lambda folder: (folder / "benchmark.json").write_text("{}")], [],
              "holds a run and, beside it, benchmark.json, a --benchmark's timings: move "
              "benchmark.json out of it to continue the run"),
}


def _follow(line, folder, aside):  # does what a refusal's line advises, never "restore it"
    named, argv = Path(line.split()[0]), ["--resume", str(folder)]
    if back := re.search(r" not the (.*?) that ", line):  # config.json's values, put back
        values = jm.parse(shlex.split(back[1]))[1]
        _edit("config.json", lambda c: _set(c, ["config"], {**c["config"], **values}))(folder)
    elif stray := re.search(r"move (\S+) out of it", line):
        shutil.move(folder / stray[1], aside)
    elif "move it out of the folder" in line:
        shutil.move(named, aside)
    elif change := re.search(r"a resume may change: (.*) VALUE\)$", line):
        argv = shlex.split(change[1]) + ["0"]  # --workers 0, the flag that the case edits
    elif "delete it" in line:
        named.unlink()
    else:  # a new run: the run's flags as typed, and those the line names, into another folder
        argv = json.loads((folder / "config.json").read_text())["argv"] + ["--out", str(aside)]
        if flags := re.search(r": for (.*), start a new run", line):
            argv += shlex.split(flags[1])
    return argv


@pytest.mark.parametrize("case", ADVICE)
def test_each_refusals_advice_followed_keeps_every_finished_result(
        case, tiny_run, tmp_path, capsys, monkeypatch, no_plots):
    """A run folder that a person edited (or a resume with a flag of another value): one line that
    names the file or the flag and what to do; done as it says, the command goes past every check
    (to training, stopped there), and each entry of results.json survives, bit for bit, in a
    file."""
    edits, flags, said = ADVICE[case]
    folder = tmp_path / "run"
    shutil.copytree(tiny_run["out"], folder)
    for edit in edits:
        edit(folder)
    done = _results(folder)["runs"] if (folder / "results.json").exists() else []
    assert jm.main(["--resume", str(folder), *flags]) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and said in line, line
    (tmp_path / "aside").mkdir()
    argv = _follow(line.removeprefix("error: "), folder, tmp_path / "aside")
    real = jm.run_seed

    def run_seed(learner, record, splits, cfg, after_task):  # past every check: stop at training
        if len(record["acc_matrix"]) < cfg.tasks:
            raise KeyboardInterrupt
        real(learner, record, splits, cfg, after_task)
    monkeypatch.setattr(jm, "run_seed", run_seed)
    assert jm.main(argv) in (0, 130)
    assert "error" not in capsys.readouterr().err
    kept = [r for path in tmp_path.rglob("*.json") for r in json.loads(path.read_text()).get(
        "runs", [])]
    assert all(entry in kept for entry in done)


def test_a_folder_holds_one_kind_and_every_command_refuses_another_kind(
        tiny_run, tmp_path, capsys, monkeypatch):
    """A run, a --reproduce set and a --benchmark each refuse another's folder, and a folder of
    runs, in one line that says what it holds and how to go on; --resume on an empty folder or a
    folder of runs says what it is. The benchmark holds its folder while it times, and its
    Ctrl-C says that nothing was saved, not how to resume a run."""
    run, bench, sets, empty = (tmp_path / "runs" / n for n in ("run", "bench", "set", "empty"))
    shutil.copytree(tiny_run["out"], run)
    for folder, name, text in ((bench, "benchmark.json", "{}"),
                               (sets, "reproduce.json", json.dumps({"argv": ["--reproduce", "k"]})),
                               (empty, None, None)):
        folder.mkdir()
        if name:
            (folder / name).write_text(text)
    bench_argv = SHORT + ["--benchmark", "--steps", "1"]
    for argv, said in (
            (bench_argv + ["--out", str(run)], f"{run} holds a run: continue it with --resume {run}"
             ", or choose another --out"),
            (SHORT + ["--out", str(bench)], "holds a --benchmark's timings, which have no run"),
            (SHORT + ["--out", str(sets)], "holds a --reproduce set, a row in each folder: "
             f"continue the set with: python janus_min.py --reproduce k --out {sets}, or choose"),
            (SHORT + ["--reproduce", "gr-plugin", "--out", str(run)], f"{run} holds a run"),
            (bench_argv + ["--out", str(tmp_path / "runs")], "holds runs in its folders, as run: "
             "choose another --out"),
            (["--resume", str(empty)], f"{empty} holds no run: start one there with --out {empty}"),
            (["--resume", str(tmp_path / "runs")], "holds no run, but its folders do: continue "
             f"one, as --resume {run}")):
        before = sorted(str(p) for p in tmp_path.rglob("*"))
        assert jm.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    held = []

    def mid_run_learner(*args):  # the benchmark's timing starts: its lock names this process
        held.append((bench / "lock").read_text())
        raise KeyboardInterrupt
    monkeypatch.setattr(jm, "mid_run_learner", mid_run_learner)
    assert jm.main(bench_argv + ["--out", str(bench)]) == 130  # its own kind: timed again
    assert held == [f"pid {os.getpid()} on {socket.gethostname()}\n"]
    assert capsys.readouterr().err == "\ninterrupted (SIGINT): nothing was saved\n"


def test_moved_data_and_weights_resume_and_the_code_of_each_seed_is_kept(
        tiny_run, tmp_path, capsys, monkeypatch, no_plots):
    """A resume takes --data-dir and --weights where they lie now (a weights file is checked as
    before, by its content), as the line that cannot find them says; a code edited between an
    interruption and the resume is kept beside the earlier one in the seed's entry."""
    weights = tmp_path / "vit.pt"
    torch.save(vit.PRESETS["vit_tiny"](img_size=32, patch_size=8).state_dict(), weights)
    folder = tmp_path / "run"  # the TINY run as if from that file, interrupted after its last task
    shutil.copytree(tiny_run["out"], folder)
    (folder / "results.json").unlink()
    _edit("config.json", lambda c: _set(c, ["config", "weights"], str(weights)))(folder)
    _edit("checkpoint.pt", lambda c: {**_set(c, ["config", "weights"], str(weights)), "backbone": {
        "path": str(weights), "sha256": jm.sha256(weights)}})(folder)
    moved = weights.rename(tmp_path / "moved.pt")
    assert jm.main(["--resume", str(folder)]) == 2
    line, then = capsys.readouterr().err.split(" If they moved: ")
    assert line == (f"error: --weights {weights} is neither a known name (in21k, sam, dino, none) "
                    "nor a file; pass another file with --weights PATH.")
    assert then == f"python janus_min.py --resume {folder} --weights PATH\n"
    code = jm.code_version()
    monkeypatch.setattr(jm, "code_version", lambda: {"sha256": "0" * 64, "git": "edited"})
    argv = shlex.split(then.replace("PATH", str(moved)))[2:]  # as printed, with the file's path
    assert jm.main(argv + ["--data-dir", "d"]) == 0
    config = json.loads((folder / "config.json").read_text())["config"]
    assert (config["weights"], config["data_dir"]) == (str(moved), os.path.abspath("d"))
    res = _results(folder)
    assert res["runs"][0]["code"] == [code, jm.code_version()] == [code, res["environment"]["code"]]


def test_imagenet_r_names_a_class_too_small_keeps_a_whole_split_and_notes_images_added(
        tmp_path, capsys, monkeypatch):
    """ImageNet-R (3 classes here): a class of fewer than 3 images is named, a class folder gone
    is counted, and neither start writes the split; --data-dir may name imagenet-r/ itself;
    images added after the split was drawn get a note that says how to draw it again."""
    monkeypatch.setitem(data.DATASETS["imagenet-r"], "num_classes", 3)
    folder, split = tmp_path / "imagenet-r", tmp_path / "imagenet-r_split.json"
    for c, n in enumerate((5, 5, 2)):
        (folder / WNIDS[c]).mkdir(parents=True)
        for i in range(n):
            (folder / WNIDS[c] / f"{i}.png").write_bytes(b"")  # not read until training
    for said in (f"its class {folder / WNIDS[2]} has 2 images, too few to split 80/20",
                 "2 training and 2 test classes, not 3"):
        with pytest.raises(data.DataError, match=re.escape(said)):
            _load("imagenet-r", tmp_path)
        assert not split.exists()
        if (folder / WNIDS[2]).exists():  # then the class folder gone
            (folder / WNIDS[2]).rename(tmp_path / "aside")
    (tmp_path / "aside" / "2.png").write_bytes(b"")  # the class back, with 3 images
    (tmp_path / "aside").rename(folder / WNIDS[2])
    drawn = _load("imagenet-r", tmp_path).train.source
    assert split.exists() and _load("imagenet-r", folder).train.source == drawn
    (folder / WNIDS[0] / "new.png").write_bytes(b"")
    assert _load("imagenet-r", tmp_path).train.source == drawn
    assert capsys.readouterr().out == (f"note: {split} leaves out the 1 images added to {folder} "
                                       "since it was drawn: to use them, delete it (a new split: "
                                       "not for a run that has begun)\n")


def test_ignored_workers_a_safetensors_file_and_a_failed_start_get_their_line(tmp_path, capsys):
    """--workers on in-memory data gets the note of an ignored flag, on files more than the cores
    a note and the cores (more would only share them, and fill the memory); a safetensors file,
    what to do with it; a start without data (offline) leaves no --data-dir behind."""
    many = _without(TINY, "--workers") + ["--workers", "99999999999999999999"]
    jm.configure(many)
    assert capsys.readouterr().out == "note: --workers: no effect with these settings, ignored\n"
    files = _without(_without(many, "--dataset"), "--tasks") + ["--dataset", "imagenet-r"]
    assert jm.configure(files)[0].workers == os.cpu_count()
    assert capsys.readouterr().out.startswith("note: --workers 99999999999999999999: this machine")
    assert jm.configure(_without(files, "--workers"))[0].workers == os.cpu_count()  # the default
    header = json.dumps({"cls_token": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    path = tmp_path / "w.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(4))
    with pytest.raises(vit.CheckpointError, match=rf"^{path} is a safetensors file, .* "
                       rf"torch.save\(s.load_file\('{path}'\), '{path}.pth'\)\", then pass "
                       rf"--weights {path}.pth$"):
        vit.load_pretrained(vit.PRESETS["vit_tiny"](), path)
    cifar = _without(_without(TINY, "--dataset"), "--tasks") + ["--dataset", "cifar100"]
    nested = tmp_path / "d" / "e" / "f"  # three folders a download would have made
    assert jm.main(cifar + ["--data-dir", str(nested), "--out", str(tmp_path / "r")]) == 2
    assert "cifar100 in" in capsys.readouterr().err and sorted(os.listdir(tmp_path)) == [path.name]


def test_a_closed_output_a_failed_write_and_a_second_ctrl_c_end_in_the_line_that_continues(
        tiny_run, tmp_path, capsys, monkeypatch, no_plots):
    """| head: the run stops as at SIGPIPE with the line that continues it; a checkpoint that cannot
    be written: one line with that command, the earlier checkpoint whole and no temporary file; a
    second Ctrl-C while the first stops the run is ignored."""
    folder = tmp_path / "run"
    shutil.copytree(tiny_run["out"], folder)
    (folder / "results.json").unlink()  # seed 0 resumes after its last task: it prints, then saves
    resume = ["--resume", str(folder)]
    then = f"continue with: python janus_min.py --resume {folder}\n"
    reader, writer = os.pipe()
    os.close(reader)  # as head does after its lines
    with monkeypatch.context() as mp, open(writer, "w") as closed:
        mp.setattr(sys, "stdout", closed)
        assert jm.main(resume) == 128 + signal.SIGPIPE
    assert capsys.readouterr().err == "\ninterrupted (SIGPIPE): " + then
    checkpoint = (folder / "checkpoint.pt").read_bytes()

    def save(obj, path):  # the disk fills as torch writes
        Path(path).write_bytes(b"PK\3\4")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    monkeypatch.setattr(jm, "run_seed", lambda learner, record, splits, cfg, after_task:
                        after_task(learner, record))
    monkeypatch.setattr(torch, "save", save)
    assert jm.main(resume) == 1
    assert capsys.readouterr().err == f"error: cannot write {folder}/checkpoint.pt (Pytorch" \
        "StreamWriter failed writing file data/0: file write failed): " + then
    assert (folder / "checkpoint.pt").read_bytes() == checkpoint and not list(folder.glob("*tmp"))
    monkeypatch.undo()
    real_release, handlers = jm.release, [signal.getsignal(s) for s in (signal.SIGINT,
                                                                        signal.SIGTERM)]

    def release(keys):  # a second Ctrl-C as the first ends the run
        os.kill(os.getpid(), signal.SIGINT)
        real_release(keys)
    monkeypatch.setattr(jm, "run_seed", lambda *args: os.kill(os.getpid(), signal.SIGINT))
    monkeypatch.setattr(jm, "release", release)
    try:
        assert jm.main(resume) == 130
    finally:
        for s, handler in zip((signal.SIGINT, signal.SIGTERM), handlers):
            signal.signal(s, handler)
    assert capsys.readouterr().err == "\ninterrupted (SIGINT): " + then


def test_a_python_without_torch_and_a_ctrl_c_in_the_imports_get_one_line(tmp_path):
    """Outside the environment (python -S: no site-packages), and Ctrl-C while torch loads or the
    standard library's first module does (as modules that raise it): one line each, no traceback,
    and exits 1 and 130."""
    for file in ("late/torch/__init__.py", "early/argparse.py"):  # each folder on a PYTHONPATH
        (tmp_path / file).parent.mkdir(parents=True)
        (tmp_path / file).write_text("raise KeyboardInterrupt\n")
    interrupted = "\ninterrupted (SIGINT) while starting: nothing was saved\n"
    for flags, env, code, said in (
            (["-S"], {}, 1, "error: No module named 'torch' in "),
            ([], {"PYTHONPATH": str(tmp_path / "late")}, 130, interrupted),
            ([], {"PYTHONPATH": str(tmp_path / "early")}, 130, interrupted)):
        done = subprocess.run([sys.executable, *flags, jm.__file__, "--help"], capture_output=True,
                              text=True, env={**os.environ, **env})
        assert done.returncode == code and done.stdout == "" and done.stderr.startswith(said)
        assert done.stderr.count("\n") == 1 + (code == 130), done.stderr


def test_sigterm_stops_a_run_as_ctrl_c_does_and_a_live_runs_folder_is_refused(
        tmp_path, monkeypatch, capsys):
    """A real run, started by the script's path from another folder into a folder whose name
    starts with a dash: while it lives (stopped), a second run on its folder is refused with its
    pid and host; SIGTERM, a scheduler's, ends it with Ctrl-C's line and exit 143, and that line,
    run as printed, continues the run."""
    script = os.path.realpath(jm.__file__)
    run = subprocess.Popen([sys.executable, script, *SHORT, "--out=-x"], cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (tmp_path / "-x" / "checkpoint.pt").exists() and run.poll() is None:  # task 1 done
        time.sleep(0.05)
    run.send_signal(signal.SIGSTOP)  # live, and paused while the second run tries its folder
    monkeypatch.chdir(tmp_path)
    assert jm.main(SHORT + ["--out=-x"]) == 2
    assert capsys.readouterr().err == (f"error: ./-x is in use by pid {run.pid} on "
                                       f"{socket.gethostname()}, which still runs: wait for it to "
                                       "end, or choose another --out\n")
    run.send_signal(signal.SIGTERM)
    run.send_signal(signal.SIGCONT)
    line = run.communicate()[1].splitlines()[-1]
    assert run.returncode == 143
    assert line == f"interrupted (SIGTERM): continue with: python {shlex.quote(script)} " \
                   "--resume ./-x"
    assert not (tmp_path / "-x" / "lock").exists()  # given back on the way out
    words = shlex.split(line.split(" with: ")[1])
    assert os.path.isfile(words[1]) and jm.main(words[2:]) == 0
    assert [r["seed"] for r in _results(tmp_path / "-x")["runs"]] == [0]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # main's handler is main's alone


HOLDER = """import fcntl, sys
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
lock.write("pid 7 on elsewhere")
lock.flush()
print("held", flush=True)
sys.stdin.read()"""


def test_reproduce_leaves_a_held_row_to_its_holder_and_its_interruption_names_the_set(
        tmp_path, capsys, no_plots):
    """While another process holds a row's folder, --reproduce runs the other rows and says so;
    Ctrl-C prints the command that continues the set, as --resume on the set's folder does; once
    the holder has died (SIGKILL), its lock is free, and that command takes its row."""
    sets = tmp_path / "set"
    (sets / "lora-gpm").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(sets / "lora-gpm" / "lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    argv = SHORT + ["--reproduce", "gr-plugin", "--out", str(sets)]
    try:
        assert holder.stdout.readline() == "held\n"
        with ctrl_c_at_task(1):  # as the other row starts
            assert jm.main(argv) == 130
        out, err = capsys.readouterr()
        assert f"lora-gpm: {sets}/lora-gpm is in use by pid 7 on elsewhere: skipped" in out
        assert "lora-gpm-gr: python " in out
        line = err.splitlines()[-1]
        assert line.startswith("interrupted (SIGINT): continue the set with: python ")
        assert jm.main(["--resume", str(sets)]) == 2  # what the folder is, and the same command
        assert capsys.readouterr().err.endswith(" with: " + line.split(" with: ")[1] + "\n")
    finally:
        holder.kill()
        holder.wait()
    words = shlex.split(line.split(" with: ")[1])
    assert jm.configure(words[2:])[0] == jm.configure(argv)[0]  # the set, into the same folder
    with ctrl_c_at_task(1):
        assert jm.main(words[2:]) == 130
    assert "lora-gpm: python " in capsys.readouterr().out  # the dead holder's row, taken


def test_paths_as_typed_and_a_failed_start_leaves_nothing(tmp_path, monkeypatch, capsys):
    """~ in a path flag is the home folder, a leading dash is a path, an empty path is refused in
    one line; a run that fails to start removes the folders it made."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.pth").write_bytes(b"")
    cfg = jm.configure(TINY + ["--out", "~/a", "--data-dir", "~/d", "--weights", "~/w.pth"])[0]
    assert [cfg.out, cfg.data_dir, cfg.weights] == [str(tmp_path / n) for n in ("a", "d", "w.pth")]
    assert jm.configure(TINY + ["--out=-a"])[0].out == "./-a"
    for name in jm.PATHS:
        assert jm.main(TINY + [jm.flag(name), ""]) == 2
        assert capsys.readouterr().err == f"error: {jm.flag(name)} '': an empty path: give one\n"
    cifar = _without(_without(TINY, "--dataset"), "--tasks") + ["--dataset", "cifar100"]
    assert jm.main(cifar + ["--data-dir", "nodata"]) == 2  # no data: the run does not start
    assert "cifar100" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_a_seed_added_on_resume_runs_after_the_interrupted_one_and_the_std_is_the_sample_std(
        tmp_path, monkeypatch, capsys):
    """A run interrupted in seed 1, resumed with seed 0 added before it: seed 1 goes on first
    (seed 0's checkpoint would replace its own), then seed 0; --limit-per-class draws each seed's
    own images; the summary's std over the seeds is the sample std."""
    thinned, real_thin = [], data.thin

    def thin(splits, limit, seed):
        thinned.append((limit, seed))
        return real_thin(splits, limit, seed)
    monkeypatch.setattr(data, "thin", thin)
    with ctrl_c_at_task(2):
        assert jm.main(SHORT + ["--seeds", "1", "--out", str(tmp_path)]) == 130
    assert jm.main(["--resume", str(tmp_path), "--seeds", "0", "1"]) == 0
    assert "seed 1: resumed after task 1" in capsys.readouterr().out
    assert thinned == [(8, 1), (8, 1), (8, 0)]
    assert json.loads((tmp_path / "config.json").read_text())["config"]["seeds"] == [0, 1]
    res = _results(tmp_path)
    assert [r["seed"] for r in res["runs"]] == [1, 0]
    for key in ("ACC", "MAA"):
        values = [r[key] for r in res["runs"]]
        assert res["summary"][key] == pytest.approx({"mean": statistics.fmean(values),
                                                     "std": statistics.stdev(values)})
    assert "sample" in res["summary"]["std"]
    if importlib.util.find_spec("matplotlib"):  # the plots redrawn with both seeds
        assert (tmp_path / "trajectory.png").exists()


def test_progress_comes_every_30_s_and_a_nan_loss_stops_the_run(tmp_path, monkeypatch, capsys):
    """A line every 30 s within an epoch, the first with the run's time at that speed; the
    training images a seed has; a diverged loss: one line, what to do, exit 2."""
    clock = iter(range(0, 10**6, 20))  # 20 s a reading
    monkeypatch.setattr(jm, "time", SimpleNamespace(time=lambda: next(clock),
                                                    strftime=time.strftime))
    argv = _without(_without(SHORT, "--lr"), "--epochs") + ["--lr", "1e30", "--epochs", "2",
                                                            "--seeds", "0", "1"]
    assert jm.main(argv + ["--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"^seed 0 task 1 epoch 1: \d/3 steps, loss [\d.na]+$", out, re.M)
    assert "synthetic: 96 training images, 2 tasks" in out  # --limit-per-class 8 of 24 a class
    # 32 images in the 60 s between two readings: 2 x 2 x 96 images at 32/60 img/s take 720 s
    assert re.findall("^note: at .*", out, re.M) == [
        "note: at 0.5 img/s on cpu, the run's training (2 epoch(s) of 96 images, 2 seed(s)) takes "
        "about 12.0 min"]
    assert "lower --lr and start again with another --out" in err and err.count("\n") == 1


# ---- The wiring, in a small world: a 2-block ViT-Ti, 16 px images, and the synthetic set with a
# training transform of its own (its images land in [10, 11], the others' in [0, 1]), so that each
# pass over the data shows which transform it saw. _watch records what a run did.
SMALL = _without(_without(TINY, "--img-size"), "--epochs") + [
    "--img-size", "16", "--epochs", "4", "--limit-per-class", "4"]  # a step of 16 images an epoch


@contextlib.contextmanager
def _small_world():
    real = data._transforms

    def transforms(name, img_size, mean, std):
        tfs, (train, test) = real(name, img_size, mean, std)
        return tfs, (train._replace(mean=-10.0), test)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(vit.PRESETS, "vit_tiny", functools.partial(vit.PRESETS["vit_tiny"], depth=2))
        mp.setattr(data, "_transforms", transforms)
        mp.setattr(jm, "plot", lambda results, out: [])
        yield mp


def _tensors(learner):  # every tensor a learner holds, by name
    named = {**learner.model.state_dict(), "prototypes": learner.prototypes,
             **{f"heads.{k}": v for k, v in learner.heads.state_dict().items()},
             **{f"memory.{i}": M for i, M in enumerate(learner.memory)}}
    if learner.oe is not None:
        named["V"] = learner.oe.V
    return {k: v.clone() for k, v in named.items()}


def _watch(argv, stop_at=None):
    """argv run in the small world (stop_at: Ctrl-C as that task starts), and what it did: each
    pass over the data as (task, phase, transform, images), the tensors each phase of a task
    changed, each step's lr (per param group), loss and the M it protected, the values that reached
    the code the flags name, and each checkpoint."""
    seen = {k: [] for k in ("passes", "changed", "lr", "loss", "protects", "dml", "delta", "gr",
                            "threshold", "inflora_a", "datasets", "thin", "loaders", "weights",
                            "learners", "checkpoints")}
    now = {"task": None, "phase": None}  # the task and the phase under way
    last = {}  # the last DML loss: its features, labels and value
    spied = [(jm, name) for name in (*PHASES, "train_step", "dml_loss", "run_seed",
                                     "rectify_factors", "rectify_gradients_", "rectify_updates_",
                                     "gpm_extend", "inflora_a", "save_checkpoint")] + [
        (data, "load_dataset"), (data, "thin"), (data, "make_loader"), (vit, "load_pretrained"),
        (vit.VisionTransformer, "encode")]
    real = {name: getattr(module, name) for module, name in spied}

    def phase(name):
        def call(*args):
            if name == "start_task":
                now["task"] = args[1]
            learner, now["phase"] = seen["learners"][-1], name
            before = _tensors(learner)
            out = real[name](*args)
            after, now["phase"] = _tensors(learner), None
            seen["changed"].append((now["task"], name, {
                k for k in before.keys() | after.keys()
                if k not in before or k not in after or not torch.equal(before[k], after[k])}))
            return out
        return call

    def encode(model, images):
        kind = "train" if images.min() >= 10 else "test" if images.max() <= 1 else "neither"
        seen["passes"].append((now["task"], now["phase"], kind, len(images)))
        return real["encode"](model, images)

    def train_step(learner, opt, images, y, cfg):
        layers, head = jm.lora_layers(learner.model), copy.deepcopy(learner.heads[-1])
        held = {"memory": learner.memory, "V": learner.oe and learner.oe.V}
        seen["protects"].append([name for name, Ms in held.items() if Ms is not None and all(
            torch.equal(layer.M, Ms[j // 2]) for j, layer in enumerate(layers))])
        seen["lr"].append((now["task"], [group["lr"] for group in opt.param_groups]))
        calls = len(seen["dml"])
        loss, right = real["train_step"](learner, opt, images, y, cfg)
        if len(seen["dml"]) > calls:  # the loss, Eq. (12): CE + lambda DML, at the step's start
            with torch.no_grad():
                ce = F.cross_entropy(head(last["z"]), last["y"])
            seen["loss"].append((float(loss), float(ce), float(last["dml"])))
        return loss, right

    def dml_loss(z, y, old, margin, tau, num_classes):
        out = real["dml_loss"](z, y, old, margin, tau, num_classes)
        last.update(z=z.detach(), y=y, dml=out.detach())
        seen["dml"].append((margin, tau))
        return out

    def save_checkpoint(learner, record, cfg, backbone):
        real["save_checkpoint"](learner, record, cfg, backbone)
        seen["checkpoints"].append(torch.load(Path(cfg.out) / "checkpoint.pt", weights_only=True))

    def spy(name, key, value=lambda *args: args):  # a callee that records value(*its args)
        def call(*args):
            seen[key].append(value(*args))
            return real[name](*args)
        return call
    spies = {**{name: phase(name) for name in PHASES}, "train_step": train_step,
             "dml_loss": dml_loss, "save_checkpoint": save_checkpoint, "encode": encode,
             "run_seed": spy("run_seed", "learners", lambda learner, *args: learner),
             "rectify_factors": spy("rectify_factors", "delta", lambda *args: args[-1]),
             "rectify_gradients_": spy("rectify_gradients_", "gr", lambda *a: "gradients"),
             "rectify_updates_": spy("rectify_updates_", "gr", lambda *a: "updates"),
             "gpm_extend": spy("gpm_extend", "threshold", lambda M, C, h: (now["task"], h)),
             "inflora_a": spy("inflora_a", "inflora_a", lambda *args: now["task"]),
             "load_dataset": spy("load_dataset", "datasets"),
             "thin": spy("thin", "thin", lambda splits, *args: args),
             "make_loader": spy("make_loader", "loaders", lambda ds, *args: args),
             "load_pretrained": spy("load_pretrained", "weights", lambda model, source: source)}
    with _small_world() as mp, contextlib.redirect_stdout(io.StringIO()) as log:
        for module, name in spied:
            mp.setattr(module, name, spies[name])
        with ctrl_c_at_task(stop_at) if stop_at else contextlib.nullcontext():
            code = jm.main(argv)
    out = Path(argv[argv.index("--out") + 1] if "--out" in argv else argv[1])
    done = (out / "results.json").exists()
    return dict(seen, argv=argv, code=code, log=log.getvalue(), out=out,
                res=_results(out) if done else None, cfg=jm.Config(**_config(out)))


PHASES = ("start_task", "train_task", "end_task", "evaluate", "record_analyses")


def _config(folder):
    return json.loads((folder / "config.json").read_text())["config"]


@pytest.fixture(scope="module")
def watched(tmp_path_factory):  # four small runs: Janus-LoRA, InfLoRA, fine-tuning, other flags
    tmp = tmp_path_factory.mktemp("watched")
    with _small_world():
        weights = tmp / "vit.pt"  # a backbone file: --weights names it
        torch.manual_seed(0)
        torch.save(vit.PRESETS["vit_tiny"](img_size=16, patch_size=4).state_dict(), weights)
    runs = {"janus": SMALL,
            "inflora": SMALL + ["--method", "inflora", "--schedule", "cosine",
                                "--gpm-threshold", "0.9", "0.99"],
            "finetune": SMALL + ["--method", "finetune"],
            "flags": OTHER_FLAGS + ["--data-dir", str(tmp / "data"), "--weights", str(weights),
                                    "--workers", str(os.cpu_count() - 1)]}  # below the cores
    return {name: _watch(argv + ["--out", str(tmp / name)]) for name, argv in runs.items()}


# every flag of a run at a value not its default, with one another's values told apart
OTHER_FLAGS = ["--dataset", "synthetic", "--model", "vit_tiny", "--tasks", "2", "--epochs", "2",
               "--batch-size", "8", "--img-size", "16", "--patch-size", "4",
               "--limit-per-class", "3", "--input-range", "half", "--rank", "3",
               "--lora-scale", "0.5", "--lr", "2e-3", "--schedule", "cosine", "--k", "5",
               "--oe-lr", "0.7", "--oe-decay-steps", "3", "--delta", "2e-3", "--margin", "0.25",
               "--lambda-dml", "1.5", "--tau", "0.09", "--rectify", "update",
               "--memory", "oe-rolling", "--seeds", "3", "--device", "cpu", "--precision", "fp32",
               "--steps", "3"]


# ---- 1. The lifecycle of a task: what each phase changes, and the transform each pass sees
def _phase_changes(cfg, t, phase):
    """The tensors that phase of task t must change, and those it may (GPM's memory grows by what
    the task's inputs need, possibly nothing)."""
    layers = [f"blocks.{i}.attn.{n}." for i in range(2) for n in "kv"]
    A, B, W = ({p + name for p in layers} for name in ("A", "B", "weight"))
    head = {f"heads.{t}.weight", f"heads.{t}.bias"}
    oe_runs = cfg.oe and cfg.memory != "gpm"
    memory = {f"memory.{i}" for i in range(2)}
    must = {"start_task": head | (A if cfg.lora_a == "inflora" else set()),
            "train_task": head | B | (A if cfg.lora_a == "trained" else set())
            | ({"V"} if oe_runs else set()),
            "end_task": W | A | B | {"prototypes"}
            | (memory | {"V"} if cfg.oe and cfg.memory == "oe" else set())}.get(phase, set())
    return must, memory if phase == "end_task" and cfg.oe and cfg.memory == "gpm" else set()


def _passes(cfg, t):
    """{phase: (the transform, images)} of each pass over the data in task t: the training
    transform to train; the test transform for the prototypes and GPM's covariance (the task's
    training images), InfLoRA's A (the same), evaluation and the analyses (the seen test images)."""
    per_task = 12 // cfg.tasks
    train, test = cfg.limit_per_class * per_task, 8 * per_task * (t + 1)  # synthetic: 8 a class
    counts = {"start_task": ("test", train if cfg.lora_a == "inflora" else 0),
              "train_task": ("train", cfg.epochs * train),
              "end_task": ("test", train * (2 if cfg.oe and cfg.memory == "gpm" else 1)),
              "evaluate": ("test", test), "record_analyses": ("test", test if t else 0)}
    return {phase: ({kind}, n) for phase, (kind, n) in counts.items() if n}


@pytest.mark.parametrize("run", ["janus", "inflora", "finetune", "flags"])
def test_each_phase_of_a_task_changes_its_own_tensors_and_sees_its_transform(watched, run):
    """In task t the start adds head t (and InfLoRA's A); training changes head t and the factors
    that train (and OE's V); the end merges, resets the pair, adds the prototypes and memory;
    evaluation and the analyses change nothing. The old heads and the backbone's other tensors
    never change. Each pass over the data sees its transform and its images."""
    r = watched[run]
    cfg = r["cfg"]
    assert r["code"] == 0 and [(t, p) for t, p, _ in r["changed"]] == [
        (t, p) for t in range(cfg.tasks) for p in PHASES]
    for t, phase, changed in r["changed"]:
        must, may = _phase_changes(cfg, t, phase)
        assert must <= changed <= must | may, (t, phase, changed ^ must)
    got = {}
    for t, phase, kind, n in r["passes"]:
        kinds, total = got.get((t, phase), (set(), 0))
        got[(t, phase)] = (kinds | {kind}, total + n)
    assert got == {(t, phase): seen for t in range(cfg.tasks)
                   for phase, seen in _passes(cfg, t).items()}


# ---- 2. Every flag reaches the code it names
def _scale_in_every_output(r, s):  # each K/V layer's output: W0 x + s B A x
    g, outputs = torch.Generator().manual_seed(0), []
    x = torch.randn(3, 192, generator=g)
    for layer in jm.lora_layers(copy.deepcopy(r["learners"][-1].model)):
        with torch.no_grad():
            layer.B.normal_(generator=g)
            lora = layer(x) - F.linear(x, layer.weight, layer.bias)
        outputs.append(torch.allclose(lora, s * x @ layer.A.T @ layer.B.T, atol=1e-5))
    return outputs == [True] * 4


def _oe_follows_its_oracle(r, lr, decay):  # the run's OE: a step at eta = lr decay / (decay + t)
    sub, t = copy.deepcopy(r["learners"][-1].oe), 2
    sub.t, V, X = t, sub.V.double(), torch.randn(2, 40, 192, generator=torch.Generator())
    sub.update(X, [torch.zeros(192, 0)] * 2)
    oracle = [_oe_oracle(v, x.double(), torch.zeros(192, 0, dtype=torch.float64), t,
                         torch.float32, lr, decay) for v, x in zip(V, X)]
    return all(rel(v.double(), o) < 1e-4 for v, o in zip(sub.V, oracle))


def _noted(r):  # the flags the run's note says have no effect
    ignored = "no effect with these settings, ignored"
    line = next(line for line in r["log"].splitlines() if line.endswith(ignored))
    return set(line.split(": ")[1].split())


def _device_chosen(argv):  # with a GPU visible: cuda by default, what --device says if typed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        return [jm.configure(a)[0].device for a in (_without(argv, "--device"), argv)]


def _compiled_blocks(argv):  # whether start_learner compiles each block (lazily: no trace yet)
    cfg = jm.configure(argv)[0]
    model = jm.start_learner(cfg, 0, jm.build_model(cfg)[0]).model
    return [block._compiled_call_impl is not None for block in model.blocks]


def _modes(argv):  # what main runs for argv: a run, --benchmark, --reproduce's rows (each's k)
    ran = []
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as out:
        mp.setattr(jm, "run", lambda cfg, typed: ran.append(("run", cfg.k)) or 0)
        mp.setattr(jm, "benchmark", lambda cfg: ran.append(("benchmark", cfg.k)) or 0)
        mp.setattr(jm, "write_set", lambda cfg, out, rows: None)  # no row's folder to read
        assert jm.main(argv) == 0
    printed = [shlex.split(line.split(": python janus_min.py ")[1]) for line in
               out.getvalue().splitlines() if ": python janus_min.py " in line]
    return ran, [jm.configure(row)[0].k for row in printed]


REPRODUCE_K = SMALL + ["--reproduce", "k"]
FLAG_ROWS = {  # field: (the watched run or the command that sets it, what shows its value)
    "dataset": ("flags", lambda r: [args[0] for args in r["datasets"]] == ["synthetic"]),
    "data_dir": ("flags", lambda r: r["datasets"][0][1] == str(r["out"].parent / "data")),
    "tasks": ("flags", lambda r: len(r["res"]["runs"][0]["acc_matrix"]) == 2),
    "epochs": ("flags", lambda r: re.findall(r"^seed \d+ task 2/2 epoch (.*?) ", r["log"], re.M)
               == ["1/2", "2/2"]),
    "batch_size": ("flags", lambda r: {args[0] for args in r["loaders"]} == {8}),
    "img_size": ("flags", lambda r: r["datasets"][0][2] == 16
                 and r["learners"][0].model.pos_embed.shape[1] == 1 + 4 * 4),
    "limit_per_class": ("flags", lambda r: r["thin"] == [(3, 3)]),
    "input_range": ("flags", lambda r: r["datasets"][0][3:5] == vit.MEAN_STD["half"]),
    "model": ("flags", lambda r: r["learners"][0].model.embed_dim == 192),
    "weights": ("flags", lambda r: r["weights"] == [str(r["out"].parent / "vit.pt")] and
                torch.equal(r["learners"][0].model.patch_embed.weight, torch.load(
                    r["out"].parent / "vit.pt", weights_only=True)["patch_embed.weight"])),
    "patch_size": ("flags", lambda r: r["learners"][0].model.patch_embed.kernel_size == (4, 4)),
    "rank": ("flags", lambda r: [layer.A.shape[0] for layer in jm.lora_layers(
        r["learners"][0].model)] == [3] * 4),
    "lora_scale": ("flags", lambda r: _scale_in_every_output(r, 0.5)),
    "method": ("inflora", lambda r: [getattr(r["cfg"], s) for s in jm.SWITCHES] == [
        True, False, False, "grad", "gpm", "inflora"] and r["inflora_a"] and not r["gr"]),
    "lr": ("flags", lambda r: r["lr"][0] == (0, [2e-3])),
    "schedule": ("flags", lambda r: [lrs for t, lrs in r["lr"] if t == 1]
                 == [[2e-3]] * 3 + [[pytest.approx(1e-3)]] * 3),
    "k": ("flags", lambda r: r["learners"][0].oe.V.shape == (2, 192, 5)),
    "oe_lr": ("flags", lambda r: _oe_follows_its_oracle(r, 0.7, 3)),
    "oe_decay_steps": ("flags", lambda r: _oe_follows_its_oracle(r, 0.7, 3)),
    "delta": ("flags", lambda r: len(r["delta"]) == 12 and set(r["delta"]) == {2e-3}),
    "margin": ("flags", lambda r: len(r["dml"]) == 12 and {m for m, _ in r["dml"]} == {0.25}),
    "lambda_dml": ("flags", lambda r: len(r["loss"]) == 12 and all(
        loss == pytest.approx(ce + 1.5 * dml) for loss, ce, dml in r["loss"])),
    "tau": ("flags", lambda r: {tau for _, tau in r["dml"]} == {0.09}),
    "oe": ("finetune", lambda r: r["learners"][0].oe is None
           and [M.shape for M in r["learners"][0].memory] == [(192, 0)] * 2),
    "gr": ("finetune", lambda r: r["gr"] == [] and r["delta"] == []),
    "dml": ("finetune", lambda r: r["dml"] == [] and r["loss"] == []),
    "rectify": ("flags", lambda r: r["gr"] == ["updates"] * 12),
    "memory": ("flags", lambda r: r["protects"] == [["V"]] * 12
               and [M.shape for M in r["learners"][0].memory] == [(192, 0)] * 2),
    "gpm_threshold": ("inflora", lambda r: [h for t, h in r["threshold"] if t == 0] == [0.9] * 2),
    "lora_a": ("inflora", lambda r: r["inflora_a"] == [0, 0, 1, 1, 2, 2] and all(
        not name.endswith(".A") for _, phase, changed in r["changed"] if phase == "train_task"
        for name in changed)),
    "seeds": ("flags", lambda r: [run["seed"] for run in r["res"]["runs"]] == [3]
              and [args[3] for args in r["loaders"] if args[1]] == [3000, 3001]),
    "device": (SMALL, lambda argv: _device_chosen(argv) == ["cuda", "cpu"]),
    "precision": ("flags", lambda r: "--precision" in _noted(r)),  # autocast is CUDA's
    "compile": (SMALL + ["--compile"], lambda argv: _compiled_blocks(argv) == [True] * 12
                and _compiled_blocks(SMALL) == [False] * 12 and jm.compiled(dataclasses.replace(
                    jm.configure(SMALL)[0], device="cuda"))),  # auto: on for CUDA only
    "workers": ("flags", lambda r: {args[2] for args in r["loaders"]} == {os.cpu_count() - 1}),
    "out": ("flags", lambda r: r["res"]["config"]["out"] == str(r["out"])),
    "resume": (["--resume", "{flags}"], lambda argv: jm.differ(
        _config(Path(argv[1])), jm.configure(argv)[0]) == ""),
    "benchmark": (SMALL + ["--benchmark"], lambda argv: _modes(argv) == ([("benchmark", 8)], [])),
    "steps": ("flags", lambda r: "--steps" in _noted(r)),  # --benchmark's
    "reproduce": (REPRODUCE_K + ["--dry-run"], lambda argv: _modes(argv)[1] == [25, 50, 75, 100]),
    "row": (REPRODUCE_K + ["--row", "k75"], lambda argv: _modes(argv) == ([("run", 75)], [75])),
    "dry_run": (REPRODUCE_K + ["--dry-run"], lambda argv: _modes(argv)[0] == []),
}


def test_every_flag_reaches_the_code_it_names(watched):
    """A row per field of Config, and a field without one fails: a run or a command that sets it
    to a value not its default, and what shows that value at work where the flag says (or the
    program's note that it has no effect there)."""
    assert set(FLAG_ROWS) == {f.name for f in dataclasses.fields(jm.Config)}
    defaults = {**dataclasses.asdict(jm.Config()), **data.DATASETS["synthetic"],
                "workers": os.cpu_count(), "gpm_threshold": [0.95, 1.0]}
    for name, (source, shows) in FLAG_ROWS.items():
        if isinstance(source, str):
            argv, x = watched[source]["argv"], watched[source]
        else:
            argv = x = [a.replace("{flags}", str(watched["flags"]["out"])) for a in source]
        assert jm.parse(argv)[0][name] != defaults[name], name
        assert shows(x), name


# ---- 3. The presets and the --reproduce rows against the paper (janus-lora.tex)
JANUS = dict(oe=True, gr=True, dml=True, rectify="grad", memory="oe", lora_a="trained")
PAPER_METHODS = {  # --method: its name in the paper's tables, and its switches where not Janus's
    "janus": ("Janus-LoRA", {}), "janus-rolling": ("Janus-LoRA, M = V", dict(memory="oe-rolling")),
    "finetune": ("Fine-Tuning", dict(oe=False, gr=False, dml=False)),
    "lora-gpm": ("LoRA-GPM", dict(memory="gpm", gr=False, dml=False)),
    "lora-gpm-gr": ("LoRA-GPM + GR", dict(memory="gpm", dml=False)),
    "inflora": ("InfLoRA", dict(memory="gpm", lora_a="inflora", gr=False, dml=False))}
PAPER_ROWS = {  # --reproduce NAME: {row: what the paper's row changes from Janus-LoRA's defaults}
    "demo": {"finetune": dict(PAPER_METHODS["finetune"][1], method="finetune"),  # the quick start
             "janus": dict(method="janus"), "janus-update": dict(method="janus", rectify="update")},
    "ablation": {str(i): dict(oe=oe, gr=gr, dml=dml) for i, (oe, gr, dml) in enumerate([
        (False, False, False), (False, False, True), (True, False, False), (False, True, False),
        (True, True, False), (True, False, True), (True, True, True)], 1)},  # Table 1's marks
    "methods": {m: dict(PAPER_METHODS[m][1], method=m)  # Tables 2 and 3's that we implement
                for m in ("finetune", "lora-gpm", "inflora", "janus")},
    "oe-vs-gpm": {"gpm": dict(memory="gpm", epochs=1), "oe": dict(epochs=1)},  # Table 5
    "gr-plugin": {m: dict(PAPER_METHODS[m][1], method=m)  # Fig. 6
                  for m in ("lora-gpm", "lora-gpm-gr")},
    "k": {f"k{k}": dict(k=k) for k in (25, 50, 75, 100)},  # Fig. 4a: "k from 25 to 100"
    "margin": {f"m{m}": dict(margin=m) for m in (0.1, 0.2, 0.3, 0.4, 0.5)},  # Fig. 4b, to 0.5
    "lambda": {f"l{v}": dict(lambda_dml=v) for v in (0.5, 1.0, 1.5, 2.0)},  # "0.5 to 2.0"
    "backbones": {w: dict(weights=w) for w in ("in21k", "sam", "dino")}}  # Tables 2 and 4


def test_presets_and_reproduce_rows_are_the_papers(capsys):
    """Each --method gives its switches and its name in the paper, and a switch typed with it wins;
    each --reproduce row, as --dry-run prints it, is the flags typed plus the paper's row."""
    checked = 0
    for method, (name, switches) in PAPER_METHODS.items():
        cfg = jm.configure(["--method", method, "--device", "cpu"])[0]
        assert {s: getattr(cfg, s) for s in jm.SWITCHES} == {**JANUS, **switches}
        assert jm.describe(dataclasses.asdict(cfg)) == name
        for f in dataclasses.fields(jm.Config):
            values = [False, True] if f.type is bool else f.metadata.get("choices", [])
            for value in values if f.name in jm.SWITCHES else []:
                try:
                    cfg = jm.configure(["--method", method, *jm.to_argv({f.name: value}),
                                        "--device", "cpu"])[0]
                except jm.ConfigError:  # --lora-a inflora with GR on
                    continue
                got = {s: getattr(cfg, s) for s in jm.SWITCHES}
                assert got == {**JANUS, **switches, f.name: value}
                described = jm.describe(dataclasses.asdict(cfg))
                names = [n for n, s in PAPER_METHODS.values() if {**JANUS, **s} == got]
                assert described == names[0] if names else described.startswith("custom: ")
                checked += 1
    # each preset, each value a switch's flag types (--oe and --no-oe ...); 4 refused: --lora-a
    # inflora under the 3 presets with GR, and --gr under InfLoRA's
    assert checked == 6 * 13 - 4
    base = ["--dataset", "imagenet-r", "--epochs", "3", "--device", "cpu"]
    assert set(PAPER_ROWS) == set(jm.REPRODUCE)
    for name, rows in PAPER_ROWS.items():
        capsys.readouterr()
        assert jm.main(base + ["--reproduce", name, "--dry-run"]) == 0
        printed = [line.split(": python janus_min.py ") for line in
                   capsys.readouterr().out.splitlines() if ": python janus_min.py " in line]
        assert [row for row, _ in printed] == list(rows)
        for row, argv in printed:
            cfg = jm.configure(shlex.split(argv))[0]
            expected = dataclasses.replace(jm.configure(base)[0], **{**JANUS, **rows[row]})
            assert jm.differ(dataclasses.asdict(expected), cfg) == "", (name, row)


# ---- 4. The schedules against the InfLoRA codebase's formulas, at every task and epoch
def _codebase_cosine_schedule(K):
    """The lr factor of each of K epochs as utils/schedulers.py's CosineSchedule gives it, stepped
    as methods/inflora.py's train_function steps it: its __init__ calls step(0), then sets
    last_epoch = -1; each epoch trains, then calls step(), which adds 1 to last_epoch."""
    def cosine(last_epoch):
        return math.cos((99 * math.pi * last_epoch) / (200 * (K - 1)))
    factor, last_epoch, factors = cosine(0), -1, []
    for _ in range(K):
        factors.append(factor)
        last_epoch += 1
        factor = cosine(last_epoch)
    return factors


def _cosine_annealing(K):  # torch's CosineAnnealingLR(T_max=K), the codebase's other schedule
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule, factors = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=K), []
    for _ in range(K):
        factors.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return factors


def test_schedules_follow_the_inflora_codebase_at_every_task_and_epoch(watched):
    """Each step's lr in every task and epoch, both schedules; lr_factor at every K up to 30 (one
    epoch: the codebase divides by zero, we train at --lr); GPM's energy threshold of task t of T,
    as methods/inflora.py's update_DualGPM: (lame - lamb) * cur_task / total_sessions + lamb."""
    for K in range(2, 31):
        assert [jm.lr_factor(e, K, "inflora") for e in range(K)] == pytest.approx(
            _codebase_cosine_schedule(K), rel=1e-12)
    for K in range(1, 31):
        assert [jm.lr_factor(e, K, "cosine") for e in range(K)] == pytest.approx(
            _cosine_annealing(K), rel=1e-9, abs=1e-12)
    assert jm.lr_factor(0, 1, "inflora") == 1.0
    for run, codebase in (("janus", _codebase_cosine_schedule), ("inflora", _cosine_annealing),
                          ("flags", _cosine_annealing)):
        r = watched[run]
        cfg = r["cfg"]
        steps = math.ceil(cfg.limit_per_class * (12 // cfg.tasks) / cfg.batch_size)  # an epoch's
        lr = float(r["argv"][r["argv"].index("--lr") + 1])
        expected = [(t, [lr * f]) for t in range(cfg.tasks) for f in codebase(cfg.epochs)
                    for _ in range(steps)]
        assert r["lr"] == [(t, pytest.approx(lrs, rel=1e-12)) for t, lrs in expected]
    lamb, lame = 0.9, 0.99  # the inflora run's --gpm-threshold; InfLoRA's lamb and lame
    total_sessions = watched["inflora"]["cfg"].tasks
    expected = [(cur_task, (lame - lamb) * cur_task / total_sessions + lamb)
                for cur_task in range(total_sessions) for _ in range(2)]  # a call per block
    assert watched["inflora"]["threshold"] == [(t, pytest.approx(h)) for t, h in expected]


# ---- 5. Each reported number from its own source
def _acc_maa_bwt(rows):  # Sec. 4.1 on rows[t] = the accuracy on tasks 1..t+1 after task t+1
    T = len(rows)
    return {"ACC": sum(rows[-1]) / T, "MAA": sum(sum(row) / len(row) for row in rows) / T,
            "BWT": sum(rows[-1][i] - rows[i][i] for i in range(T - 1)) / (T - 1)}


def _mean_and_sample_std(values):
    m = sum(values) / len(values)
    return {"mean": m, "std": math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))}


def test_each_reported_number_comes_from_its_own_source(tmp_path):
    """A run of two seeds whose evaluation is hand-built, the task-aware matrix apart from the
    task-agnostic one: results.json's matrices, ACC, MAA, BWT and the task-aware three, sample_ACC,
    the summary's mean and sample std; the lines printed; table.md's cells from results.json."""
    given = []  # (task-agnostic row, task-aware row, accuracy over samples) of each evaluation

    def evaluate(model, heads, splits, tasks, cfg):
        g, t = torch.Generator().manual_seed(len(given)), len(heads)
        draws = (100 * torch.rand(2 * t + 1, generator=g)).round(decimals=2).tolist()
        given.append((draws[:t], draws[t:-1], draws[-1]))
        return given[-1]
    out = tmp_path / "k25"
    with _small_world() as mp, contextlib.redirect_stdout(io.StringIO()) as log:
        mp.setattr(jm, "evaluate", evaluate)
        assert jm.main(SMALL + ["--epochs", "1", "--seeds", "0", "1", "--out", str(out)]) == 0
    res, seeds = _results(out), [given[:3], given[3:]]
    for run, evaluations in zip(res["runs"], seeds):
        agnostic, aware, samples = map(list, zip(*evaluations))
        assert run["acc_matrix"] == [row + [None] * (2 - t) for t, row in enumerate(agnostic)]
        assert run["task_aware"]["acc_matrix"] == [row + [None] * (2 - t)
                                                   for t, row in enumerate(aware)]
        assert run["sample_acc"] == samples
        assert {k: run[k] for k in ("ACC", "MAA", "BWT")} == pytest.approx(_acc_maa_bwt(agnostic))
        assert {k: run["task_aware"][k] for k in ("ACC", "MAA", "BWT")} == pytest.approx(
            _acc_maa_bwt(aware))
    summary = {"sample_ACC": _mean_and_sample_std([e[-1][2] for e in seeds])}
    for key in ("ACC", "MAA", "BWT"):
        summary[key] = _mean_and_sample_std([_acc_maa_bwt([e[0] for e in s])[key] for s in seeds])
        summary[f"aware {key}"] = _mean_and_sample_std([_acc_maa_bwt([e[1] for e in s])[key]
                                                        for s in seeds])
        assert res["summary"]["task_aware"][key] == pytest.approx(summary[f"aware {key}"])
    for key in ("ACC", "MAA", "BWT", "sample_ACC"):
        assert res["summary"][key] == pytest.approx(summary[key])
    lines = log.getvalue().splitlines()
    printed = [re.findall(r"-?\d+\.\d+", line.rsplit(" | ", 1)[0]) for line in lines
               if " accuracy per task: " in line]  # its time left out
    assert printed == [[f"{a:.2f}" for a in (*agnostic, sum(agnostic) / len(agnostic), sample,
                                             sum(aware) / len(aware))] for agnostic, aware, sample
                       in given]
    stats = next(line for line in lines if line.startswith("ACC "))
    assert stats == "  ".join(f"{k} {summary[k]['mean']:.2f} +- {summary[k]['std']:.2f}" for k in
                              ("ACC", "MAA", "BWT", "sample_ACC")) + \
        f"  over 2 seed(s); task-aware ACC {summary['aware ACC']['mean']:.2f}"
    assert [line.split(" | ")[1].split() for line in lines if re.match(r" +\d \| ", line)] == [
        [f"{a:.1f}" for a in row] + ["-"] * (2 - t) for t, (row, _, _) in enumerate(given[3:])]
    cfg = jm.Config(**dict(res["config"], reproduce="k"))
    with contextlib.redirect_stdout(io.StringIO()):
        jm.write_table(cfg, tmp_path, {"k25": "--k 25"}, {"k25": res}, [])
    row = next(line for line in (tmp_path / "table.md").read_text().splitlines()
               if line.startswith("| k25 |"))
    runs = res["runs"]
    violations = [v for r in runs for n in "kv" for task in r["violation"][n] for v in task
                  if v is not None]
    change = [[v for r in runs for i in r["interference"][1:] for v in i[inputs]]
              for inputs in ("past", "current")]  # tasks 2..T, each K/V layer, each seed
    danger = [g["danger"] for r in runs for g in r["geometry"] if g]
    seconds = [s for r in runs for s in r["task_seconds"]]
    assert row.split(" | ") == [
        "| k25", "`--k 25`", "2", *[f"{summary[k]['mean']:.2f} ± {summary[k]['std']:.2f}" for k in
                                    ("ACC", "MAA", "BWT", "aware ACC", "aware BWT")],
        *[f"{statistics.fmean(c):.3g}" for c in change], f"{statistics.fmean(violations):.2e}",
        f"{statistics.fmean(danger):.3f}", f"{statistics.fmean(seconds):.1f} |"]


# ---- 7. A resume carries all that the learner holds into the tasks after it
def _same(a, b):  # equal, tensors bit for bit
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("run", ["janus", "inflora", "flags"])  # OE's memory, GPM's, M = V
def test_a_resume_after_the_first_task_carries_the_whole_learner(watched, tmp_path, run):
    """Ctrl-C as task 2 starts, then --resume: each checkpoint after it equals the uninterrupted
    run's, field by field (the K/V layers, the heads, V, the memory, the prototypes, the generator,
    the record but its times), and so do the results."""
    _resume_and_compare(watched[run], tmp_path / run, stop_at=2)


def _resume_and_compare(ref, out, stop_at):
    """ref's run again into out, Ctrl-C as task stop_at starts, then --resume: each checkpoint
    and the results, but their times, as ref's."""
    first = _watch(_without(ref["argv"], "--out") + ["--out", str(out)], stop_at=stop_at)
    resumed = _watch(["--resume", str(out)])
    assert first["code"] == 130 and resumed["code"] == 0
    assert f"seed {ref['cfg'].seeds[0]}: resumed after task {stop_at - 1}" in resumed["log"]
    checkpoints = first["checkpoints"] + resumed["checkpoints"]
    assert len(checkpoints) == len(ref["checkpoints"]) == ref["cfg"].tasks
    times = ("task_seconds", "throughput")
    drop = {"config": ("out", "resume"), "record": times}  # what may differ
    for t, (a, b) in enumerate(zip(ref["checkpoints"], checkpoints)):
        assert a.keys() == b.keys()
        for key in a:
            x, y = ({k: v for k, v in d[key].items() if k not in drop[key]} if key in drop
                    else d[key] for d in (a, b))
            assert _same(x, y), (t, key)
    a, b = ref["res"]["runs"][0], resumed["res"]["runs"][0]
    assert _same({k: v for k, v in a.items() if k not in times},
                 {k: v for k, v in b.items() if k not in times})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_run_resumed_after_task_2_gives_the_uninterrupted_run(tmp_path):
    """On CUDA, in bf16 autocast, with the deterministic kernels that make two runs comparable:
    Ctrl-C after task 2 of 3, then --resume; every later checkpoint and the results bit for bit."""
    torch.use_deterministic_algorithms(True, warn_only=True)  # e.g. attention's backward
    try:
        argv = _without(SMALL, "--device") + ["--device", "cuda", "--compile", "off"]  # eager
        ref = _watch(argv + ["--out", str(tmp_path / "ref")])
        assert ref["code"] == 0 and ref["res"]["environment"]["precision"] == "cuda bf16"
        _resume_and_compare(ref, tmp_path / "resumed", stop_at=3)
    finally:
        torch.use_deterministic_algorithms(False)


# ---- Beyond: a memory that fills, and the lines a run prints
def test_a_memory_that_fills_leaves_k_and_v_alone_in_the_later_tasks(tmp_path):
    """--k 96 fills each block's memory (192 wide) after task 2 of 3, as the note says: in task 3
    A = 0 and B = 0 stay exactly, W0 bit for bit, OE has no basis, the violation is undefined; the
    head still trains and every reported number is finite."""
    r = _watch(SMALL + ["--k", "96", "--epochs", "1", "--out", str(tmp_path)])
    assert r["code"] == 0
    assert "--k 96 fills each block's memory (vit_tiny: width 192) after task 2 of 3" in r["log"]
    learner, run = r["learners"][0], r["res"]["runs"][0]
    assert [M.shape[1] for M in learner.memory] == [192] * 2 and learner.oe.V.shape[-1] == 0
    head = {"heads.2.weight", "heads.2.bias"}
    expected = {"start_task": head, "train_task": head, "end_task": {"prototypes"}}
    for t, phase, changed in r["changed"][-5:]:  # task 3's; the memory's QR may flip signs
        assert t == 2 and changed - {"memory.0", "memory.1"} == expected.get(phase, set())
    assert all(not layer.A.detach().any() for layer in jm.lora_layers(learner.model))
    assert run["violation"]["k"][2] == [None] * 2 and max(run["interference"][2]["past"]) == 0
    assert all(math.isfinite(a) for row in run["acc_matrix"] for a in row if a is not None)


def test_the_lines_a_run_prints_name_each_task_and_epoch_and_its_numbers(watched):
    """Each epoch's line names its task and epoch of all; each task's line its row of the
    accuracy matrix as results.json has it; the analyses from task 2 on; the run's first line and
    its estimate."""
    for r in watched.values():
        cfg, log, run = r["cfg"], r["log"], r["res"]["runs"][0]
        seed = f"seed {run['seed']} "
        assert re.findall(rf"^{seed}task (\d+)/(\d+) epoch (\d+)/(\d+) ", log, re.M) == [
            tuple(map(str, (t + 1, cfg.tasks, e + 1, cfg.epochs))) for t in range(cfg.tasks)
            for e in range(cfg.epochs)]
        rows = [row[:t + 1] for t, row in enumerate(run["acc_matrix"])]
        assert re.findall(rf"^{seed}task (\d+) accuracy per task: ([\d. ]+?)  \|", log, re.M) == [
            (str(t + 1), " ".join(f"{a:.2f}" for a in row)) for t, row in enumerate(rows)]
        assert re.findall(rf"^{seed}task (\d+) analyses: ", log, re.M) == [
            str(t + 1) for t in range(1, cfg.tasks)]
        # the run's time, estimated once: at the end of its first epoch, which is short here
        assert len(re.findall(r"^note: at [\d.]+ img/s on cpu, the run's training", log, re.M)) == 1
        first = next(line for line in log.splitlines() if line.startswith("synthetic: "))
        method = jm.describe(r["res"]["config"])
        assert first.endswith(f" tasks; {method}; cpu fp32; out {r['out']}")
        assert f", {cfg.tasks} tasks; " in first


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "junk.pth").write_bytes(b"not a checkpoint")
    (d / "afile").write_text("x")
    return d


CKPT = _without(TINY, "--patch-size") + ["--patch-size", "16"]  # the checkpoints are ViT-*/16
BAD_INPUTS = {  # id: (argv, what the one line must say); {tmp}: the bad_files folder
    "lr": (TINY + ["--lr", "-1"], "--lr -1.0: must be positive"),
    "nan": (TINY + ["--margin", "nan"], "--margin nan: must be finite"),
    "epochs": (TINY + ["--epochs", "0"], "error: --epochs 0: must be 1 or more\n"),
    "limit": (TINY + ["--limit-per-class", "0"], "--limit-per-class 0: must be 1 or more"),
    "rank": (TINY + ["--rank", "500"], "--rank 500: must lie in 1..192"),
    "tasks": (TINY + ["--tasks", "5"], "--tasks 5 does not split 12 classes"),
    "img": (TINY + ["--img-size", "30"], "--img-size 30: must be a multiple of --patch-size"),
    "patch": (TINY + ["--patch-size", "0"], "--patch-size 0: must be 1 or more"),
    "gpm": (TINY + ["--gpm-threshold", "0.9", "0.5"], "0 < first <= last <= 1"),
    "inflora": (TINY + ["--lora-a", "inflora"], "add --no-gr"),
    "seeds": (TINY + ["--seeds", "1", "1"], "--seeds 1 1: must name each seed once"),
    **{f"device-{name}": (TINY + ["--device", name], f"--device {name}: is not a device")
       for name in ("gpu", "mps", "CPU")},
    "cuda": (TINY + ["--device", "cuda:7"], "--device cuda:7: is not a GPU that torch sees"),
    "range": (CKPT + ["--weights", "{tmp}/junk.pth", "--input-range", "checkpoint"],
              "--input-range checkpoint: needs a named --weights"),
    "row": (TINY + ["--row", "3"], "--row 3: goes with --reproduce NAME"),
    "no-row": (TINY + ["--reproduce", "k", "--row", "3"], "choose one of ['k25', 'k50'"),
    "dry": (TINY + ["--dry-run"], "--dry-run: goes with --reproduce NAME"),
    "resume": (["--resume", "{tmp}/nothing"], "nothing: no such folder: check the path, or start"),
    "junk": (CKPT + ["--weights", "{tmp}/junk.pth"], "junk.pth is not a checkpoint"),
    "name": (CKPT + ["--weights", "imagenet"], "--weights imagenet is neither a known name"),
    "both": (_without(CKPT, "--tasks") + ["--dataset", "cifar100", "--data-dir", "{tmp}",
                                          "--weights", "in21k"], "cifar-100-python"),
    "data-dir": (_without(CKPT, "--tasks") + ["--dataset", "cifar100", "--data-dir",
                                              "{tmp}/afile"], "--data-dir {tmp}/afile is a file"),
    "out": (TINY + ["--out", "{tmp}/afile"], "--out {tmp}/afile: a file is in the way"),
    "benchmark-out": (TINY + ["--benchmark", "--out", "{tmp}/afile"],  # before the timing
                      "--out {tmp}/afile: a file is in the way"),
    "out-under": (TINY + ["--out", "{tmp}/afile/run"], "--out {tmp}/afile/run: cannot write")}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gets_one_clear_line_and_leaves_the_folder_alone(case, bad_files, capsys):
    argv, said = BAD_INPUTS[case]
    argv = [a.replace("{tmp}", str(bad_files)) for a in argv]
    if "--out" not in argv and "--resume" not in argv:
        argv += ["--out", str(bad_files / "runs" / case)]
    before = sorted(p.name for p in bad_files.iterdir() if p.name != "runs")
    assert jm.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and said.replace(
        "{tmp}", str(bad_files)) in err
    assert "Traceback" not in err and sorted(p.name for p in bad_files.iterdir()
                                             if p.name != "runs") == before
    assert not list(bad_files.glob("runs/*/config.json"))  # no run left claiming a folder
    if case == "both":  # the data and the weights missing, said in one line
        assert "--weights none" in err and "hub" in err


def test_other_errors_keep_their_traceback(tmp_path, monkeypatch):
    """Only the project's own errors become one line: anything else is a bug to report."""
    def broken(*args):
        raise OSError("a bug, not bad input")
    monkeypatch.setattr(jm, "end_task", broken)
    with pytest.raises(OSError, match="a bug"):
        jm.main(SHORT + ["--out", str(tmp_path)])


def test_help_notes_and_the_default_workers(capsys, monkeypatch):
    """--help lists every flag, the switches as --NAME and --no-NAME; a flag with no effect, or a
    memory that will fill, gets a note; repeated --seeds add up; --workers needs no Linux call,
    nor a known number of cores."""
    with pytest.raises(SystemExit):
        jm.main(["--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(jm.Config):
        assert (f"--no-{f.name}" if f.type is bool and f.default else jm.flag(f.name)) in out
    assert re.search(r"--oe, --no-oe\s+Online Estimation", out)  # a switch turned on or off
    for said in ("half: [-1, 1], as Google's checkpoints were trained",
                 "imagenet: ImageNet's mean and std, as DINO's"):  # what each --input-range is
        assert said in " ".join(out.split())
    with pytest.raises(SystemExit):  # a flag's prefix is no flag: --seed is not --seeds
        jm.configure(["--seed", "3", "--device", "cpu"])
    err = capsys.readouterr().err  # argparse's errors in one line, without the usage
    assert "unrecognized arguments: --seed 3" in err and err.count("\n") == 1
    for argv, moot in ((["--no-oe", "--k", "8"], "--k"), (["--precision", "bf16"], "--precision"),
                       (["--method", "finetune", "--k", "8", "--margin", "0.1"], "--k --margin"),
                       (["--no-gr", "--delta", "1e-3"], "--delta"), (["--steps", "3"], "--steps"),
                       (["--benchmark", "--epochs", "3", "--seeds", "1"], "--epochs --seeds"),
                       (["--benchmark", "--method", "finetune", "--workers", "1"],
                        "--method --workers"),  # the benchmark's variants are its own
                       (["--reproduce", "k", "--k", "8", "--margin", "0.1"], "--k")):  # each row's
        jm.configure(argv + ["--device", "cpu"])
        assert f"note: {moot}: no effect with these settings, ignored" in capsys.readouterr().out
    for argv in (["--k", "8"], ["--reproduce", "ablation", "--no-dml"]):  # row 7 keeps DML
        jm.configure(argv + ["--device", "cpu"])
        assert capsys.readouterr().out == ""
    jm.configure(["--model", "vit_tiny", "--k", "96", "--device", "cpu"])  # 192 wide, 10 tasks
    assert "--k 96 fills each block's memory (vit_tiny: width 192) after task 2 of 10" in \
        capsys.readouterr().out
    assert jm.configure(["--seeds", "0", "--seeds", "1", "--device", "cpu"])[0].seeds == [0, 1]
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # as on macOS and Windows
    assert jm.configure(["--device", "cpu"])[0].workers == os.cpu_count()
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # the number of cores unknown
    assert jm.configure(["--device", "cpu"])[0].workers == 1


def test_every_float_flag_refuses_inf_and_nan():
    """argparse takes inf and nan for a float: each float flag refuses them, in one line."""
    floats = [f for f in dataclasses.fields(jm.Config) if float in (f.type, f.metadata.get("type"))]
    assert {"tau", "margin", "lora_scale", "delta", "oe_lr", "gpm_threshold"} <= {
        f.name for f in floats}
    for f, value in itertools.product(floats, ("inf", "nan")):
        argv = [jm.flag(f.name)] + [value] * f.metadata.get("nargs", 1)
        with pytest.raises(jm.ConfigError, match=rf"^{jm.flag(f.name)} {value}.*: must be finite"):
            jm.configure(TINY + argv)


def test_a_torchvision_built_for_another_torch_gets_one_line(tmp_path):
    """The import that fails on a torch/torchvision pair from two indexes: one line, both versions
    and the fix, and a non-zero exit."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path))  # the broken torchvision first
    done = subprocess.run([sys.executable, jm.__file__, "--help"], env=env, capture_output=True,
                          text=True)
    assert done.returncode != 0 and done.stdout == "" and done.stderr.count("\n") == 1
    for said in (f"torchvision {importlib.metadata.version('torchvision')} ",
                 f"torch {torch.__version__} ", "torchvision::nms does not exist",
                 "pip uninstall -y torch torchvision && pip install -r requirements.txt"):
        assert said in done.stderr


def test_a_rows_own_flag_is_never_suggested_as_the_fix(tmp_path, monkeypatch, capsys):
    """Offline, a row of --reproduce backbones is told where its checkpoint goes, not to pass
    --weights, which each row sets; a run of one's own is offered --weights too."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    argv = _without(CKPT, "--weights") + ["--out", str(tmp_path / "row")]
    assert jm.main(argv + ["--reproduce", "backbones", "--row", "in21k"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"put it at {tmp_path}/checkpoints/" in err
    assert "--weights" not in err
    assert jm.main(argv + ["--weights", "in21k"]) == 2
    assert "put it at" in (err := capsys.readouterr().err) and "--weights none" in err


@pytest.mark.parametrize("flags, mean_std", [
    ([], (0.0, 1.0)), (["--input-range", "half"], vit.MEAN_STD["half"]),
    (["--input-range", "checkpoint", "--weights", "dino"], vit.MEAN_STD["imagenet"])])
def test_input_range_reaches_the_data(monkeypatch, flags, mean_std):
    got = []

    def load_dataset(*args, **kwargs):
        got.append(args[3:5])
        raise data.DataError("stop")
    monkeypatch.setattr(data, "load_dataset", load_dataset)
    monkeypatch.setattr(jm, "build_model", lambda cfg: (None, None))
    with pytest.raises(data.DataError):
        jm.load_data_and_model(jm.configure(CKPT + flags)[0])
    assert got == [tuple(mean_std)]


def test_plots_stand_on_their_own(tiny_run, tmp_path, monkeypatch):
    """Each plot names what it shows: every block numbered, K's and V's marks told apart, an empty
    panel said why, the danger zone and every point inside the frame, each density line seen, no
    band for one seed, no legend on a panel; with one task, a sentence, not empty panels."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    runs = tiny_run["res"]["runs"]
    fig = Figure()
    jm.plot_violation(fig, runs)
    left, right = fig.axes
    assert [t.get_text() for t in left.get_xticklabels()] == [str(b) for b in range(1, 13)]
    assert left.get_title() != right.get_title() and "||dW M||" in left.get_ylabel()
    assert "M: the memory" in fig.get_supxlabel() and not left.texts
    marks = [line.get_marker() for line in right.lines if "reference" in line.get_label()]
    assert len(marks) == len(set(marks)) == 2  # K's and V's
    fig = Figure()  # Fine-Tuning's: no memory, every violation undefined
    jm.plot_violation(fig, [dict(runs[0], violation={n: [[None] * 12] * 3 for n in "kv"})])
    assert not fig.axes[0].patches
    assert any("nothing to measure" in t.get_text() for t in fig.axes[0].texts)
    for cosines in ([0.1, 0.2, 0.25], [-0.99, 0.3, 0.999], [1.0, 1.0, 1.0]):  # safe; ends; corner
        g = dict(runs[0]["geometry"][-1], cos_old=cosines, cos_own=cosines)
        fig = Figure()
        jm.plot_angular(fig, [dict(runs[0], geometry=[None, g, g])])  # two equal densities
        for lo, hi in (fig.axes[0].get_xlim(), fig.axes[0].get_ylim()):
            margin = 0.02 * (hi - lo)  # a point's marker stays whole inside the frame
            assert lo + margin < min(cosines) and max(cosines) < hi - margin and lo < 0.5 < hi
        assert any("danger zone" in t.get_text() for t in fig.texts)
        styles = [(line.get_marker(), line.get_linestyle()) for line in fig.axes[1].lines]
        assert len(styles) == len(set(styles)) == 2
    fig = Figure()
    jm.plot_trajectory(fig, runs)
    assert all("min-max" not in label for label in fig.axes[0].get_legend_handles_labels()[1])
    one_task = [dict(runs[0], interference=[None], geometry=[None])]
    for draw in (jm.plot_violation, jm.plot_angular):
        fig = Figure()
        draw(fig, one_task)
        assert not fig.axes and "nothing to show" in fig.texts[0].get_text()
    names = [tiny_run["out"] / f"{name}.png" for name in ("trajectory", "violation", "angular")]
    assert all(path.exists() for path in names)
    drawn = []  # plot's figures as it saves them: each legend beside its panel, covering nothing
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kwargs: drawn.append(fig))
    assert jm.plot(tiny_run["res"], str(tmp_path)) == [str(tmp_path / p.name) for p in names]
    for fig in drawn:
        fig.draw_without_rendering()
        for ax in fig.axes:
            assert not ax.get_legend().get_window_extent().overlaps(ax.get_window_extent())


# ---- The figures of a --reproduce set, drawn from results.json files written by hand (no training)
def _write_set(out, name, skip=()):  # each row's folder but skip's: 2 seeds, 3 tasks, 2 epochs
    rows, g = jm.REPRODUCE[name][1], torch.Generator().manual_seed(47)
    seeds, T, epochs = (0, 1), 3, 2  # and 2 blocks: 4 K/V layers

    def draw(*shape, scale=100.0):
        return (scale * torch.rand(shape, generator=g, dtype=torch.float64)).round(
            decimals=2).tolist()

    def matrix():  # its entries and their metrics, each row padded to T with None
        acc = [row[:t + 1] for t, row in enumerate(draw(T, T))]
        return {"acc_matrix": [row + [None] * (T - len(row)) for row in acc], **_acc_maa_bwt(acc)}
    for row in [row for row in rows if row not in skip]:
        argv = rows[row].split() + ["--dataset", "synthetic", "--tasks", str(T), "--epochs",
                                    str(epochs), "--seeds", *map(str, seeds)]
        runs = [{"seed": seed, **matrix(), "task_aware": matrix(), "sample_acc": draw(T),
                 "task_seconds": draw(T, scale=10), "throughput": draw(T, epochs),
                 "violation": {n: [[None, None]] + draw(T - 1, 2, scale=1) for n in "kv"},
                 "interference": [None] + [{"past": draw(4, scale=0.01), "current": draw(
                     4, scale=0.1)} for _ in range(T - 1)], "geometry": [None] * T}
                for seed in seeds]
        (out / row).mkdir(parents=True)
        config = dataclasses.asdict(jm.Config(**jm.parse(argv)[0]))
        (out / row / "results.json").write_text(json.dumps({"config": config, "runs": runs}))
    return rows


def _draw_set(out, name, rows, monkeypatch):  # write_set's figures by file name, not saved
    from matplotlib.figure import Figure
    drawn = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.update({
        os.path.basename(path): fig}))
    jm.write_set(jm.Config(reproduce=name, dataset="synthetic", tasks=3), str(out), rows)
    for fig in drawn.values():  # the legend beside the panels, each end's value inside its frame
        fig.draw_without_rendering()
        boxes = [ax.get_window_extent() for ax in fig.axes]
        assert not any(legend.get_window_extent().overlaps(box) for legend in fig.legends
                       for box in boxes)
        assert all(box.contains(*corner) for ax, box in zip(fig.axes, boxes) for text in ax.texts
                   for corner in text.get_window_extent().corners())
        assert "synthetic, T=3, 2 epoch(s) a task, 2 seed(s) a row" in fig.get_suptitle()
    return drawn, {row: _results(out / row) for row in rows if (out / row).exists()}


def _over_seeds(values):  # the mean and the sample std (n - 1) of each column of values
    return ([statistics.fmean(col) for col in zip(*values)],
            [statistics.stdev(col) for col in zip(*values)])


def _end_text(ax, line):  # the text written at a line's end, in its colour
    text, = [t for t in ax.texts if t.get_color() == line.get_color()]
    assert text.xy[0] == line.get_xdata()[-1]
    return text.get_text()


def test_each_sets_figure_draws_its_rows_results(tmp_path, monkeypatch):
    """Fig. 5 (the mean accuracy on the seen tasks, a line per row, a band of ± the sample std,
    each end's value) with Fig. 2's output change beside it, the efficiency figures (time per
    task, cumulative, throughput), Fig. 6 (each metric before and after GR), Fig. 4a (ACC, MAA,
    BWT over k, ± the sample std): the drawn values, read from the artists, are the rows'
    results.json's; legends cover nothing."""
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.container import ErrorbarContainer
    rows = _write_set(tmp_path / "methods", "methods")
    drawn, res = _draw_set(tmp_path / "methods", "methods", rows, monkeypatch)
    assert sorted(drawn) == ["efficiency.png", "trajectories.png"]
    fig = drawn["trajectories.png"]
    assert fig.get_suptitle().startswith("Fig. 5: ")
    for ax, which in zip(fig.axes, (lambda run: run, lambda run: run["task_aware"])):
        assert [line.get_label() for line in ax.lines] == [
            "finetune: Fine-Tuning", "lora-gpm: LoRA-GPM", "inflora: InfLoRA", "janus: Janus-LoRA"]
        for line, band, r in zip(ax.lines, ax.collections, res.values()):
            m, s = _over_seeds([[statistics.fmean(row[:t + 1]) for t, row in enumerate(
                which(run)["acc_matrix"])] for run in r["runs"]])
            assert list(line.get_xdata()) == [1, 2, 3] and line.get_ydata() == pytest.approx(m)
            edges = sorted(set(map(tuple, band.get_paths()[0].vertices.tolist())))  # x, y
            assert np.ravel(edges) == pytest.approx([v for x in (1, 2, 3) for sign in (-1, 1)
                                                     for v in (x, m[x - 1] + sign * s[x - 1])])
            assert _end_text(ax, line) == f"{m[-1]:.2f}"
    assert "(%)" in fig.axes[0].get_ylabel()
    change = fig.axes[2]  # Fig. 2 on real inputs: a row's past tasks' bar, then its current task's
    assert [bar.get_height() for bar in change.patches] == pytest.approx([
        statistics.fmean(v for run in r["runs"] for task in run["interference"][1:]
                         for v in task[inputs]) for r in res.values()
        for inputs in ("past", "current")])
    assert [bar.get_hatch() for bar in change.patches] == [None, "//"] * len(res)
    assert [bar.get_facecolor() for bar in change.patches[::2]] == [  # each row in its colour
        matplotlib.colors.to_rgba(line.get_color()) for line in fig.axes[0].lines]
    assert change.get_yscale() == "log"
    per_task, total, speed = drawn["efficiency.png"].axes
    for lines, r in zip(zip(per_task.lines, total.lines, speed.lines), res.values()):
        seconds, _ = _over_seeds([run["task_seconds"] for run in r["runs"]])
        speeds, _ = _over_seeds([sum(run["throughput"], []) for run in r["runs"]])
        assert [line.get_ydata() for line in lines] == [pytest.approx(v) for v in (
            seconds, list(itertools.accumulate(seconds)), speeds)]
        assert len({line.get_color() for line in lines}) == 1  # a row's colour in every panel
        assert _end_text(total, lines[1]) == f"{sum(seconds):.1f}"
    assert [ax.get_ylabel().rsplit("(")[-1] for ax in (per_task, total, speed)] == [
        "s)", "s)", "images / s)"]

    rows = _write_set(tmp_path / "gr", "gr-plugin")
    drawn, res = _draw_set(tmp_path / "gr", "gr-plugin", rows, monkeypatch)
    assert sorted(drawn) == ["efficiency.png", "gr_plugin.png"]
    assert drawn["gr_plugin.png"].get_suptitle().startswith("Fig. 6: ")
    for ax, metric in zip(drawn["gr_plugin.png"].axes, ("ACC", "MAA", "BWT")):
        assert [t.get_text() for t in ax.get_xticklabels()] == [
            "lora-gpm\nLoRA-GPM", "lora-gpm-gr\nLoRA-GPM + GR"]  # before GR, then after
        (before, s0), (after, s1) = [_over_seeds([[run[metric]] for run in r["runs"]])
                                     for r in res.values()]
        assert [bar.get_height() for bar in ax.patches] == pytest.approx(before + after)
        segments = [c.lines[2][0].get_segments() for c in ax.containers
                    if isinstance(c, ErrorbarContainer)]  # each bar's: [[x, low], [x, high]]
        assert np.ravel(segments) == pytest.approx([v for x, [m], [s] in (
            (0, before, s0), (1, after, s1)) for v in (x, m - s, x, m + s)])
        assert [t.get_text() for t in ax.texts] == [
            f"{before[0]:.2f}", f"{after[0]:.2f} ({after[0] - before[0]:+.2f})"]

    rows = _write_set(tmp_path / "k", "k")
    drawn, res = _draw_set(tmp_path / "k", "k", rows, monkeypatch)
    fig = drawn["sweep.png"]
    assert fig.get_suptitle().startswith("Fig. 4a: ") and "--k" in fig.axes[0].get_xlabel()
    for ax, metric in ((fig.axes[0], "ACC"), (fig.axes[0], "MAA"), (fig.axes[1], "BWT")):
        line, _, (bars,) = next(c for c in ax.containers if c.get_label() == metric)
        m, s = map(list, zip(*[_over_seeds([[run[metric]] for run in r["runs"]])
                               for r in res.values()]))
        assert list(line.get_xdata()) == [r["config"]["k"] for r in res.values()] == [
            25, 50, 75, 100]
        assert line.get_ydata() == pytest.approx(sum(m, []))
        assert np.ravel(bars.get_segments()) == pytest.approx([v for x, [mx], [sx] in zip(
            line.get_xdata(), m, s) for v in (x, mx - sx, x, mx + sx)])


def test_a_set_missing_rows_draws_the_others_and_names_them(tmp_path, monkeypatch, capsys):
    """A row not finished (--row, or held elsewhere) is left out of the figure and table.md, and
    named in both and in the line that names the files."""
    pytest.importorskip("matplotlib")
    rows = _write_set(tmp_path, "k", skip={"k75"})
    drawn, res = _draw_set(tmp_path, "k", rows, monkeypatch)
    fig = drawn["sweep.png"]
    assert list(fig.axes[0].lines[0].get_xdata()) == [25, 50, 100]
    assert fig.get_suptitle().endswith("\nnot finished, not drawn: k75")
    table = (tmp_path / "table.md").read_text()
    assert "Rows not finished, left out: k75." in table
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| k")] == [
        "| k25", "| k50", "| k100"]
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"wrote {tmp_path}/table.md {tmp_path}/sweep.png (rows not finished, left out: k75)")


def test_the_last_lines_name_the_files_and_the_time_and_results_the_code(tiny_run, tmp_path,
                                                                         monkeypatch):
    """The run's last lines: every file it wrote, and its time; results.json: the code's hash,
    and git's commit where there is one, none without git."""
    files = ["results.json"] + (["trajectory.png", "violation.png", "angular.png"]
                                if importlib.util.find_spec("matplotlib") else [])
    wrote, done = tiny_run["log"].splitlines()[-2:]
    assert wrote == "wrote " + " ".join(shlex.quote(str(tiny_run["out"] / f)) for f in files)
    assert re.fullmatch(r"done in \d+ s|done in \d+\.\d (min|h|days)", done)
    assert [jm.duration(s) for s in (45, 90, 150, 7200, 6.1 * 86400)] == [
        "45 s", "90 s", "2.5 min", "2.0 h", "6.1 days"]
    code = tiny_run["res"]["environment"]["code"]
    digest = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (jm, vit, data)))
    assert code["sha256"] == digest.hexdigest()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(jm.__file__).parent,
                          capture_output=True, text=True) if shutil.which("git") else None
    if head and head.returncode == 0:  # a clone: its commit, '-dirty' with changes
        assert re.fullmatch(head.stdout.strip() + "(-dirty)?", code["git"])
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on this machine
    assert jm.code_version() == dict(code, git=None)


@pytest.mark.parametrize("method", ["inflora", "finetune"])
def test_the_benchmark_times_what_its_variants_say(method, tmp_path, monkeypatch):
    """--benchmark times plain LoRA and Janus-LoRA (GR two ways), whatever --method says."""
    switches, real = [], jm.mid_run_learner

    def mid_run_learner(cfg, *args):
        switches.append({s: getattr(cfg, s) for s in ("oe", "gr", "dml", "rectify", "lora_a")})
        return real(cfg, *args)
    monkeypatch.setattr(jm, "mid_run_learner", mid_run_learner)
    argv = TINY + ["--method", method, "--benchmark", "--steps", "1", "--out", str(tmp_path)]
    assert jm.main(argv) == 0
    janus = dict(oe=True, gr=True, dml=True, lora_a="trained")
    assert switches == [dict(oe=False, gr=False, dml=False, rectify="grad", lora_a="trained"),
                        dict(janus, rectify="grad"), dict(janus, rectify="update")]
    report = json.loads((tmp_path / "benchmark.json").read_text())["variants"]
    assert report["plain"]["x_plain"] == 1.0 and all(v["images_per_s"] > 0 for v in report.values())


def test_reproduce_runs_resumes_refuses_other_flags_and_tabulates(tmp_path, monkeypatch, capsys,
                                                                  no_plots):
    """--dry-run pastes; a stopped row resumes, a finished one is skipped, one run with other
    flags refused; table.md has every finished row."""
    argv = SHORT + ["--reproduce", "gr-plugin", "--out", str(tmp_path / "my out")]
    assert jm.main(argv + ["--dry-run"]) == 0
    rows = [shlex.split(line.split(": ", 1)[1])[2:] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("lora-gpm:", "lora-gpm-gr:"))]
    assert [jm.configure(row)[0].method for row in rows] == ["lora-gpm", "lora-gpm-gr"]
    calls, real = [], jm.run_seed

    def stop_the_second_row(learner, record, splits, cfg, after_task):
        calls.append(cfg.method)
        if calls == ["lora-gpm", "lora-gpm-gr"]:
            raise KeyboardInterrupt
        return real(learner, record, splits, cfg, after_task)
    monkeypatch.setattr(jm, "run_seed", stop_the_second_row)
    assert jm.main(argv) == 130
    assert jm.main(argv + ["--row", "lora-gpm-gr"]) == 0  # that row alone, resumed
    folder = shlex.quote(str(tmp_path / "my out" / "lora-gpm-gr"))
    resumed = f"--resume {folder} --weights none --workers 0 --device"
    assert resumed in capsys.readouterr().out  # with the flags typed that a resume may change
    assert jm.main(argv) == 0 and calls == ["lora-gpm", "lora-gpm-gr", "lora-gpm-gr"]
    table = (tmp_path / "my out" / "table.md").read_text()
    assert "| lora-gpm | `--method lora-gpm` | 1 |" in table and "| lora-gpm-gr |" in table
    assert "finished, skipped" in capsys.readouterr().out
    other = _without(argv, "--epochs") + ["--epochs", "2", "--row", "lora-gpm"]
    assert jm.main(other) == 2 and calls == ["lora-gpm", "lora-gpm-gr", "lora-gpm-gr"]
    assert "row lora-gpm: " in capsys.readouterr().err
