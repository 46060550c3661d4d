"""Data sets, class-incremental task splits and seeded loaders for the Janus-LoRA reference code.
The protocol is the InfLoRA codebase's (Liang & Li, CVPR 2024), on which the paper ran: classes in
natural order, T equal tasks of contiguous class ids, no exemplars, its transforms."""
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
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler
from torchvision import datasets, transforms as T


class DataError(Exception):
    """A data set is missing, incomplete or corrupt, or the task split is impossible. torch raises
    one from a loader worker again with the worker's traceback as message: __str__ keeps its end."""

    def __str__(self):
        return super().__str__().rpartition(f"{__name__}.DataError: ")[2].rstrip("\n")


# Tasks, epochs, batch, resolution, patch: the paper's and InfLoRA's configs; ours: ImageNet-100's
# 10 epochs, synthetic's minute on a CPU, Fashion-MNIST's own 28 px in 7 px patches (no checkpoint).
DATASETS = {name: dict(num_classes=c, tasks=t, epochs=e, batch_size=b, img_size=s, patch_size=p)
            for name, c, t, e, b, s, p in [
                ("cifar100", 100, 10, 20, 128, 224, 16), ("imagenet-r", 200, 10, 50, 128, 224, 16),
                ("domainnet", 345, 5, 5, 128, 224, 16), ("imagenet100", 100, 10, 10, 128, 224, 16),
                ("fashion-mnist", 10, 5, 1, 128, 28, 7), ("synthetic", 12, 3, 5, 16, 64, 16)]}
IN_MEMORY = ("synthetic", "cifar100", "fashion-mnist")  # held as arrays: no loader processes
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
IMAGENET_R_URL = "https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar"
FASHION_URL = datasets.FashionMNIST.mirrors[0]
DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
# train_eval: the training images under the test transform (for the class prototypes)
Splits = namedtuple("Splits", "train train_eval test num_classes")
# DeviceLoader's transform: RandomResizedCrop's crop if crop, a flip (p = 1/2) if flip, the resize
# to size x size, the normalisation
Batched = namedtuple("Batched", "size crop flip mean std")


class _Images(Dataset):
    """source[i]: an image file's path, or a uint8 array or tensor (C, H, W), C = 1 (grey) or 3;
    batched: the same transform as a `Batched` for the device pipeline, None for file-based sets."""

    def __init__(self, source, targets, transform, batched=None):
        self.source, self.targets = source, list(targets)
        self.transform, self.batched = transform, batched

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.transform(_read(self.source[i])), self.targets[i]


def _read(item):
    """A source item as a transform takes it: a tensor in [0, 1], else an RGB image (grey to 3)."""
    if torch.is_tensor(item):
        return item.float() / 255
    if isinstance(item, str):  # a file, read whole here: a damaged one is named
        with _reading(item, "replace it with an intact copy (fetch the data set again)"):
            img = Image.open(item)
            img.load()
    else:
        img = T.functional.to_pil_image(torch.tensor(item))
    return img.convert("RGB")


def _take(ds, idx):
    """The _Images of ds's images idx, in that order."""
    source = [ds.source[i] for i in idx] if isinstance(ds.source, list) else ds.source[idx]
    return _Images(source, [ds.targets[i] for i in idx], ds.transform, ds.batched)


@contextmanager
def _reading(what, fix):
    """Any failure to read `what` (missing, incomplete, corrupt) as one DataError: why, and fix."""
    try:
        yield
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError, RuntimeError,
            struct.error, pickle.UnpicklingError, tarfile.TarError) as err:
        why = " ".join(str(err).split())  # one line: tarfile's lists a line per method tried
        raise DataError(f"{what} cannot be read ({type(err).__name__}: {why}): {fix}.") from None


def _download(url, root):
    """url's file into root (named as url's end); a failure names it, and leaves no root it made."""
    made = not root.exists()
    try:
        with _reading(root / url.rsplit("/", 1)[1], f"it is missing: put it there from {url}"):
            datasets.utils.download_url(url, str(root))
    except DataError:
        if made:
            shutil.rmtree(root, ignore_errors=True)
        raise


def _unpack(root, url, name, download):
    """root/name from url's archive in root (downloaded if absent), unpacked beside, renamed."""
    archive = root / url.rsplit("/", 1)[1]
    if download and not archive.is_file():
        _download(url, root)
    if archive.is_file():  # else neither folder nor archive: reading the folder says so
        tmp = root / f".{name}.{os.getpid()}"  # one per process: two runs never share it
        try:
            with _reading(archive, f"delete it and fetch it again from {url}"):
                datasets.utils.extract_archive(str(archive), str(tmp))
            (tmp / name).rename(root / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _cifar100(root, download):
    """cifar-100-python/ in root, or root itself, read as torchvision reads it, without its MD5."""
    folder = root if (root / "meta").is_file() else root / "cifar-100-python"
    if not folder.is_dir():
        _unpack(root, CIFAR100_URL, folder.name, download)
    parts = []
    for part in ("train", "test"):
        raw = (folder / part).read_bytes()  # if missing, load_dataset says what to put there
        with _reading(folder / part, "delete it and fetch it again"):
            entry = pickle.loads(raw, encoding="latin1")
            nchw = np.asarray(entry["data"], np.uint8).reshape(-1, 3, 32, 32)  # rows: C, H, W
            parts.append((nchw, list(entry["fine_labels"])))
    return parts


def _ls(folder, dirs=False):
    """Sorted names of folder's subfolders (dirs) or image files, but hidden ones (macOS's ._*)."""
    return sorted(p.name for p in folder.iterdir() if p.name[0] != "." and
                  (p.is_dir() if dirs else p.name.lower().endswith(datasets.folder.IMG_EXTENSIONS)))


def _folder(root, wnids):
    """(paths, labels) of root/<wnid>/<image>, labelled by position in wnids."""
    pairs = [(str(root / w / f), y) for y, w in enumerate(wnids) for f in _ls(root / w)]
    return [p for p, _ in pairs], [y for _, y in pairs]


def _imagenet_r(root, download):
    """imagenet-r/train/ + test/ as they are (LAE's), else imagenet-r/<wnid>/ split 80/20 per class,
    drawn once into imagenet-r_split.json beside it and read from it after, so that every run and
    resume sees one split: one that lists an image or a class not there fails now."""
    folder = root if root.name == "imagenet-r" and not (root / "imagenet-r").is_dir() else (
        root / "imagenet-r")  # root: the folder that holds imagenet-r/, or imagenet-r/ itself
    if not folder.is_dir():
        _unpack(root, IMAGENET_R_URL, folder.name, download)
    if (folder / "train").is_dir() and (folder / "test").is_dir():
        return [_folder(folder / part, _ls(folder / "train", True)) for part in ("train", "test")]
    wnids, split_file = _ls(folder, dirs=True), folder.parent / "imagenet-r_split.json"
    images = {w: [f"{w}/{f}" for f in _ls(folder / w)] for w in wnids}  # each class's, sorted
    if split_file.is_file():
        with _reading(split_file, "delete it to split again"):
            split = json.loads(split_file.read_text(encoding="utf-8"))
            paths = split["train"] + split["test"]  # a TypeError unless two lists
            if not set(paths) <= {p for files in images.values() for p in files} or (
                    {p.split("/")[0] for p in paths} != set(wnids)):
                raise ValueError(f"it lists images or classes that are not those in {folder}")
    else:  # per class (~50 to 400+ images), from sorted paths and seed 0: the benchmark's split
        gen, split = torch.Generator().manual_seed(0), {"train": [], "test": []}
        for w, files in images.items():
            order = torch.randperm(len(files), generator=gen).tolist()
            n_test = round(0.2 * len(files))  # the protocol's 80/20
            if not 0 < n_test < len(files):  # 0 to 2 images leave a part without the class
                raise ValueError(f"its class {folder / w} has {len(files)} images, too few to "
                                 "split 80/20: it needs 3 or more")
            split["test"] += [files[i] for i in order[:n_test]]
            split["train"] += [files[i] for i in order[n_test:]]
        # kept when whole (else load_dataset says what is missing); a read-only copy goes without
        if len(wnids) == DATASETS["imagenet-r"]["num_classes"] and os.access(folder.parent,
                                                                             os.W_OK):
            split_file.write_text(json.dumps(split, indent=0))
    label = {w: y for y, w in enumerate(wnids)}
    return [([str(folder / p) for p in split[part]], [label[p.split("/")[0]] for p in split[part]])
            for part in ("train", "test")]


def _domainnet(root, download):
    """The official lists <domain>_<train|test>.txt of lines '<domain>/<class>/<file> <label>'. A
    listed image that is missing fails when first read: in the first batches, if a domain is."""
    parts = []
    for part in ("train", "test"):
        paths, labels = [], []
        for listing in (root / f"{domain}_{part}.txt" for domain in DOMAINS):
            raw = listing.read_bytes()
            with _reading(listing, "fetch it again"):
                pairs = [line.rsplit(maxsplit=1) for line in raw.decode("utf-8").splitlines()]
                paths += [str(root / path) for path, _ in pairs]  # a ValueError unless 'path y'
                labels += [int(label) for _, label in pairs]
        parts.append((paths, labels))
    return parts


def _imagenet100(root, download):
    """Our class list: the wnids in imagenet100_classes.txt if there, else train/'s first 100."""
    listed = root / "imagenet100_classes.txt"
    wnids = listed.read_text().split() if listed.is_file() else _ls(root / "train", True)[:100]
    return [_folder(root / part, wnids) for part in ("train", "val")]


def _fashion_mnist(root, download):
    """The four idx files in root, gzipped or not (a missing one downloaded if download). idx: a
    magic number whose last byte counts the dims (the name's idx3, idx1), a big-endian uint32 per
    dim, the uint8 data."""
    arrays = []
    for name in ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1"):
        path = root / f"{name}-ubyte" if (root / f"{name}-ubyte").is_file() else (
            root / f"{name}-ubyte.gz")
        if download and not path.is_file():
            _download(FASHION_URL + path.name, root)
        b = path.read_bytes()
        with _reading(path, "delete it and fetch it again"):
            b = gzip.decompress(b) if path.suffix == ".gz" else b
            if b[3] != int(name[-1]):  # another of the four files under this one's name
                raise ValueError(f"{b[3]} dimensions where its name says {name[-1]}")
            shape = struct.unpack(f">{b[3]}I", b[4:4 + 4 * b[3]])  # a damaged one fails to reshape
            arrays.append(np.frombuffer(bytearray(b), np.uint8, offset=4 + 4 * b[3]).reshape(shape))
    return [(arrays[0][:, None], arrays[1].tolist()), (arrays[2][:, None], arrays[3].tolist())]


def _synthetic(img_size, seed, per_class=(24, 8), patterns=8):
    """Tasks whose images occupy different input subspaces, as real tasks' largely do: the premise
    of the paper's memory (Fig. 2). Each task has its own `patterns` random patterns of a tile; an
    image is a 4 x 4 grid of tiles (ViT-B/16's patches at 64 px), each a random mix of its task's
    patterns about its class's mean mix, on grey, plus noise. A mix varies about its class's mean
    as much as the means differ, so a task's classes overlap, as real ones do, and a backbone that
    drifts costs them accuracy."""
    classes, tasks = DATASETS["synthetic"]["num_classes"], DATASETS["synthetic"]["tasks"]
    gen = torch.Generator().manual_seed(seed)
    tile = -(-img_size // 4)  # a 4 x 4 grid of tiles, cropped to img_size
    bank = torch.randn(tasks, patterns, 3 * tile * tile, generator=gen)  # (T, P, 3 t t)
    means = torch.randn(classes, patterns, generator=gen)  # (C, P): each class's mean mix
    parts = []
    for n in per_class:
        labels = torch.arange(classes).repeat_interleave(n)  # (N,)
        mixes = means[labels, None] + torch.randn(len(labels), 16, patterns, generator=gen)
        tiles = mixes @ bank[labels // (classes // tasks)] / patterns**0.5  # (N, 16, 3 t t)
        grid = tiles.view(-1, 4, 4, 3, tile, tile).permute(0, 3, 1, 4, 2, 5)  # (N, 3, 4, t, 4, t)
        imgs = grid.reshape(-1, 3, 4 * tile, 4 * tile)[..., :img_size, :img_size]  # (N, 3, H, W)
        # pixels about grey 0.5 with a std of about 0.2 (0.15 times a mix's sqrt(2)), rarely
        # clipped, and noise of std 0.05: no two images equal
        imgs = 0.5 + 0.15 * imgs + 0.05 * torch.randn(imgs.shape, generator=gen)
        parts.append(((imgs.clamp(0, 1) * 255).round().to(torch.uint8), labels.tolist()))
    return parts


# a file-based set's loader, and what to put in --data-dir where it is missing
_LOADERS = {
    "cifar100": (_cifar100, f"cifar-100-python/ or its archive from {CIFAR100_URL}"),
    "imagenet-r": (_imagenet_r, f"imagenet-r/ or imagenet-r.tar from {IMAGENET_R_URL}"),
    "domainnet": (_domainnet, "the six domain folders and lists from http://ai.bu.edu/M3SDA/"),
    "imagenet100": (_imagenet100, "ILSVRC-2012 (image-net.org) as train/<wnid>/, val/<wnid>/"),
    "fashion-mnist": (_fashion_mnist, f"the four idx .gz files from {FASHION_URL} "
                      "(or Debian's dataset-fashion-mnist: /usr/share/datasets/fashion-mnist)")}


def _transforms(name, img_size, mean, std):
    """((train, test) transforms, (train, test) `Batched` specs of an in-memory set, else None)
    after InfLoRA: RandomResizedCrop + flip to train; to test, Resize (CIFAR) or Resize(256) +
    CenterCrop(224) scaled by img_size / 224 (the others). Ours: synthetic as it is; Fashion-MNIST
    with no random crop, which can cut away much of a small centred item."""
    norm, square = T.Normalize(mean, std), [T.Resize((img_size, img_size))]
    plain = Batched(img_size, False, False, mean, std)  # no crop, no flip
    if name == "synthetic":
        return (norm, norm), (plain, plain)
    crop = [T.Resize(round(256 * img_size / 224)), T.CenterCrop(img_size)]
    test = square if name in ("cifar100", "fashion-mnist") else crop
    train = square if name == "fashion-mnist" else [T.RandomResizedCrop(img_size)]
    tail = [T.ToTensor(), norm]
    tfs = T.Compose(train + [T.RandomHorizontalFlip()] + tail), T.Compose(test + tail)
    specs = Batched(img_size, name == "cifar100", True, mean, std), plain  # cropped: CIFAR only
    return tfs, specs if name in IN_MEMORY else (None, None)


def load_dataset(name, data_dir, img_size, mean, std, seed=0, download=True):
    """Splits of a data set in DATASETS (seed: the synthetic set's), read and checked now, so that
    a missing or damaged set stops the run before it trains."""
    classes = DATASETS[name]["num_classes"]
    if name == "synthetic":
        (train, train_y), (test, test_y) = _synthetic(img_size, seed)
    else:  # a --data-dir that is a file fails here too: NotADirectoryError, and the fix
        root, (loader, source) = Path(data_dir).expanduser().resolve(), _LOADERS[name]
        with _reading(f"{name} in {root}",
                      f"put {source} there and pass --data-dir {shlex.quote(str(root))}"):
            (train, train_y), (test, test_y) = loader(root, download)
            if len(train) != len(train_y) or len(test) != len(test_y):
                raise ValueError("its numbers of images and labels differ")
            if not set(train_y) == set(test_y) == set(range(classes)):
                raise ValueError(f"{len(set(train_y))} training and {len(set(test_y))} test "
                                 f"classes, not {classes}: incomplete, or another data set")
    (train_tf, test_tf), (train_b, test_b) = _transforms(name, img_size, mean, std)
    return Splits(_Images(train, train_y, train_tf, train_b),
                  _Images(train, train_y, test_tf, test_b), _Images(test, test_y, test_tf, test_b),
                  classes)


def task_classes(num_classes, tasks):
    """T lists of contiguous class ids in natural order (InfLoRA's protocol)."""
    per = num_classes // max(tasks, 1)
    if per < 2 or per * tasks != num_classes:  # a head of one class: loss 0, accuracy 100%
        raise DataError(f"--tasks {tasks} does not split {num_classes} classes into equal tasks of "
                        f"2 or more: pick a divisor of {num_classes} up to {num_classes // 2}.")
    return [list(range(t * per, (t + 1) * per)) for t in range(tasks)]


def subset(ds, classes):
    """ds's images of the given classes, in ds's order, with their global class ids."""
    keep = set(classes)
    return _take(ds, [i for i, y in enumerate(ds.targets) if y in keep])


def thin(splits, limit, seed):
    """splits with at most `limit` training images per class (None: all), drawn from seed."""
    if limit is None:
        return splits
    targets = splits.train.targets
    rank, count = {}, {}  # rank[i]: image i's place among its class's, in the shuffled order
    for i in torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed)).tolist():
        rank[i] = count[targets[i]] = count.get(targets[i], 0) + 1
    kept = [i for i in range(len(targets)) if rank[i] <= limit]
    return splits._replace(train=_take(splits.train, kept),
                           train_eval=_take(splits.train_eval, kept))


def make_loader(ds, batch_size, train, workers, seed, device=None):
    """Batches of ds (shuffled when train) whose order and augmentations come from seed alone: an
    in-memory set's by DeviceLoader (on the CPU too: CIFAR-100 at 224 px, 3,600 images/s on 2
    threads, PIL 1,000 in 2 workers), a file-based set's by _Batches."""
    if ds.batched is not None:
        return DeviceLoader(ds, batch_size, train, seed, torch.device(device or "cpu"))
    return _Batches(ds, batch_size, train, workers, seed)


class _Seeded(Dataset):
    """Items (image, label, transform, seed), made under that seed: one DataLoader serves all."""

    def __getitem__(self, item):
        image, label, transform, seed = item
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return transform(_read(image)), label


class _Draws(Sampler):
    """Each epoch's (i, seed) pairs, drawn in the main process by one generator: the order
    (shuffled when shuffle) and a seed per sample, under which _Seeded makes it."""

    def __init__(self, n, shuffle, seed):
        self.n, self.shuffle, self.gen = n, shuffle, torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.gen) if self.shuffle else torch.arange(self.n)
        return zip(order.tolist(), torch.randint(0, 2**62, (self.n,), generator=self.gen).tolist())


_pool = None  # the process's DataLoader of _Seeded items, made by its first file-based epoch


class _Batches:
    """ds's batches, epoch after epoch: _Draws draws each epoch's order and seeds here, the
    process's one DataLoader (_pool) makes the items in `workers` processes. These start once, for
    every pass: under spawn and forkserver each costs a Python and `import torch`."""

    def __init__(self, ds, batch_size, train, workers, seed):
        self.ds, self.workers = ds, workers
        self.draws = BatchSampler(_Draws(len(ds), train, seed), batch_size, drop_last=False)

    def __len__(self):
        return len(self.draws)

    def __iter__(self):
        """One epoch. The workers serve one pass at a time: a pass begun within another would take
        them over, and is refused."""
        global _pool
        if _pool is None or _pool.num_workers != self.workers:
            end_workers()
            _pool = DataLoader(_Seeded(), batch_sampler=[], num_workers=self.workers,
                               persistent_workers=self.workers > 0,
                               pin_memory=torch.cuda.is_available(),  # a copy that overlaps
                               generator=torch.Generator())  # its base seed: not the run's
        feed, ds = _pool.batch_sampler, self.ds  # feed: the epoch's batches, empty between epochs
        if feed:
            raise RuntimeError("a pass over a file-based set began before the last one ended")
        feed += [[(ds.source[i], ds.targets[i], ds.transform, seed) for i, seed in batch]
                 for batch in self.draws]
        try:
            yield from _pool
        finally:
            feed.clear()


def end_workers():
    """Ends the loader workers now, which an error's traceback would otherwise hold past the run."""
    global _pool
    if _pool is not None and _pool._iterator is not None:
        _pool._iterator._shutdown_workers()
    _pool = None


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
    """An in-memory set's batches (images (B, 3, S, S) float32, labels (B,)) made on device; one
    CPU generator draws each epoch's order (when train), crops and flips, the same on any device."""

    def __init__(self, ds, batch_size, train, seed, device):
        self.images = torch.as_tensor(ds.source).to(device)  # (N, C, H, W) uint8, C: 1 or 3
        self.labels = torch.tensor(ds.targets, device=device)  # (N,)
        self.spec, self.batch_size, self.train = ds.batched, batch_size, train
        self.device, self.gen = device, torch.Generator().manual_seed(seed)
        self.mean, self.std = (torch.tensor(v, device=device).view(-1, 1, 1)
                               for v in (self.spec.mean, self.spec.std))

    def __len__(self):
        return -(-len(self.labels) // self.batch_size)

    def __iter__(self):
        """One epoch, all its draws made at its first batch, however many batches are taken."""
        n, (height, width) = len(self.labels), self.images.shape[2:]
        order = torch.randperm(n, generator=self.gen) if self.train else torch.arange(n)
        boxes = (crop_boxes(self.gen, n, height, width) if self.spec.crop
                 else torch.tensor([0, 0, height, width]).expand(n, 4))  # (n, 4)
        flips = (torch.rand(n, generator=self.gen) < 0.5 if self.spec.flip
                 else torch.zeros(n, dtype=torch.bool))  # (n,)
        for idx, box, flip in zip(*(t.to(self.device).split(self.batch_size)
                                    for t in (order, boxes, flips))):
            # normalised first: the resize is linear with rows that sum to 1, so this equals
            # torchvision's order (normalising after the resize) but for PIL's uint8 rounding, on
            # the small images; grey is copied to 3 channels, as PIL's RGB
            x = (self.images[idx].float() / 255 - self.mean) / self.std  # (B, 1 or 3, H, W)
            x = x.expand(-1, 3, -1, -1)  # (B, 3, H, W)
            yield resized_crops(x, box, self.spec.size, flip), self.labels[idx]
