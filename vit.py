"""A plain ViT (B/16; S/16 and Ti/16 for a CPU) whose K and V layers a method may replace, and
strict loading of the public checkpoints: Google's npz (AugReg in21k), timm-layout state dicts
(DINO, any timm ViT) and this ViT's own state dict.

References: ViT (Dosovitskiy et al., ICLR 2021); AugReg (Steiner et al., TMLR 2022); DINO (Caron
et al., ICCV 2021); timm's layout (R. Wightman, github.com/huggingface/pytorch-image-models).
"""
import functools
import hashlib
import math
import os
import re
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_AUGREG = "https://storage.googleapis.com/vit_models/augreg/"  # big_vision's "howto-i21k-*" files
URLS = {"in21k": {768: _AUGREG + "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0.npz",
                  384: _AUGREG + "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0.npz",
                  192: _AUGREG + "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0.npz"},
        "dino": {768: "https://dl.fbaipublicfiles.com/dino/dino_vitbase16_pretrain/"
                      "dino_vitbase16_pretrain.pth"}}
# The input (mean, std) of the checkpoints' training: Google's [-1, 1], DINO's ImageNet statistics.
MEAN_STD = {"half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
            "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}
PRETRAINED_INPUT = {"in21k": "half", "dino": "imagenet"}


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable, or does not fit the model."""


class Block(nn.Module):
    """Pre-norm attention with separate q, k, v layers, then the MLP; kv_layer(dim, dim) builds
    K's and V's layers, which a method may replace."""

    def __init__(self, dim, num_heads, kv_layer):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)  # the Google checkpoints' eps
        self.attn = nn.ModuleDict(dict(q=nn.Linear(dim, dim), proj=nn.Linear(dim, dim),
                                       k=kv_layer(dim, dim), v=kv_layer(dim, dim)))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(dim, 4 * dim), act=nn.GELU(),
                                             fc2=nn.Linear(4 * dim, dim)))  # erf GELU, as trained

    def forward(self, x):
        """x (B, N+1, D) -> the block's output and h = norm1(x), the input K and V share."""
        h = self.norm1(x)  # float32 even under autocast
        if torch.is_autocast_enabled(x.device.type):  # one bf16 copy for q, k, v and a method
            h = h.to(torch.get_autocast_dtype(x.device.type))
        b, n, d = h.shape
        q, k, v = (t.view(b, n, self.num_heads, -1).transpose(1, 2)  # (B, heads, N+1, D/heads)
                   for t in (self.attn.q(h), self.attn.k(h), self.attn.v(h)))
        y = F.scaled_dot_product_attention(q, k, v)  # (B, heads, N+1, D/heads)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x)), h


class VisionTransformer(nn.Module):
    """ViT-B/16's architecture at any width and depth; kv_layer(dim, dim) builds each block's K
    and V layers: nn.Linear, or a subclass of it that a method passes."""

    def __init__(self, img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                 kv_layer=nn.Linear):
        super().__init__()
        self.embed_dim, self.patch_size = embed_dim, patch_size
        self.grid = img_size // patch_size  # patches per side
        self.patch_embed = nn.Conv2d(3, embed_dim, patch_size, stride=patch_size)  # RGB
        # (1, 1, D) and (1, 1+N, D), trunc-normal std 0.02 as ViT's; checkpoints overwrite them
        self.cls_token = nn.Parameter(nn.init.trunc_normal_(torch.empty(1, 1, embed_dim), std=0.02))
        self.pos_embed = nn.Parameter(nn.init.trunc_normal_(torch.empty(1, 1 + self.grid**2,
                                                                        embed_dim), std=0.02))
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, kv_layer) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def encode(self, images):
        """images (B, 3, H, W) -> z (B, D), the class token after the final LayerNorm, and each
        block's K/V input (B, N+1, D)."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, D, H/p, W/p) -> (B, N, D)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        kv_inputs = []
        for block in self.blocks:
            x, h = block(x)
            kv_inputs.append(h)
        return self.norm(x[:, 0]), kv_inputs  # LayerNorm is per token: the class token's suffices

    def forward(self, images):
        """images (B, 3, H, W) -> z (B, D)."""
        return self.encode(images)[0]


# Presets: 12 blocks of 64-wide heads; keywords override (img_size, patch_size, depth, kv_layer)
PRESETS = {name: functools.partial(VisionTransformer, embed_dim=width, num_heads=width // 64)
           for name, width in [("vit_base", 768), ("vit_small", 384), ("vit_tiny", 192)]}

# ---- Checkpoint loading, as tables per key layout: a model key's checkpoint key (substitutions in
# order); the tensor layout to ours (the first pattern that matches the model key); the keys
# ignored, the classifier's. Not fc_norm: trained on pooled tokens, it has no `norm` for our class
# token, so a checkpoint with it must fail.
_RENAMES = {
    "ours": [],  # first, max()'s pick for a file of no layout: its missing keys in our names
    "timm": [(r"^patch_embed\.", "patch_embed.proj."), (r"attn\.[qkv]\.", "attn.qkv.")],
    "npz": [(r"^cls_token$", "cls"), (r"^pos_embed$", "Transformer/posembed_input/pos_embedding"),
            (r"^patch_embed\.", "embedding."), (r"^norm\.", "Transformer/encoder_norm."),
            (r"^blocks\.(\d+)\.", r"Transformer/encoderblock_\1/"), (r"norm1", "LayerNorm_0"),
            (r"norm2", "LayerNorm_2"), (r"mlp\.fc1", "MlpBlock_3/Dense_0"),
            (r"mlp\.fc2", "MlpBlock_3/Dense_1"), (r"attn\.", "MultiHeadDotProductAttention_1/"),
            (r"/q\.", "/query."), (r"/k\.", "/key."), (r"/v\.", "/value."), (r"/proj\.", "/out."),
            (r"(norm|LayerNorm_\d)\.weight$", r"\1/scale"),  # a LayerNorm weight is 'scale',
            (r"\.weight$", "/kernel"), (r"\.bias$", "/bias")]}  # a conv or dense weight 'kernel'
_TRANSFORMS = {
    "ours": [],
    "timm": [(rf"attn\.{n}\.", lambda t, j=j: t.chunk(3)[j]) for j, n in enumerate("qkv")],
    "npz": [(r"patch_embed\.weight", lambda t: t.movedim((-1, -2), (0, 1))),  # HWIO -> (D, C, p, p)
            # a q/k/v kernel (D, heads, D/heads) or a dense kernel (in, out) -> (out, in)
            (r"attn\.[qkv]\.weight|mlp\.fc\d\.weight", lambda t: t.reshape(t.shape[0], -1).T),
            (r"attn\.[qkv]\.bias", torch.flatten),  # (heads, D/heads) -> (D,)
            (r"attn\.proj\.weight", lambda t: t.reshape(-1, t.shape[-1]).T)]}  # (heads, D/h, D)
_IGNORED = r"^(head|pre_logits)[./]"  # the classifier and its pre-logits layer, if any
_OWN = ("weight", "bias", "cls_token", "pos_embed")  # the ViT's tensors; a K/V layer may add more
_ELSE = "pass another file with --weights PATH."


def load_pretrained(model, source="in21k"):
    """Fill the ViT's own tensors (_OWN; not those a replaced K/V layer adds) from `source`, a name
    in URLS, 'none' or a file, in the key layout that names the most of them, strictly: each filled
    at its exact shape, each checkpoint key used or ignored, each value finite, or a CheckpointError
    naming the keys. Prints one line of what was loaded; returns the file's path (or None)."""
    if source == "none":
        print("[vit] --weights none: the backbone keeps its random initialisation")
        return None
    if source not in URLS and not os.path.isfile(source):
        raise CheckpointError(f"--weights {source} is neither a known name ({', '.join(URLS)}, "
                              "none) nor a file; " + _ELSE)
    path = _download(model, source) if source in URLS else os.fspath(source)
    sd, container = _read(path)
    want = {k: v.shape for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] in _OWN}
    names = {layout: {k: functools.reduce(lambda key, rule: re.sub(*rule, key), rules, k)
                      for k in want} for layout, rules in _RENAMES.items()}  # ours -> theirs
    layout = max(names, key=lambda n: sum(key in sd for key in names[n].values()))
    theirs, ready, resized, misfit = names[layout], {}, "", []
    for ours, key in ((o, k) for o, k in theirs.items() if k in sd):
        t = next((f(sd[key]) for p, f in _TRANSFORMS[layout] if re.search(p, ours)), sd[key])
        if ours == "pos_embed" and t.shape != want[ours]:  # trained at another resolution
            t, resized = _resize_pos_embed(t, model.grid)
        if t.shape != want[ours]:
            misfit.append(f"{key} {tuple(sd[key].shape)} vs {ours} {tuple(want[ours])}")
        ready[ours] = t
    ignored = sorted(k for k in sd if re.match(_IGNORED, k))
    problems = {"missing keys": [k for k in dict.fromkeys(theirs.values()) if k not in sd],
                "unexpected keys": sorted(set(sd) - set(theirs.values()) - set(ignored)),
                "shape mismatches, checkpoint vs model": misfit,
                "NaN/inf values": [theirs[k] for k, t in ready.items() if not t.isfinite().all()]}
    problems = "".join(f"{what} ({len(found)}): {', '.join(found[:4])}; "
                       for what, found in problems.items() if found)
    if problems:  # before any tensor is copied: a failed load leaves the model as it was
        raise CheckpointError(f"cannot load {path} ({layout} layout) into this ViT (width "
                              f"{model.embed_dim}, {len(model.blocks)} blocks): {problems}" + _ELSE)
    model.load_state_dict(ready, strict=False)  # not strict: a K/V layer's own tensors stay
    print(f"[vit] {path}: {container} file, {layout} key layout, {len(ready)} tensors loaded"
          f"{resized}, ignored checkpoint keys: {', '.join(ignored) or 'none'}")
    return path


def digest(model):
    """A hex digest of the model's tensors: a backbone known by its content, not its file's name."""
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _resize_pos_embed(pos, grid):
    """(1, 1+g*g, D) -> (1, 1+grid*grid, D), bicubic on the token grid; the class token's kept."""
    g = math.isqrt(pos.shape[1] - 1)
    if g * g != pos.shape[1] - 1:  # no square grid: left to the shape check to report
        return pos, ""
    tok = pos[:, 1:].float().reshape(1, g, g, -1).permute(0, 3, 1, 2)  # (1, D, g, g)
    # antialiased, as timm's: a shrunken grid (14x14 -> 2x2 at 32 px) does not alias
    tok = F.interpolate(tok, size=(grid, grid), mode="bicubic", antialias=True)
    tok = tok.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(pos.dtype)
    return torch.cat([pos[:, :1], tok], 1), f", position embedding resized {g}x{g} -> {grid}x{grid}"


def _read(path):
    """{key: tensor} and the container: an .npz file's arrays, else what torch.load reads."""
    try:
        if path.endswith(".npz"):
            with np.load(path) as z:
                return {k: torch.from_numpy(z[k]) for k in z.files}, "npz"
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- numpy and torch fail on junk with a dozen types
        first = re.split(r"(?<=\w)\.\s|\n", str(e))[0]  # the first sentence: torch's run on
        raise CheckpointError(f"{path} is not a checkpoint ({type(e).__name__}: {first}); " + _ELSE)
    # unwrapped from training scripts' {'model': state_dict, ...}; what is no dict fits no layout
    return sd.get("model", sd.get("state_dict", sd)) if isinstance(sd, dict) else {}, "torch"


def _download(model, source):
    """The hub-cache path of a named checkpoint, downloaded (with a progress bar) if not there."""
    url = URLS[source].get(model.embed_dim)
    if url is None or model.patch_size != 16:  # in21k in three widths, the others B/16 only
        raise CheckpointError(f"no '{source}' weights for a ViT of width {model.embed_dim}, "
                              f"patch {model.patch_size}; use a matching preset, or " + _ELSE)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))
    if not os.path.isfile(path):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.hub.download_url_to_file(url, path)
        except OSError as e:  # urllib's URLError and HTTPError are OSErrors
            raise CheckpointError(f"cannot download {url} ({e}); put it at {path} by hand, or "
                                  "pass --weights PATH, or --weights none for random ones.") from e
    return path
