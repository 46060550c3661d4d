"""Data sets and class-incremental task splits for the Janus-LoRA reference implementation.

Protocol: the InfLoRA codebase (Liang & Li, CVPR 2024; github.com/liangyanshuo/InfLoRA), on which
the paper ran: classes in natural order, T equal tasks of contiguous class ids, no exemplars.
Sources, in data_dir (the README's "Offline" table says where each file goes):
- cifar100: https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz (torchvision downloads it;
  its pickled folder is read here).
- imagenet-r: https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar (Hendrycks et al., ICCV
  2021), split 80/20 here; a ready-made imagenet-r/train/ + test/ (LAE's) is used as it is.
- domainnet: http://ai.bu.edu/M3SDA/ (Peng et al., ICCV 2019), the official per-domain lists.
- imagenet100: ILSVRC-2012 (https://image-net.org) as train/<wnid>/, val/<wnid>/.
- fashion-mnist: the four idx .gz files (Xiao et al., 2017); synthetic: generated from the seed.
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
from functools import partial
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


def quoted(path):
    """A path as one shell word, so that a suggested command can be pasted as it is."""
    return shlex.quote(str(path))


# Tasks, epochs, batch size and resolution of the paper and InfLoRA's configs (ImageNet-R also runs
# with 5 and 20 tasks). Ours: ImageNet-100's 10 epochs (the paper gives none), and the small
# Fashion-MNIST and synthetic settings for runs of minutes.
DATASETS = {name: dict(num_classes=c, tasks=t, epochs=e, batch_size=b, img_size=s)
            for name, c, t, e, b, s in [
                ('cifar100', 100, 10, 20, 128, 224), ('imagenet-r', 200, 10, 50, 128, 224),
                ('domainnet', 345, 5, 5, 128, 224), ('imagenet100', 100, 10, 10, 128, 224),
                ('fashion-mnist', 10, 5, 1, 128, 224), ('synthetic', 12, 3, 20, 16, 64)]}
IMAGENET_R_URL = 'https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar'
DOMAINS = ('clipart', 'infograph', 'painting', 'quickdraw', 'real', 'sketch')
FASHION_FILES = ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz',
                 't10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz')
SPLIT_SEED = 0  # the ImageNet-R split belongs to the benchmark: fixed, whatever the run's seed

# train: the training transform; train_eval: the same images, test transform (class prototypes)
Splits = namedtuple('Splits', 'train train_eval test num_classes class_names')


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


def _fetch(action, what, root, source, download, hint='', made=()):
    """Run a download; its failure, or downloads being off, becomes one DataError saying what to
    do. made: the folders below root that the download may create, deepest first."""
    new = [d for d in [root / m for m in made] + [root] if not d.exists()]
    try:
        if not download:
            raise FileNotFoundError('downloads are off')
        return action()
    except (URLError, OSError, RuntimeError, EOFError, tarfile.TarError) as err:
        for d in new:  # the failed download made these folders: leave none of them behind empty
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise DataError(f'{what} is missing from {root} and could not be downloaded '
                        f'({" ".join(str(err).split())}): put {source} there and pass --data-dir '
                        f'{quoted(root)}{hint}.') from None


def _cifar100(root, seed, download):
    folder = root / CIFAR100.base_folder
    if not folder.is_dir():  # absent: download it, or unpack an archive the user put there
        archive = root / CIFAR100.filename
        if archive.is_file() and not check_integrity(str(archive), CIFAR100.tgz_md5):
            raise DataError(f'{archive} is incomplete or corrupt (its MD5 is not '
                            f'{CIFAR100.tgz_md5}): delete it and fetch it again from '
                            f'{CIFAR100.url}.')  # else torchvision would download it again
        _fetch(partial(CIFAR100, str(root), download=True),
               f'CIFAR-100 ({CIFAR100.base_folder}/ or {CIFAR100.filename})', root, CIFAR100.url,
               download or archive.is_file())
    return _read_cifar100(folder)


def _read_cifar100(folder):
    """The pickled cifar-100-python folder, read as torchvision reads it but without its MD5 check
    of every load, so that a copy written in the same format (a generated one, say) loads too."""
    parts = []
    try:
        for name in ('train', 'test'):
            with open(folder / name, 'rb') as f:
                entry = pickle.load(f, encoding='latin1')
            x = np.asarray(entry['data'], np.uint8).reshape(-1, 3, 32, 32)  # (N, 3, H, W) rows
            x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))  # (N, H, W, 3), as torchvision's
            parts.append((x, list(entry['fine_labels'])))
        with open(folder / 'meta', 'rb') as f:
            names = pickle.load(f, encoding='latin1')['fine_label_names']
    except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError) as e:
        raise DataError(f'{folder} cannot be read as CIFAR-100 ({type(e).__name__}: {e}): delete '
                        f'it and fetch {CIFAR100.url} again.') from None
    if any(len(x) != len(y) for x, y in parts):
        raise DataError(f'{folder} holds unequal numbers of images and labels: fetch it again.')
    return parts, names


def _ls(folder, dirs=False):
    """Sorted names of folder's subfolders (dirs) or image files, hidden ones left out."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name[0] != '.' and
                  (p.is_dir() if dirs else p.name.lower().endswith(IMG_EXTENSIONS)))


def _folder(root, wnids):
    """(paths, labels) of root/<wnid>/<image>, labelled by position in wnids."""
    pairs = [(str(root / w / f), y) for y, w in enumerate(wnids) for f in _ls(root / w)]
    return [p for p, _ in pairs], [y for _, y in pairs]


def _unpack_imagenet_r(root, download):
    folder, tar = root / 'imagenet-r', root / 'imagenet-r.tar'
    if not folder.is_dir() and not tar.is_file():
        _fetch(partial(download_url, IMAGENET_R_URL, str(root)),
               'ImageNet-R (imagenet-r/ or imagenet-r.tar)', root, IMAGENET_R_URL, download)
    if not folder.is_dir():  # unpacked beside it, renamed when whole: a bad tar leaves no half
        tmp = root / f'.imagenet-r.{os.getpid()}'  # one per process: two runs never share it
        try:
            extract_archive(str(tar), str(tmp))
            (tmp / 'imagenet-r').rename(folder)
        except (OSError, EOFError, tarfile.TarError) as err:
            raise DataError(f'{tar} could not be unpacked ({err}): if it is incomplete or corrupt, '
                            f'delete it and fetch it again from {IMAGENET_R_URL}.') from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _split_imagenet_r(folder, wnids, split_file):
    """{'train': [...], 'test': [...]} of '<wnid>/<file>': saved, or drawn 80/20 per class."""
    if not split_file.is_file():
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
    try:  # anything but {"train": [str, ...], "test": [str, ...]} is corrupt or another's file
        split = json.loads(split_file.read_text(encoding='utf-8'))
        valid = all(type(split[k]) is list and all(type(p) is str for p in split[k])
                    for k in ('train', 'test'))
    except (ValueError, TypeError, KeyError):  # ValueError: not JSON, or not UTF-8
        valid = False
    if not valid:
        raise DataError(f'{split_file} is not a train/test split of ImageNet-R: delete it to split '
                        'again.')
    return split


def _imagenet_r(root, seed, download):
    folder = _unpack_imagenet_r(root, download)
    if (folder / 'train').is_dir() and (folder / 'test').is_dir():
        wnids = _ls(folder / 'train', True)
        return [_folder(folder / part, wnids) for part in ('train', 'test')], wnids
    wnids, split_file = _ls(folder, True), root / 'imagenet-r_split.json'
    split, label = _split_imagenet_r(folder, wnids, split_file), {w: y for y, w in enumerate(wnids)}
    paths = split['train'] + split['test']
    if {p.split('/')[0] for p in paths} != set(wnids):
        raise DataError(f'{split_file} does not match the class folders in {folder}: delete it to '
                        'split again.')
    missing = next((p for p in paths if not os.path.isfile(folder / p)), None)
    if missing:  # now, not as a FileNotFoundError hours into training
        raise DataError(f'{folder / missing}, listed in {split_file}, is missing: delete '
                        f'{split_file.name} to split again.')
    return [([str(folder / p) for p in split[part]], [label[p.split('/')[0]] for p in split[part]])
            for part in ('train', 'test')], wnids


def _domainnet(root, seed, download):
    parts, names = [], {}
    for part in ('train', 'test'):
        paths, labels = [], []
        for listing in (root / f'{domain}_{part}.txt' for domain in DOMAINS):
            if not listing.is_file():
                raise DataError(f'DomainNet list {listing.name} is missing from {root}: put the '
                                'six domain folders and their lists from http://ai.bu.edu/M3SDA/ '
                                f'there and pass --data-dir {quoted(root)}.')
            try:
                lines = listing.read_text(encoding='utf-8').splitlines()
            except UnicodeDecodeError:
                raise DataError(f'{listing} is not a UTF-8 text list: fetch it again.') from None
            for n, line in enumerate(lines, 1):
                fields = line.rsplit(maxsplit=1)
                if len(fields) != 2 or not fields[1].isdigit() or fields[0].count('/') < 2:
                    raise DataError(f'line {n} of {listing} is not "domain/class/file.jpg label": '
                                    'fetch it again.')
                paths.append(str(root / fields[0]))
                labels.append(int(fields[1]))
                names.setdefault(labels[-1], fields[0].split('/')[1])
        parts.append((paths, labels))
    # every listed image, now rather than hours into training: ~2 s for DomainNet's 590k, once
    missing = next((p for paths, _ in parts for p in paths if not os.path.isfile(p)), None)
    if missing:
        raise DataError(f'DomainNet image {missing} is listed but missing: unpack all six domain '
                        f'folders from http://ai.bu.edu/M3SDA/ into {root}.')
    return parts, [names.get(y, '?') for y in range(max(names, default=-1) + 1)]


def _imagenet100(root, seed, download):
    """Our class list: the wnids in imagenet100_classes.txt if there, else train/'s first 100."""
    class_file = root / 'imagenet100_classes.txt'
    listed = class_file.is_file()
    wnids = class_file.read_text().split() if listed else _ls(root / 'train', True)[:100]
    for path in [root / part / w for part in ('train', 'val') for w in wnids or ['<wnid>']]:
        if not path.is_dir():
            raise DataError(f'ImageNet-100 folder {path} is missing: put ILSVRC-2012 from '
                            f'https://image-net.org in {root} as train/<wnid>/ and val/<wnid>/ and '
                            f'pass --data-dir {quoted(root)}.')
    return [_folder(root / part, wnids) for part in ('train', 'val')], wnids


def _read_idx(path):
    """uint8 array of an idx file, gzipped or not: magic 0x000008NN (uint8, NN dims), a uint32
    per dim, the data."""
    try:
        with (gzip.open if path.suffix == '.gz' else open)(path, 'rb') as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise DataError(f'{path} is not a complete gzip file ({err}): fetch it again.') from None
    dims = raw[3] if len(raw) >= 4 and raw[:3] == b'\0\0\x08' else 0
    shape = struct.unpack(f'>{dims}I', raw[4:4 + 4 * dims]) if len(raw) >= 4 + 4 * dims else ()
    if not dims or len(shape) != dims or len(raw) != 4 + 4 * dims + int(np.prod(shape)):
        raise DataError(f'{path} is not a complete idx file (wrong header or length): fetch it '
                        'again.')
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def _idx_files(folder):
    """The four files in folder, each gzipped or unpacked (its name without .gz); None if any is
    missing."""
    found = [next((p for p in (folder / f, folder / f[:-3]) if p.is_file()), None)
             for f in FASHION_FILES]
    return None if None in found else found


def _fashion_mnist(root, seed, download):
    raw = root / 'FashionMNIST' / 'raw'  # where torchvision downloads to
    files = _idx_files(root) or _idx_files(raw)
    if files is None:
        first = next(f for f in FASHION_FILES if not (root / f).is_file())
        _fetch(partial(FashionMNIST, str(root), download=True), f'Fashion-MNIST file {first}', root,
               f'the four idx .gz files from {FashionMNIST.mirrors[0]}', download,
               " (or install Debian's dataset-fashion-mnist and pass --data-dir "
               "/usr/share/datasets/fashion-mnist)", made=('FashionMNIST/raw', 'FashionMNIST'))
        files = _idx_files(raw)
    parts = []
    for images, labels in (files[:2], files[2:]):
        x, y = _read_idx(images), _read_idx(labels)
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or y.max(initial=0) >= 10:
            raise DataError(f'{images.name} and {labels.name} in {images.parent} do not match as '
                            'Fashion-MNIST: fetch them again.')
        parts.append((x, y.tolist()))
    if len(parts[0][1]) < len(parts[1][1]):  # 60,000 training images, 10,000 test ones
        raise DataError(f'{files[0].name} holds fewer images ({len(parts[0][1])}) than '
                        f'{files[2].name} ({len(parts[1][1])}) in {files[0].parent}: the training '
                        'and test files are swapped; rename them.')
    return parts, FashionMNIST.classes


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
    return parts, [f'class{c:02d}' for c in range(classes)]


_LOADERS = {'cifar100': _cifar100, 'imagenet-r': _imagenet_r, 'domainnet': _domainnet,
            'imagenet100': _imagenet100, 'fashion-mnist': _fashion_mnist}


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


def _batched(name, img_size, mean, std):
    """(train, test) of _transforms as `Batched` specs for an in-memory set; (None, None) else."""
    if name not in ('cifar100', 'fashion-mnist', 'synthetic'):
        return None, None
    augment = name != 'synthetic'
    return (Batched(img_size, name == 'cifar100', augment, mean, std),
            Batched(img_size, False, False, mean, std))


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
    """Splits(train, train_eval, test, num_classes, class_names) of a data set in DATASETS;
    limit_per_class thins the training set only, so accuracies stay comparable."""
    if name not in DATASETS:
        raise DataError(f'unknown dataset {name!r}: choose one of {", ".join(DATASETS)}.')
    if data_dir is None and name != 'synthetic':
        raise DataError(f'{name} needs --data-dir, the folder that holds (or will hold) its files.')
    if name == 'synthetic':
        ((train, train_y), (test, test_y)), names = _synthetic(img_size, seed)
    else:
        root = Path(data_dir).expanduser().resolve()
        if root.is_file():
            raise DataError(f'--data-dir {quoted(root)} is a file: pass the folder that holds (or '
                            f'will hold) the files of {name}.')
        ((train, train_y), (test, test_y)), names = _LOADERS[name](root, seed, download)
        found, expected = len(set(train_y) | set(test_y)), DATASETS[name]['num_classes']
        if found != expected or len(names) != expected:
            raise DataError(f'{name} in {root} has {found} classes, not {expected}: the copy is '
                            'incomplete or another.')
    if limit_per_class is not None:
        train, train_y = _thin(train, train_y, limit_per_class, seed)
    train_tf, test_tf = _transforms(name, img_size, mean, std)
    train_b, test_b = _batched(name, img_size, mean, std)
    return Splits(_Images(train, train_y, train_tf, train_b),
                  _Images(train, train_y, test_tf, test_b), _Images(test, test_y, test_tf, test_b),
                  len(names), list(names))


def task_classes(num_classes, tasks):
    """T lists of contiguous class ids in natural order (InfLoRA's protocol)."""
    if tasks < 1 or num_classes % tasks:
        raise DataError(f'--tasks {tasks} does not divide the {num_classes} classes evenly: pick a '
                        f'divisor of {num_classes}.')
    if num_classes == tasks:  # a head of one class: its cross-entropy is 0, its accuracy 100%
        raise DataError(f'--tasks {tasks} leaves one class per task, which a head cannot get '
                        f'wrong: pick a divisor of {num_classes} up to {num_classes // 2}.')
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
    """Each epoch, from one generator in the main process: the order and a seed per sample for its
    augmentation. Batches and augmentations then depend on the seed alone, not on --workers."""

    def __init__(self, n, shuffle, seed):
        self.n, self.shuffle = n, shuffle
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.gen) if self.shuffle else torch.arange(self.n)
        seeds = torch.randint(0, 2**62, (self.n,), generator=self.gen)
        return iter(zip(order.tolist(), seeds.tolist()))


class _Seeded(Dataset):
    """ds[i] under torch's generator seeded with s, for (i, s) from `_SeededSampler`; fork_rng
    restores the generator, so loading in the main process leaves the run's draws alone."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, item):
        i, s = item
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s)
            return self.ds[i]


def make_loader(ds, batch_size, train, workers, seed, device=None):
    """Batches of ds (shuffled when train) whose order and augmentations come from seed alone: an
    in-memory set's made on device (default the CPU) by DeviceLoader, a file-based set's by a
    DataLoader with `workers` processes."""
    # the CPU too: batched there, CIFAR-100 at 224 px, batch 128, gave ~3,600 images/s on 2 threads
    # (~1,950 on 1) against ~1,000 from PIL in 2 workers
    if getattr(ds.dataset if isinstance(ds, Subset) else ds, 'batched', None) is not None:
        return DeviceLoader(ds, batch_size, train, seed, torch.device(device or 'cpu'))
    sampler = _SeededSampler(len(ds), train, seed)
    return DataLoader(_Seeded(ds), batch_size=batch_size, sampler=sampler, num_workers=workers,
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
