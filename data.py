"""Datasets and class-incremental task splits for the Janus-LoRA reference implementation.

Protocol: the InfLoRA codebase (Liang & Li, CVPR 2024; github.com/liangyanshuo/InfLoRA, utils/data.py), on which
the paper ran: classes in natural order, T equal tasks of contiguous class ids, no exemplars. Sources, in data_dir:
- cifar100: https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz, through torchvision.
- imagenet-r: https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar (Hendrycks et al., ICCV 2021), 200 wnid
  folders, split 80/20 here (imagenet-r_split.json); a ready-made imagenet-r/train/ + test/ (LAE's) is used as it is.
- domainnet: http://ai.bu.edu/M3SDA/ (Peng et al., ICCV 2019): the six domain folders and the official
  <domain>_train.txt / <domain>_test.txt lists ("relative/path.jpg label"), 345 classes. The official lists are
  our choice: InfLoRA reads CODA-Prompt's split (dataloaders/splits/domainnet_*.yaml), which may differ.
- imagenet100: ILSVRC-2012 (https://image-net.org) as train/<wnid>/, val/<wnid>/. Papers use different class lists;
  ours: the wnids in data_dir/imagenet100_classes.txt (one a line) if present, else train/'s first 100 in sorted order.
- fashion-mnist: the four idx .gz files (Xiao et al., 2017) in data_dir (Debian's dataset-fashion-mnist puts them
  in /usr/share/datasets/fashion-mnist) or in torchvision's FashionMNIST/raw/.
- synthetic: generated from the seed (12 classes), for tests and quick runs.
"""
import gzip
import json
import os
import shutil
import struct
import tarfile
from collections import namedtuple
from pathlib import Path
from urllib.error import URLError

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import transforms as T
from torchvision.datasets import CIFAR100, FashionMNIST
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader
from torchvision.datasets.utils import check_integrity, download_url, extract_archive


class DataError(Exception):
    """A data set is missing, incomplete or corrupt, or the task split is impossible."""


# Tasks, epochs, batch size and resolution of the paper and InfLoRA's configs (ImageNet-R also runs with 5
# and 20 tasks). Ours: ImageNet-100's 10 epochs (the paper gives none; 2.6x CIFAR-100's images per class,
# so half its epochs), and the small Fashion-MNIST and synthetic settings, meant for runs of minutes
# (synthetic: 96 images a task need a small batch to take more than one step an epoch).
DATASETS = {name: dict(num_classes=c, tasks=t, epochs=e, batch_size=b, img_size=s) for name, c, t, e, b, s in [
    ('cifar100', 100, 10, 20, 128, 224), ('imagenet-r', 200, 10, 50, 128, 224), ('domainnet', 345, 5, 5, 128, 224),
    ('imagenet100', 100, 10, 10, 128, 224), ('fashion-mnist', 10, 5, 1, 128, 224), ('synthetic', 12, 3, 20, 16, 64)]}
IMAGENET_R_URL = 'https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar'
DOMAINS = ('clipart', 'infograph', 'painting', 'quickdraw', 'real', 'sketch')
FASHION_FILES = ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz',
                 't10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz')
SPLIT_SEED = 0  # the ImageNet-R split belongs to the benchmark: fixed, whatever the run's seed


# train: the training transform; train_eval: the same images with the test transform (for the end-of-task
# class prototypes); test; num_classes; class_names (wnids for the ImageNet sets)
Splits = namedtuple('Splits', 'train train_eval test num_classes class_names')


class _Images(Dataset):
    """source[i]: a path, a uint8 array (H, W) or (H, W, 3), or a uint8 tensor (3, H, W) (synthetic)."""

    def __init__(self, source, targets, transform):
        self.source, self.targets, self.transform = source, list(targets), transform

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


def _fetch(action, what, root, source, download, hint='', made=()):
    """Run a download; its failure, or downloads being off, becomes one DataError saying what to do.
    made: the folders below root that the download may create, deepest first."""
    new = [d for d in [root / m for m in made] + [root] if not d.exists()]
    try:
        if not download:
            raise FileNotFoundError('downloads are off')
        return action()
    except (URLError, OSError, RuntimeError, EOFError, tarfile.TarError) as err:
        for d in new:  # the failed download made these folders: leave none of them behind empty
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise DataError(f'{what} is missing from {root} and could not be downloaded ({" ".join(str(err).split())}): '
                        f'put {source} there and pass --data-dir {root}{hint}.') from None


def _cifar100(root, img_size, seed, download):
    try:
        parts = [CIFAR100(str(root), train=t) for t in (True, False)]
    except RuntimeError:  # absent: download it, or unpack an archive the user put there by hand
        archive = root / CIFAR100.filename
        if archive.is_file() and not check_integrity(str(archive), CIFAR100.tgz_md5):  # else torchvision
            raise DataError(f'{archive} is incomplete or corrupt (its MD5 is not {CIFAR100.tgz_md5}): delete '
                            f'it and fetch it again from {CIFAR100.url}.')  # would try to download it again
        parts = _fetch(lambda: [CIFAR100(str(root), train=t, download=True) for t in (True, False)],
                       f'CIFAR-100 ({CIFAR100.base_folder}/ or {CIFAR100.filename})', root, CIFAR100.url,
                       download or (root / CIFAR100.filename).is_file())
    return [(p.data, p.targets) for p in parts], parts[0].classes


def _ls(folder, dirs=False):
    """Sorted names of folder's subfolders (dirs) or image files, hidden ones left out; none if folder is absent."""
    keep = (lambda p: p.is_dir()) if dirs else (lambda p: p.name.lower().endswith(IMG_EXTENSIONS))
    return sorted(p.name for p in folder.iterdir() if keep(p) and p.name[0] != '.') if folder.is_dir() else []


def _folder(root, wnids):
    """(paths, labels) of root/<wnid>/<image>, labelled by position in wnids."""
    pairs = [(str(root / w / f), y) for y, w in enumerate(wnids) for f in _ls(root / w)]
    return [p for p, _ in pairs], [y for _, y in pairs]


def _imagenet_r(root, img_size, seed, download):
    folder, tar = root / 'imagenet-r', root / 'imagenet-r.tar'
    if not folder.is_dir() and not tar.is_file():
        _fetch(lambda: download_url(IMAGENET_R_URL, str(root)), 'ImageNet-R (imagenet-r/ or imagenet-r.tar)',
               root, IMAGENET_R_URL, download)
    if not folder.is_dir():  # unpacked beside it and renamed when whole: a bad tar leaves no half folder
        tmp = root / f'.imagenet-r.{os.getpid()}'  # one per process: two runs unpacking never share it
        try:
            extract_archive(str(tar), str(tmp))
            (tmp / 'imagenet-r').rename(folder)
        except (OSError, EOFError, tarfile.TarError) as err:
            raise DataError(f'{tar} could not be unpacked ({err}): if it is incomplete or corrupt, delete it and '
                            f'fetch it again from {IMAGENET_R_URL}.') from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if (folder / 'train').is_dir() and (folder / 'test').is_dir():
        wnids = _ls(folder / 'train', True)
        return [_folder(folder / part, wnids) for part in ('train', 'test')], wnids
    wnids, split_file = _ls(folder, True), root / 'imagenet-r_split.json'
    if split_file.is_file():
        try:  # anything but {"train": [str, ...], "test": [str, ...]} is corrupt or another program's file
            split = json.loads(split_file.read_text(encoding='utf-8'))
            valid = all(type(split[k]) is list and all(type(p) is str for p in split[k]) for k in ('train', 'test'))
        except (ValueError, TypeError, KeyError):  # ValueError: not JSON, or not UTF-8
            valid = False
        if not valid:
            raise DataError(f'{split_file} is not a train/test split of ImageNet-R: delete it to split again.')
    else:
        # Stratified per class, unlike LAE's one shuffle of the whole list: classes hold from about 50 to
        # 400+ images, and a whole-list shuffle leaves each class's test share to chance (a 50-image class
        # gets 10 +- 3). Sorted paths and a seeded torch.Generator, never hash(): one split on every machine.
        gen, split = torch.Generator().manual_seed(SPLIT_SEED), {'train': [], 'test': []}
        for w in wnids:
            files = [f'{w}/{f}' for f in _ls(folder / w)]
            order = torch.randperm(len(files), generator=gen).tolist()
            n_test = round(0.2 * len(files))  # the protocol's 80/20
            split['test'] += [files[i] for i in order[:n_test]]
            split['train'] += [files[i] for i in order[n_test:]]
        if os.access(root, os.W_OK):  # a read-only copy goes without: the file is only there for inspection
            split_file.write_text(json.dumps(split, indent=0))
    label = {w: y for y, w in enumerate(wnids)}
    if {p.split('/')[0] for p in split['train'] + split['test']} != set(wnids):
        raise DataError(f'{split_file} does not match the class folders in {folder}: delete it to split again.')
    missing = next((p for p in split['train'] + split['test'] if not os.path.isfile(folder / p)), None)
    if missing:  # found now, not as a FileNotFoundError hours into training
        raise DataError(f'{folder / missing}, listed in {split_file}, is missing: delete {split_file.name} to '
                        f'split again.')
    return [([str(folder / p) for p in split[part]], [label[p.split('/')[0]] for p in split[part]])
            for part in ('train', 'test')], wnids


def _domainnet(root, img_size, seed, download):
    parts, names = [], {}
    for part in ('train', 'test'):
        paths, labels = [], []
        for listing in (root / f'{domain}_{part}.txt' for domain in DOMAINS):
            if not listing.is_file():
                raise DataError(f'DomainNet list {listing.name} is missing from {root}: put the six domain folders '
                                f'and their lists from http://ai.bu.edu/M3SDA/ there and pass --data-dir {root}.')
            try:
                lines = listing.read_text(encoding='utf-8').splitlines()
            except UnicodeDecodeError:
                raise DataError(f'{listing} is not a text list (not UTF-8): fetch it again.') from None
            for n, line in enumerate(lines, 1):
                fields = line.rsplit(maxsplit=1)
                if len(fields) != 2 or not fields[1].isdigit() or fields[0].count('/') < 2:
                    raise DataError(f'line {n} of {listing} is not "domain/class/file.jpg label": fetch it again.')
                paths.append(str(root / fields[0]))
                labels.append(int(fields[1]))
                names.setdefault(labels[-1], fields[0].split('/')[1])
        parts.append((paths, labels))
    # every listed image, now rather than as a FileNotFoundError hours into training: a stat each, 3 us
    # with a warm cache (10k files measured), so about 2 s for DomainNet's 590k, once a run
    missing = next((p for paths, _ in parts for p in paths if not os.path.isfile(p)), None)
    if missing:
        raise DataError(f'DomainNet image {missing} is listed but missing: unpack all six domain folders from '
                        f'http://ai.bu.edu/M3SDA/ into {root}.')
    return parts, [names.get(y, '?') for y in range(max(names, default=-1) + 1)]


def _imagenet100(root, img_size, seed, download):
    class_file = root / 'imagenet100_classes.txt'
    wnids = class_file.read_text().split() if class_file.is_file() else _ls(root / 'train', True)[:100]
    for path in [root / part / w for part in ('train', 'val') for w in wnids or ['<wnid>']]:
        if not path.is_dir():
            raise DataError(f'ImageNet-100 folder {path} is missing: put ILSVRC-2012 from https://image-net.org in '
                            f'{root} as train/<wnid>/ and val/<wnid>/ and pass --data-dir {root}.')
    return [_folder(root / part, wnids) for part in ('train', 'val')], wnids


def _read_idx(path):
    """uint8 array of an idx file: big-endian magic 0x000008NN (08: uint8, NN dims: 2051 images (N, 28, 28),
    2049 labels (N,)), one uint32 per dim, then the data."""
    try:
        with gzip.open(path) as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise DataError(f'{path} is not a complete gzip file ({err}): fetch it again.') from None
    dims = raw[3] if len(raw) >= 4 and raw[:3] == b'\0\0\x08' else 0
    shape = struct.unpack(f'>{dims}I', raw[4:4 + 4 * dims]) if len(raw) >= 4 + 4 * dims else ()
    if not dims or len(shape) != dims or len(raw) != 4 + 4 * dims + int(np.prod(shape)):
        raise DataError(f'{path} is not a complete idx file (wrong header or length): fetch it again.')
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def _fashion_mnist(root, img_size, seed, download):
    raw = root / 'FashionMNIST' / 'raw'  # where torchvision downloads to
    folder = next((d for d in (root, raw) if all((d / f).is_file() for f in FASHION_FILES)), None)
    if folder is None:
        first = next(f for f in FASHION_FILES if not (root / f).is_file())
        _fetch(lambda: FashionMNIST(str(root), download=True), f'Fashion-MNIST file {first}', root,
               f'the four idx .gz files from {FashionMNIST.mirrors[0]}', download,
               " (or install Debian's dataset-fashion-mnist and pass --data-dir /usr/share/datasets/fashion-mnist)",
               made=('FashionMNIST/raw', 'FashionMNIST'))  # what torchvision's download creates
        folder = raw
    parts = []
    for images, labels in (FASHION_FILES[:2], FASHION_FILES[2:]):
        x, y = _read_idx(folder / images), _read_idx(folder / labels)
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or y.max(initial=0) >= 10:
            raise DataError(f'{images} and {labels} in {folder} do not match as Fashion-MNIST: fetch them again.')
        parts.append((x, y.tolist()))
    return parts, FashionMNIST.classes


def _synthetic(root, img_size, seed, download, per_class=(24, 8)):
    """Per class a smooth random colour pattern (4x4 noise upsampled); per image a shift of up to one
    16 px patch and Gaussian noise: classes easy to tell apart, no two images equal."""
    classes, gen = DATASETS['synthetic']['num_classes'], torch.Generator().manual_seed(seed)
    coarse = torch.rand(classes, 3, 4, 4, generator=gen)  # (C, 3, 4, 4)
    templates = F.interpolate(coarse, size=(img_size, img_size), mode='bilinear')  # (C, 3, H, W), smooth
    shift, parts = max(1, img_size // 16), []
    for n in per_class:
        labels = torch.arange(classes).repeat_interleave(n)  # (C*n,)
        moves = torch.randint(-shift, shift + 1, (len(labels), 2), generator=gen)  # (C*n, 2) pixels down, right
        imgs = torch.stack([templates[c].roll(tuple(m.tolist()), dims=(1, 2)) for c, m in zip(labels, moves)])
        imgs = imgs + 0.1 * torch.randn(imgs.shape, generator=gen)  # noise std 0.1 against patterns in [0, 1]
        parts.append(((imgs.clamp(0, 1) * 255).round().to(torch.uint8), labels.tolist()))  # uint8: 1/4 the memory
    return parts, [f'class{c:02d}' for c in range(classes)]


_LOADERS = {'cifar100': _cifar100, 'imagenet-r': _imagenet_r, 'domainnet': _domainnet,
            'imagenet100': _imagenet100, 'fashion-mnist': _fashion_mnist, 'synthetic': _synthetic}


def _transforms(name, img_size, mean, std):
    """(train, test) after InfLoRA: RandomResizedCrop + flip to train; to test, Resize (CIFAR) or
    Resize(256) + CenterCrop(224) scaled by img_size / 224 (the others)."""
    norm, square = T.Normalize(mean, std), [T.Resize((img_size, img_size))]
    if name == 'synthetic':
        return norm, norm
    crop = [T.Resize(round(256 * img_size / 224)), T.CenterCrop(img_size)]
    test = square if name in ('cifar100', 'fashion-mnist') else crop
    # Fashion-MNIST (ours): no random crop, which can cut away much of a small centred item
    train = square if name == 'fashion-mnist' else [T.RandomResizedCrop(img_size)]
    tail = [T.ToTensor(), norm]
    return T.Compose(train + [T.RandomHorizontalFlip()] + tail), T.Compose(test + tail)


def load_dataset(name, data_dir, img_size, mean, std, seed=0, limit_per_class=None, download=True):
    """Splits(train, train_eval, test, num_classes, class_names) of a data set named in DATASETS."""
    if name not in DATASETS:
        raise DataError(f'unknown dataset {name!r}: choose one of {", ".join(DATASETS)}.')
    if data_dir is None and name != 'synthetic':
        raise DataError(f'{name} needs --data-dir, the folder that holds (or is to hold) its files.')
    root = Path(data_dir).expanduser().resolve() if data_dir is not None else None
    ((train_src, train_y), (test_src, test_y)), names = _LOADERS[name](root, img_size, seed, download)
    found, expected = len(set(train_y) | set(test_y)), DATASETS[name]['num_classes']
    if found != expected or len(names) != expected:
        raise DataError(f'{name} in {root} has {found} classes, not {expected}: the copy is incomplete or another.')
    if limit_per_class is not None:
        # the first n of each class after a shuffle seeded by `seed`, kept in the data set's
        # order; the test set stays whole, so accuracies stay comparable with full runs
        kept, count = [], [0] * len(names)
        for i in torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed)).tolist():
            if count[train_y[i]] < limit_per_class:
                count[train_y[i]] += 1
                kept.append(i)
        kept.sort()
        train_src = [train_src[i] for i in kept] if isinstance(train_src, list) else train_src[kept]
        train_y = [train_y[i] for i in kept]
    train_tf, test_tf = _transforms(name, img_size, mean, std)
    return Splits(_Images(train_src, train_y, train_tf), _Images(train_src, train_y, test_tf),
                  _Images(test_src, test_y, test_tf), len(names), list(names))


def task_classes(num_classes, tasks):
    """T lists of contiguous class ids in natural order (InfLoRA's protocol)."""
    if tasks < 1 or num_classes % tasks:
        raise DataError(f'{tasks} tasks cannot split {num_classes} classes evenly: pick a divisor of {num_classes}.')
    per = num_classes // tasks
    return [list(range(t * per, (t + 1) * per)) for t in range(tasks)]


def subset(ds, classes):
    """ds restricted to the given classes, keeping `.targets` (global class ids)."""
    keep = set(classes)
    idx = [i for i, y in enumerate(ds.targets) if y in keep]
    part = Subset(ds, idx)
    part.targets = [ds.targets[i] for i in idx]
    return part


class _SeededSampler(Sampler):
    """Each epoch, from one generator in the main process: the order (a permutation when shuffling) and a seed
    per sample, which `_Seeded` uses for that sample's augmentation. Batches and augmentations then depend
    on the seed alone, not on the number of workers, so a run resumed with other --workers stays the same."""

    def __init__(self, n, shuffle, seed):
        self.n, self.shuffle, self.gen = n, shuffle, torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.gen) if self.shuffle else torch.arange(self.n)
        seeds = torch.randint(0, 2**62, (self.n,), generator=self.gen)
        return iter(zip(order.tolist(), seeds.tolist()))


class _Seeded(Dataset):
    """ds[i] under torch's generator seeded with s, for (i, s) from `_SeededSampler`; fork_rng restores the
    generator afterwards, so loading in the main process (workers = 0) leaves the run's random numbers alone."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, item):
        i, s = item
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s)
            return self.ds[i]


def make_loader(ds, batch_size, train, workers, seed):
    """DataLoader over ds (shuffled when train) whose batches and augmentations are fixed by the seed."""
    return DataLoader(_Seeded(ds), batch_size=batch_size, sampler=_SeededSampler(len(ds), train, seed),
                      num_workers=workers, pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
                      generator=torch.Generator().manual_seed(seed))  # its base seed: not from the run's generator
