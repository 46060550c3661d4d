"""Data sets, class-incremental task splits and seeded loaders for the Janus-LoRA reference code.

Protocol: the InfLoRA codebase (Liang & Li, CVPR 2024; github.com/liangyanshuo/InfLoRA), on which
the paper ran: classes in natural order, T equal tasks of contiguous class ids, no exemplars, its
transforms. Sources, in data_dir (the README's "Offline" table says where each file goes):
- cifar100: https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz, read as its pickled folder.
- imagenet-r: https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar (Hendrycks et al., ICCV
  2021), split 80/20 per class here; a ready-made imagenet-r/train/ + test/ (LAE's) is used as is.
- domainnet: http://ai.bu.edu/M3SDA/ (Peng et al., ICCV 2019), the official per-domain lists.
- imagenet100: ILSVRC-2012 (https://image-net.org) as train/<wnid>/, val/<wnid>/.
- fashion-mnist: the four idx files (Xiao et al., 2017); synthetic: generated from the seed.
"""
import gzip
import json
import os
import pickle
import shlex
import shutil
import struct
import tarfile
from collections import namedtuple
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms as T
from torchvision.datasets import FashionMNIST
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader
from torchvision.datasets.utils import download_url, extract_archive


class DataError(Exception):
    """A data set is missing, incomplete or corrupt, or the task split is impossible."""


# Tasks, epochs, batch size and resolution of the paper and InfLoRA's configs (ImageNet-R also runs
# with 5 and 20 tasks). Ours: ImageNet-100's 10 epochs (the paper gives none), and the small
# Fashion-MNIST and synthetic settings for runs of minutes.
DATASETS = {name: dict(num_classes=c, tasks=t, epochs=e, batch_size=b, img_size=s)
            for name, c, t, e, b, s in [
                ('cifar100', 100, 10, 20, 128, 224), ('imagenet-r', 200, 10, 50, 128, 224),
                ('domainnet', 345, 5, 5, 128, 224), ('imagenet100', 100, 10, 10, 128, 224),
                ('fashion-mnist', 10, 5, 1, 128, 224), ('synthetic', 12, 3, 20, 16, 64)]}
CIFAR100_URL = 'https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz'
IMAGENET_R_URL = 'https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar'
DOMAINS = ('clipart', 'infograph', 'painting', 'quickdraw', 'real', 'sketch')
FASHION_FILES = ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz',
                 't10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz')
SPLIT_SEED = 0  # the ImageNet-R split belongs to the benchmark: fixed, whatever the run's seed
# train: the training transform; train_eval: the same images, test transform (class prototypes)
Splits = namedtuple('Splits', 'train train_eval test num_classes')


class _Images(Dataset):
    """source[i]: a path, a uint8 array (H, W) or (H, W, 3), or a uint8 tensor (3, H, W);
    batched: the same transform as a `Batched` for the device pipeline, None for file-based sets."""

    def __init__(self, source, targets, transform, batched=None):
        self.source, self.targets = source, list(targets)
        self.transform, self.batched = transform, batched

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        item = self.source[i]
        if isinstance(item, str):
            img = default_loader(item)  # PIL, RGB
        elif isinstance(item, torch.Tensor):
            img = item.float() / 255
        else:
            img = Image.fromarray(item).convert('RGB')  # Fashion-MNIST's grey -> 3 channels
        return self.transform(img), self.targets[i]


@contextmanager
def _reading(what, fix):
    """Any failure to read `what` (missing, incomplete, corrupt) as one DataError: why, and fix."""
    try:
        yield
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError, RuntimeError,
            struct.error, pickle.UnpicklingError, tarfile.TarError) as err:
        why = ' '.join(f'{type(err).__name__}: {err}'.split())  # on one line
        raise DataError(f'{what} cannot be read ({why}): {fix}.') from None


def _unpack(root, url, name, download):
    """root/name from url's archive in root, downloaded first where absent if download; unpacked
    beside it and renamed when whole, so that a bad archive leaves no half folder behind."""
    archive = root / url.rsplit('/', 1)[1]
    if download and not archive.is_file():
        download_url(url, str(root))
    if archive.is_file():  # else neither folder nor archive: reading the folder says so
        tmp = root / f'.{name}.{os.getpid()}'  # one per process: two runs never share it
        try:
            with _reading(archive, f'delete it and fetch it again from {url}'):
                extract_archive(str(archive), str(tmp))
            (tmp / name).rename(root / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _cifar100(root, download):
    """The pickled cifar-100-python folder in root, or root itself, read as torchvision reads it
    but without its MD5 check, so that a copy in the same format (a generated one) loads too."""
    folder = root if (root / 'meta').is_file() else root / 'cifar-100-python'
    if not folder.is_dir():
        _unpack(root, CIFAR100_URL, folder.name, download)
    parts = []
    for part in ('train', 'test'):
        raw = (folder / part).read_bytes()
        with _reading(folder / part, 'delete it and fetch it again'):
            entry = pickle.loads(raw, encoding='latin1')
            x = np.asarray(entry['data'], np.uint8).reshape(-1, 3, 32, 32)  # (N, 3, H, W) rows
            x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))  # (N, H, W, 3), as torchvision's
            parts.append((x, list(entry['fine_labels'])))
    return parts


def _ls(folder, dirs=False):
    """Sorted names of folder's subfolders (dirs) or image files, hidden ones left out."""
    return sorted(p.name for p in folder.iterdir() if p.name[0] != '.' and
                  (p.is_dir() if dirs else p.name.lower().endswith(IMG_EXTENSIONS)))


def _folder(root, wnids):
    """(paths, labels) of root/<wnid>/<image>, labelled by position in wnids."""
    pairs = [(str(root / w / f), y) for y, w in enumerate(wnids) for f in _ls(root / w)]
    return [p for p, _ in pairs], [y for _, y in pairs]


def _imagenet_r(root, download):
    """imagenet-r/train/ + test/ as they are, else imagenet-r/<wnid>/, split 80/20 per class."""
    folder = root / 'imagenet-r'
    if not folder.is_dir():
        _unpack(root, IMAGENET_R_URL, folder.name, download)
    if (folder / 'train').is_dir() and (folder / 'test').is_dir():
        wnids = _ls(folder / 'train', dirs=True)
        return [_folder(folder / part, wnids) for part in ('train', 'test')]
    wnids = _ls(folder, dirs=True)
    split, label = _split_imagenet_r(folder, wnids), {w: y for y, w in enumerate(wnids)}
    return [([str(folder / p) for p in split[part]], [label[p.split('/')[0]] for p in split[part]])
            for part in ('train', 'test')]


def _split_imagenet_r(folder, wnids):
    """{'train': [...], 'test': [...]} of '<wnid>/<file>': the one saved beside folder, or drawn
    80/20 per class and saved."""
    split_file = folder.parent / 'imagenet-r_split.json'
    if split_file.is_file():
        with _reading(split_file, 'delete it to split again'):
            split = json.loads(split_file.read_text(encoding='utf-8'))
            paths = split['train'] + split['test']  # a TypeError unless two lists
            missing = next((p for p in paths if not (folder / p).is_file()), None)
            if missing is not None:  # now, not as a FileNotFoundError hours into training
                raise ValueError(f'it lists {folder / missing}, which is missing')
            if {p.split('/')[0] for p in paths} != set(wnids):
                raise ValueError(f'its classes are not the class folders in {folder}')
        return split
    # Stratified per class (classes hold ~50 to 400+ images), from sorted paths and a seeded
    # generator: one split on every machine.
    gen, split = torch.Generator().manual_seed(SPLIT_SEED), {'train': [], 'test': []}
    for w in wnids:
        files = [f'{w}/{f}' for f in _ls(folder / w)]
        order = torch.randperm(len(files), generator=gen).tolist()
        n_test = round(0.2 * len(files))  # the protocol's 80/20
        split['test'] += [files[i] for i in order[:n_test]]
        split['train'] += [files[i] for i in order[n_test:]]
    if os.access(split_file.parent, os.W_OK):  # a read-only copy goes without: inspection only
        split_file.write_text(json.dumps(split, indent=0))
    return split


def _domainnet(root, download):
    """The official lists <domain>_<train|test>.txt of lines '<domain>/<class>/<file> <label>'."""
    parts = []
    for part in ('train', 'test'):
        paths, labels = [], []
        for listing in (root / f'{domain}_{part}.txt' for domain in DOMAINS):
            raw = listing.read_bytes()
            with _reading(listing, 'fetch it again'):
                for line in raw.decode('utf-8').splitlines():
                    path, label = line.rsplit(maxsplit=1)  # a ValueError unless 'path label'
                    paths.append(str(root / path))
                    labels.append(int(label))
        parts.append((paths, labels))
    # every listed image, now rather than hours into training: ~2 s for DomainNet's 590k, once
    missing = next((p for paths, _ in parts for p in paths if not os.path.isfile(p)), None)
    if missing:
        raise FileNotFoundError(f'{missing} is listed but missing')
    return parts


def _imagenet100(root, download):
    """Our class list: the wnids in imagenet100_classes.txt if there, else train/'s first 100."""
    class_file = root / 'imagenet100_classes.txt'
    listed = class_file.is_file()
    wnids = class_file.read_text().split() if listed else _ls(root / 'train', dirs=True)[:100]
    return [_folder(root / part, wnids) for part in ('train', 'val')]


def _fashion_mnist(root, download):
    """The four idx files, gzipped or not, in root or in root/FashionMNIST/raw/ (torchvision's).
    idx: magic 0x000008NN (uint8 data, NN dims), a big-endian uint32 per dim, the data."""
    folders = [root, root / 'FashionMNIST' / 'raw']
    idx = lambda folder, f: folder / f[:-3] if (folder / f[:-3]).is_file() else folder / f
    if download and not any(idx(d, FASHION_FILES[0]).is_file() for d in folders):
        FashionMNIST(str(root), download=True)
    folder = next((d for d in folders if idx(d, FASHION_FILES[0]).is_file()), root)
    arrays = []
    for path in (idx(folder, f) for f in FASHION_FILES):
        raw = path.read_bytes()
        with _reading(path, 'delete it and fetch it again'):
            raw = gzip.decompress(raw) if path.suffix == '.gz' else raw
            if raw[:3] != b'\0\0\x08':
                raise ValueError('not an idx file of uint8')
            shape = struct.unpack(f'>{raw[3]}I', raw[4:4 + 4 * raw[3]])
            arrays.append(np.frombuffer(raw, np.uint8, offset=4 + 4 * raw[3]).reshape(shape))
    return [(arrays[0], arrays[1].tolist()), (arrays[2], arrays[3].tolist())]


def _synthetic(img_size, seed, per_class=(24, 8)):
    """Per class a smooth random colour pattern; per image a shift of up to one 16 px patch and
    Gaussian noise: classes easy to tell apart, no two images equal."""
    classes = DATASETS['synthetic']['num_classes']
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand(classes, 3, 4, 4, generator=gen)  # (C, 3, 4, 4), upsampled: smooth
    templates = F.interpolate(coarse, size=(img_size, img_size), mode='bilinear')  # (C, 3, H, W)
    shift, parts = max(1, img_size // 16), []
    for n in per_class:
        labels = torch.arange(classes).repeat_interleave(n)  # (C*n,)
        moves = torch.randint(-shift, shift + 1, (len(labels), 2), generator=gen)  # (C*n, 2)
        imgs = torch.stack([templates[c].roll(tuple(m.tolist()), dims=(1, 2))
                            for c, m in zip(labels, moves)])
        imgs = imgs + 0.1 * torch.randn(imgs.shape, generator=gen)  # noise std 0.1 on [0, 1]
        parts.append(((imgs.clamp(0, 1) * 255).round().to(torch.uint8), labels.tolist()))
    return parts


# a file-based set's loader, and what to put in --data-dir where it is missing
_LOADERS = {
    'cifar100': (_cifar100, f'cifar-100-python/ or its archive from {CIFAR100_URL}'),
    'imagenet-r': (_imagenet_r, f'imagenet-r/ or imagenet-r.tar from {IMAGENET_R_URL}'),
    'domainnet': (_domainnet, 'the six domain folders and lists from http://ai.bu.edu/M3SDA/'),
    'imagenet100': (_imagenet100, 'ILSVRC-2012 (https://image-net.org) as train/<wnid>/, val/'),
    'fashion-mnist': (_fashion_mnist, f'the four idx .gz files from {FashionMNIST.mirrors[0]} (or '
                      "install Debian's dataset-fashion-mnist: /usr/share/datasets/fashion-mnist)")}


def _transforms(name, img_size, mean, std):
    """((train, test) transforms, (train, test) `Batched` specs of an in-memory set, else None)
    after InfLoRA: RandomResizedCrop + flip to train; to test, Resize (CIFAR) or Resize(256) +
    CenterCrop(224) scaled by img_size / 224 (the others). Ours: synthetic as it is; Fashion-MNIST
    with no random crop, which can cut away much of a small centred item."""
    norm, square = T.Normalize(mean, std), [T.Resize((img_size, img_size))]
    plain = Batched(img_size, False, False, mean, std)  # no crop, no flip
    if name == 'synthetic':
        return (norm, norm), (plain, plain)
    crop = [T.Resize(round(256 * img_size / 224)), T.CenterCrop(img_size)]
    test = square if name in ('cifar100', 'fashion-mnist') else crop
    train = square if name == 'fashion-mnist' else [T.RandomResizedCrop(img_size)]
    tail = [T.ToTensor(), norm]
    tfs = T.Compose(train + [T.RandomHorizontalFlip()] + tail), T.Compose(test + tail)
    specs = Batched(img_size, name == 'cifar100', True, mean, std), plain  # cropped: CIFAR only
    return tfs, specs if name in ('cifar100', 'fashion-mnist') else (None, None)


def _thin(source, targets, limit, seed):
    """The first `limit` images of each class after a seeded shuffle, in the data set's order."""
    kept, count = [], {}
    for i in torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed)).tolist():
        if count.get(targets[i], 0) < limit:
            count[targets[i]] = count.get(targets[i], 0) + 1
            kept.append(i)
    kept.sort()
    source = [source[i] for i in kept] if isinstance(source, list) else source[kept]
    return source, [targets[i] for i in kept]


def load_dataset(name, data_dir, img_size, mean, std, seed=0, limit_per_class=None, download=True):
    """Splits(train, train_eval, test, num_classes) of a data set in DATASETS; limit_per_class
    thins the training set only, so accuracies stay comparable."""
    if name not in DATASETS:
        raise DataError(f'unknown dataset {name!r}: choose one of {", ".join(DATASETS)}.')
    classes = DATASETS[name]['num_classes']
    if name == 'synthetic':
        (train, train_y), (test, test_y) = _synthetic(img_size, seed)
    elif data_dir is None:
        raise DataError(f'{name} needs --data-dir, the folder that holds (or will hold) its files.')
    else:
        root = Path(data_dir).expanduser().resolve()
        loader, source = _LOADERS[name]
        with _reading(f'{name} in {root}', f'put {source} there and pass --data-dir '
                      f'{shlex.quote(str(root))}'):
            (train, train_y), (test, test_y) = loader(root, download)
            if len(train) != len(train_y) or len(test) != len(test_y):
                raise ValueError('its numbers of images and labels differ')
            if not set(train_y) == set(test_y) == set(range(classes)):
                raise ValueError(f'{len(set(train_y))} training and {len(set(test_y))} test '
                                 f'classes, not {classes}: incomplete, or another data set')
    if limit_per_class is not None:
        train, train_y = _thin(train, train_y, limit_per_class, seed)
    (train_tf, test_tf), (train_b, test_b) = _transforms(name, img_size, mean, std)
    return Splits(_Images(train, train_y, train_tf, train_b),
                  _Images(train, train_y, test_tf, test_b), _Images(test, test_y, test_tf, test_b),
                  classes)


def task_classes(num_classes, tasks):
    """T lists of contiguous class ids in natural order (InfLoRA's protocol)."""
    per = num_classes // max(tasks, 1)
    if per < 2 or per * tasks != num_classes:  # a head of one class: loss 0, accuracy 100%
        raise DataError(f'--tasks {tasks} does not split the {num_classes} classes into equal '
                        f'tasks of two or more: pick a divisor of {num_classes} up to '
                        f'{num_classes // 2}.')
    return [list(range(t * per, (t + 1) * per)) for t in range(tasks)]


def subset(ds, classes):
    """ds restricted to the given classes, keeping `.targets` (global class ids)."""
    keep = set(classes)
    idx = [i for i, y in enumerate(ds.targets) if y in keep]
    part = Subset(ds, idx)
    part.targets = [ds.targets[i] for i in idx]
    return part


class _Seeded(Dataset):
    """ds, and its own sampler: each epoch one generator in the main process draws the order and a
    seed per sample, and ds[i] is made under its seed, so batches and augmentations depend on the
    seed alone, not on --workers. fork_rng restores torch's generator: the run's draws stay."""

    def __init__(self, ds, shuffle, seed):
        self.ds, self.shuffle, self.gen = ds, shuffle, torch.Generator().manual_seed(seed)

    def __len__(self):
        return len(self.ds)

    def __iter__(self):
        n = len(self.ds)
        order = torch.randperm(n, generator=self.gen) if self.shuffle else torch.arange(n)
        seeds = torch.randint(0, 2**62, (n,), generator=self.gen)
        return iter(zip(order.tolist(), seeds.tolist()))

    def __getitem__(self, item):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(item[1])
            return self.ds[item[0]]


def make_loader(ds, batch_size, train, workers, seed, device=None):
    """Batches of ds (shuffled when train) whose order and augmentations come from seed alone: an
    in-memory set's made on device (default the CPU) by DeviceLoader, a file-based set's by a
    DataLoader with `workers` processes."""
    # the CPU too: batched there, CIFAR-100 at 224 px, batch 128, gave ~3,600 images/s on 2 threads
    # (~1,950 on 1) against ~1,000 from PIL in 2 workers
    if getattr(ds.dataset if isinstance(ds, Subset) else ds, 'batched', None) is not None:
        return DeviceLoader(ds, batch_size, train, seed, torch.device(device or 'cpu'))
    seeded = _Seeded(ds, train, seed)
    return DataLoader(seeded, batch_size=batch_size, sampler=seeded, num_workers=workers,
                      pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
                      generator=torch.Generator().manual_seed(seed))  # its base seed: not the run's


# ---- The device-resident pipeline (in-memory sets): the uint8 images live on the device, where a
# batch is indexed, normalised, cropped, flipped and resized; the draws are made on the CPU.
# A spec: a random crop as torchvision's RandomResizedCrop (crop), a horizontal flip with p = 1/2
# (flip), the bilinear resize to size x size, the normalisation with (mean, std).
Batched = namedtuple('Batched', 'size crop flip mean std')


def crop_boxes(gen, n, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), attempts=10):
    """(n, 4) int64 boxes (top, left, h, w) from gen, each drawn as torchvision's
    RandomResizedCrop.get_params draws one: the first of 10 attempts that fits, else the centre."""
    area = torch.empty(n, attempts, dtype=torch.float64).uniform_(*scale, generator=gen)
    area *= height * width  # (n, attempts) in pixels
    log_ratio = torch.tensor(ratio, dtype=torch.float64).log().tolist()
    aspect = torch.empty_like(area).uniform_(*log_ratio, generator=gen).exp()  # (n, attempts)
    w, h = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()  # half to even, as round
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)  # (n, attempts)
    first = fits.int().argmax(1, keepdim=True)  # (n, 1): the first attempt that fits, or 0
    found = fits.any(1)  # (n,); where none fits: the centre crop, its ratio clamped to the range
    r = min(max(width / height, ratio[0]), ratio[1])
    w = torch.where(found, w.gather(1, first)[:, 0].long(), min(width, round(height * r)))
    h = torch.where(found, h.gather(1, first)[:, 0].long(), min(height, round(width / r)))
    # offsets uniform in 0..H-h and 0..W-w: a 62-bit draw modulo the count (bias below 2^-40)
    room = torch.stack([height - h, width - w], 1) + 1  # (n, 2)
    offsets = torch.randint(2**62, (n, 2), generator=gen) % room
    offsets = torch.where(found[:, None], offsets, (room - 1) // 2)
    return torch.cat([offsets, h[:, None], w[:, None]], 1)


def _weights(start, length, size, out):
    """(B, out, size): torch's antialiased bilinear resize of each window [start, start + length)
    of `size` pixels to `out` pixels, as rows of weights (a triangle, widened to downsample)."""
    scale = (length / out)[:, None, None]  # (B, 1, 1) input pixels per output pixel
    centre = start[:, None, None] + scale * (torch.arange(out, device=start.device) + 0.5)[:, None]
    x = torch.arange(size, device=start.device) + 0.5  # (size,) input pixel centres
    w = (1 - (x - centre).abs() / scale.clamp(min=1)).clamp(min=0)  # (B, out, size)
    w = w * ((x > start[:, None, None]) & (x < (start + length)[:, None, None]))  # in the window
    return w / w.sum(2, keepdim=True)


def resized_crops(x, boxes, size, flips):
    """(B, C, size, size): each x[b] (C, H, W) float cropped to boxes[b] (top, left, h, w),
    resized as torchvision's resized_crop (bilinear, antialias), and mirrored where flips[b]."""
    top, left, h, w = boxes.T.float()  # (B,) each
    rows = _weights(top, h, x.shape[2], size)  # (B, size, H)
    cols = _weights(left, w, x.shape[3], size)  # (B, size, W)
    cols = torch.where(flips[:, None, None], cols.flip(1), cols)  # a flip reverses output columns
    return rows[:, None] @ x @ cols[:, None].transpose(2, 3)


class DeviceLoader:
    """len() batches of (images (B, 3, S, S) float32, labels (B,) int64) on device; one CPU
    generator draws each epoch's order (when train), crops and flips, epoch after epoch."""

    def __init__(self, ds, batch_size, train, seed, device):
        base, idx = (ds.dataset, ds.indices) if isinstance(ds, Subset) else (ds, slice(None))
        src = base.source[idx]  # indexed once, moved to the device once
        if not torch.is_tensor(src):  # uint8 (N, H, W) grey or (N, H, W, 3) -> (N, C, H, W)
            src = torch.tensor(src).reshape(*src.shape[:3], -1).permute(0, 3, 1, 2)  # a copy
        self.images = src.contiguous().to(device)  # (N, C, H, W) uint8, C = 1 or 3
        self.labels = torch.tensor(ds.targets, device=device)  # (N,)
        self.spec = base.batched
        self.batch_size, self.train, self.device = batch_size, train, device
        self.gen = torch.Generator().manual_seed(seed)
        self.mean, self.std = (torch.tensor(v, device=device).view(-1, 1, 1)
                               for v in (self.spec.mean, self.spec.std))

    def __len__(self):
        return -(-len(self.labels) // self.batch_size)

    def __iter__(self):
        """One epoch, all its draws made now, however many of its batches are taken."""
        n, (height, width) = len(self.labels), self.images.shape[2:]
        order = torch.randperm(n, generator=self.gen) if self.train else torch.arange(n)
        boxes = (crop_boxes(self.gen, n, height, width) if self.spec.crop
                 else torch.tensor([0, 0, height, width]).expand(n, 4))  # (n, 4)
        flips = (torch.rand(n, generator=self.gen) < 0.5 if self.spec.flip
                 else torch.zeros(n, dtype=torch.bool))  # (n,)
        parts = (t.to(self.device).split(self.batch_size) for t in (order, boxes, flips))
        return (self._batch(*part) for part in zip(*parts))

    def _batch(self, idx, boxes, flips):
        # normalised first: the resize is linear with rows that sum to 1, so this equals
        # torchvision's order, on the small images; grey is copied to 3 channels, as PIL's RGB
        x = (self.images[idx].float() / 255 - self.mean) / self.std  # (B, 1 or 3, H, W)
        x = x.expand(-1, 3, -1, -1)  # (B, 3, H, W)
        return resized_crops(x, boxes, self.spec.size, flips), self.labels[idx]
