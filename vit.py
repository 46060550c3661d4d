"""A from-scratch ViT (B/16; S/16, Ti/16 for CPU) with LoRA on K and V, and strict loading of the
public checkpoints (Google npz, timm-style and torchvision state dicts, safetensors; URLS below).
References: Janus-LoRA (C. Chen et al., ICML 2026); ViT (Dosovitskiy et al., ICLR 2021); LoRA (Hu et
al., ICLR 2022); AugReg (Steiner et al., TMLR 2022); SAM-trained ViT (Chen et al., ICLR 2022); DINO
(Caron et al., ICCV 2021).
"""
import functools
import json
import math
import os
import re
import zipfile
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import ViT_B_16_Weights

_AUGREG = 'https://storage.googleapis.com/vit_models/augreg/'  # big_vision's "howto-i21k-*" files
URLS = {'in21k': {768: _AUGREG + 'B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0.npz',
                  384: _AUGREG + 'S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0.npz',
                  192: _AUGREG + 'Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0.npz'},
        'sam': 'https://storage.googleapis.com/vit_models/sam/ViT-B_16.npz',
        'dino': 'https://dl.fbaipublicfiles.com/dino/dino_vitbase16_pretrain/'
                'dino_vitbase16_pretrain.pth',
        'torchvision': ViT_B_16_Weights.IMAGENET1K_V1.url}
# Input (mean, std) of the checkpoints' training: Google's [-1, 1]; DINO's, torchvision's ImageNet's
MEAN_STD = {'half': ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
            'imagenet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}
PRETRAINED_INPUT = {'in21k': 'half', 'sam': 'half', 'dino': 'imagenet', 'torchvision': 'imagenet'}


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable, or does not fit the model."""


class LoRALinear(nn.Linear):
    """Frozen linear layer W0 plus a trainable update scale * B @ A (Eq. (1)); the forward takes the
    block's protected memory M (d_in, m), orthonormal, which the learner owns."""

    def __init__(self, in_features, out_features, rank, scale):
        super().__init__(in_features, out_features)
        self.requires_grad_(False)  # weight and bias are pretrained and frozen
        self.scale = float(scale)
        self.A = nn.Parameter(torch.empty(rank, in_features))   # (r, d_in)
        self.B = nn.Parameter(torch.empty(out_features, rank))  # (d_out, r)
        self.reset_lora_()

    def forward(self, x, memory=None):  # x (..., d_in), memory (d_in, m) or None
        out = F.linear(x, self.weight, self.bias)
        if memory is None or memory.shape[1] == 0:
            return out + self.scale * F.linear(F.linear(x, self.A), self.B)
        # Janus-LoRA Theorem 1, Eq. (3), by autograd. A = A_out + A_in, A_in = A M M^T constant:
        # the output and dL/dx are unchanged, and the factor gradients become the chain rule of the
        # safe gradient, dL/dA = s B^T G (I - M M^T), dL/dB = s G (I - M M^T) A^T (G = dL/dW).
        with torch.autocast(x.device.type, enabled=False):  # the projection in float32 at least
            dt = torch.promote_types(self.A.dtype, torch.float32)
            a, m = self.A.to(dt), memory.to(dt)
            a_proj = (a @ m) @ m.T  # (r, d_in): A M M^T
            a_in, a_out = a_proj.detach(), a - a_proj  # A_in held constant; A_out carries dL/dA
        xa = F.linear(x, torch.cat([a_out, a_in]).to(x.dtype))  # (..., 2r)
        # one matmul against [B | B.detach()] (d_out, 2r): x A_out^T B^T + x A_in^T B.detach()^T
        return out + self.scale * F.linear(xa, torch.cat([self.B, self.B.detach()], 1))

    @torch.no_grad()
    def reset_lora_(self, memory=None):
        """A fresh pair: A Kaiming-uniform with its rows moved off span(M), B = 0."""
        # nn.Linear's own init, drawn on the CPU: a run's random numbers must not depend on device
        self.A.copy_(nn.init.kaiming_uniform_(torch.empty(self.A.shape), a=math.sqrt(5)))
        if memory is not None:
            m = memory.to(self.A.dtype)
            self.A -= (self.A @ m) @ m.T
            if m.shape[1] == m.shape[0]:  # a full memory: an exact 0, no round-off for GR to grow
                self.A.zero_()
        self.B.zero_()

    @torch.no_grad()
    def merge_(self, memory=None):
        """Fold scale * B @ A into the frozen weight, then a fresh pair off the memory (the same
        Parameter objects)."""
        self.weight += self.scale * (self.B @ self.A).to(self.weight.dtype)
        self.reset_lora_(memory)


class Attention(nn.Module):
    def __init__(self, dim, num_heads, rank, scale):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.proj = nn.Linear(dim, dim), nn.Linear(dim, dim)  # no adapter on Q and output
        self.k, self.v = LoRALinear(dim, dim, rank, scale), LoRALinear(dim, dim, rank, scale)

    def forward(self, x, memory=None):  # x (B, N, D); memory (D, m): K and V share their input
        b, n, d = x.shape
        # (B, N, D) -> (B, heads, N, D/heads), the layout SDPA wants
        q, k, v = (t.view(b, n, self.num_heads, -1).transpose(1, 2)
                   for t in (self.q(x), self.k(x, memory), self.v(x, memory)))
        x = F.scaled_dot_product_attention(q, k, v)  # (B, heads, N, D/heads)
        return self.proj(x.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio, rank, scale):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)  # eps of the Google checkpoints
        self.attn = Attention(dim, num_heads, rank, scale)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(dim * mlp_ratio)  # exact (erf) GELU, as the checkpoints were trained
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(dim, hidden), act=nn.GELU(),
                                             fc2=nn.Linear(hidden, dim)))

    def forward(self, x, memory=None):  # x (B, N+1, D) -> (x, h); h = norm1(x), K's and V's input
        h = self.norm1(x)  # float32 even under autocast
        if torch.is_autocast_enabled(x.device.type):  # one bf16 copy for q, k, v and OE
            h = h.to(torch.get_autocast_dtype(x.device.type))
        x = x + self.attn(h, memory)
        return x + self.mlp(self.norm2(x)), h


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                 mlp_ratio=4.0, lora_rank=10, lora_scale=1.0, in_chans=3):
        super().__init__()
        self.embed_dim, self.patch_size = embed_dim, patch_size
        self.grid = img_size // patch_size  # patches per side
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)
        # (1, 1, D) and (1, 1+N, D), trunc-normal std 0.02 as in ViT; the checkpoints overwrite them
        self.cls_token = nn.Parameter(nn.init.trunc_normal_(torch.empty(1, 1, embed_dim), std=0.02))
        self.pos_embed = nn.Parameter(nn.init.trunc_normal_(torch.empty(1, 1 + self.grid**2,
                                                                        embed_dim), std=0.02))
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, lora_rank, lora_scale)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.requires_grad_(False)
        for p in self.lora_parameters():
            p.requires_grad_(True)

    def encode(self, images, memory=None):
        """images (B, C, H, W) -> z (B, D) and each block's K/V input (B, N+1, D); memory: the
        protected memory (D, m) of each block, which the LoRA layers project with (or None)."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, D, H/p, W/p) -> (B, N, D)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed  # (B, N+1, D)
        kv_inputs = []
        for i, blk in enumerate(self.blocks):
            x, h = blk(x, None if memory is None else memory[i])
            kv_inputs.append(h)
        return self.norm(x[:, 0]), kv_inputs  # LayerNorm is per token: the class token's suffices

    def forward(self, images):  # (B, C, H, W) -> z (B, D)
        return self.encode(images)[0]

    def lora_layers(self):
        return [(i, n, getattr(b.attn, n)) for i, b in enumerate(self.blocks) for n in ('k', 'v')]

    def lora_parameters(self):
        return [p for _, _, layer in self.lora_layers() for p in (layer.A, layer.B)]


# Presets, all depth 12 with MLP ratio 4; keywords override (img_size, patch_size, lora_rank, ...).
vit_base_patch16 = functools.partial(VisionTransformer, embed_dim=768, depth=12, num_heads=12)
vit_small_patch16 = functools.partial(VisionTransformer, embed_dim=384, depth=12, num_heads=6)
vit_tiny_patch16 = functools.partial(VisionTransformer, embed_dim=192, depth=12, num_heads=3)
PRESETS = {'vit_base': vit_base_patch16, 'vit_small': vit_small_patch16,
           'vit_tiny': vit_tiny_patch16}

# ---- Checkpoint loading. Per key layout, the checkpoint key of a model key: substitutions in order
_ATT = 'MultiHeadDotProductAttention_1/'
_RENAMES = {
    'npz': [(r'^cls_token$', 'cls'), (r'^pos_embed$', 'Transformer/posembed_input/pos_embedding'),
            (r'^patch_embed\.', 'embedding.'), (r'^norm\.', 'Transformer/encoder_norm.'),
            (r'^blocks\.(\d+)\.', r'Transformer/encoderblock_\1/'), (r'norm1', 'LayerNorm_0'),
            (r'norm2', 'LayerNorm_2'), (r'mlp\.fc1', 'MlpBlock_3/Dense_0'),
            (r'mlp\.fc2', 'MlpBlock_3/Dense_1'),
            (r'attn\.q\.', _ATT + 'query.'), (r'attn\.k\.', _ATT + 'key.'),
            (r'attn\.v\.', _ATT + 'value.'), (r'attn\.proj\.', _ATT + 'out.'),
            # a LayerNorm weight is 'scale', a conv or dense weight 'kernel'
            (r'(norm|LayerNorm_\d)\.weight$', r'\1/scale'), (r'\.weight$', '/kernel'),
            (r'\.bias$', '/bias')],
    'timm': [(r'^patch_embed\.', 'patch_embed.proj.'), (r'attn\.[qkv]\.', 'attn.qkv.')],
    'torchvision': [(r'^cls_token$', 'class_token'), (r'^pos_embed$', 'encoder.pos_embedding'),
                    (r'^patch_embed\.', 'conv_proj.'), (r'^norm\.', 'encoder.ln.'),
                    (r'^blocks\.(\d+)\.', r'encoder.layers.encoder_layer_\1.'), (r'norm1', 'ln_1'),
                    (r'norm2', 'ln_2'), (r'attn\.[qkv]\.', 'self_attention.in_proj_'),
                    (r'attn\.proj', 'self_attention.out_proj'), (r'fc1', '0'), (r'fc2', '3')]}
# From the checkpoint's tensor layout to ours, by model key (first match); others taken as they are.
_FUSED = [(rf'attn\.{n}\.', lambda t, j=j: t.chunk(3)[j]) for j, n in enumerate('qkv')]  # q; k; v
_TRANSFORMS = {
    'npz': [(r'patch_embed\.weight', lambda t: t.movedim((-1, -2), (0, 1))),  # HWIO -> (D, C, p, p)
            # q/k/v kernel (D, heads, D/heads) or a dense kernel (in, out) -> (out, in)
            (r'attn\.[qkv]\.weight|mlp\.fc\d\.weight', lambda t: t.reshape(t.shape[0], -1).T),
            (r'attn\.[qkv]\.bias', torch.flatten),  # (heads, D/heads) -> (D,)
            (r'attn\.proj\.weight', lambda t: t.reshape(-1, t.shape[-1]).T)],  # (heads, D/h, D)
    'timm': _FUSED, 'torchvision': _FUSED}
# Dropped checkpoint keys: the classifier. Not fc_norm: a checkpoint with one was trained on pooled
# tokens and has no final `norm` for our class-token feature, so it must fail loudly.
_IGNORED = {'npz': ('head/', 'pre_logits/'), 'timm': ('head.', 'pre_logits.'),
            'torchvision': ('heads.',)}
_ST_DTYPES = {'F64': torch.float64, 'F32': torch.float32, 'F16': torch.float16,
              'BF16': torch.bfloat16, 'I64': torch.int64, 'I32': torch.int32, 'I16': torch.int16,
              'I8': torch.int8, 'U8': torch.uint8, 'BOOL': torch.bool}  # all: a stray one is named


def _their_key(layout, key):
    for pattern, replacement in _RENAMES[layout]:
        key = re.sub(pattern, replacement, key)
    return key


def _read_safetensors(path):
    """u64 little-endian header size, a JSON header, then the raw tensor bytes."""
    with open(path, 'rb') as f:
        buf = bytearray(f.read())  # writable, as torch.frombuffer wants
    n = int.from_bytes(buf[:8], 'little')
    header = {k: v for k, v in json.loads(buf[8:8 + n]).items() if k != '__metadata__'}
    for k, v in header.items():
        if v['dtype'] not in _ST_DTYPES:
            raise CheckpointError(f'{path}: tensor {k} has the safetensors dtype {v["dtype"]}, '
                                  f'not one read here ({", ".join(_ST_DTYPES)}); convert it.')
    # frombuffer raises ValueError when a tensor runs past the end of a truncated file
    return {k: torch.frombuffer(buf, dtype=_ST_DTYPES[v['dtype']], count=math.prod(v['shape']),
                                offset=8 + n + v['data_offsets'][0]).reshape(v['shape'])
            for k, v in header.items()}


def _read(path):
    """{key: tensor} and the container ('npz', 'safetensors', 'torch'), told apart by content."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint file at {path}; pass 'in21k', 'sam', 'dino', "
                              "'torchvision', 'none' or an existing .npz/.pth/.bin/.safetensors.")
    try:
        with open(path, 'rb') as f:
            head = f.read(9)
        if zipfile.is_zipfile(path):
            with np.load(path, allow_pickle=False) as z:  # .npy members only, unlike torch.save's
                if all(name.endswith('.npy') for name in z.zip.namelist()):
                    return {k: torch.from_numpy(z[k]) for k in z.files}, 'npz'
        if head[8:9] == b'{':
            return _read_safetensors(path), 'safetensors'
        if head[:2] != b'PK' and head[:1] != b'\x80':  # torch.save's zip, or its legacy pickle
            raise CheckpointError(f'{path} is not a checkpoint: neither a zip (torch.save), a '
                                  'pickle, an .npz nor a .safetensors file; pass a ViT checkpoint '
                                  'with --weights PATH.')
        sd = torch.load(path, map_location='cpu', weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- torch's unpickler fails on junk with a dozen types
        if 'Unsupported global' in str(e):  # torch.save(model): a pickled module, not tensors
            raise CheckpointError(f'{path} holds a pickled model object, not a state dict: save '
                                  'torch.save(model.state_dict(), PATH) and pass that file.') from e
        why = re.split(r'\.\s|\n', str(e))[0]  # the first sentence: torch's messages run on
        raise CheckpointError(f'cannot read {path}: it is truncated, corrupt or not a checkpoint '
                              f'({type(e).__name__}: {why}); download it again or pass another '
                              'file with --weights PATH.') from e
    for wrapper in ('model', 'state_dict'):  # training scripts save {'model': state_dict, ...}
        if isinstance(sd, dict) and isinstance(sd.get(wrapper), dict):
            sd = sd[wrapper]
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        raise CheckpointError(f'{path} holds no state dict of tensors; pass a ViT checkpoint file.')
    return sd, 'torch'


def _download(model, source):
    """The hub-cache path of a named checkpoint, downloaded (with a progress bar) if not there."""
    widths = URLS['in21k'] if source == 'in21k' else (768,)  # sam, dino, torchvision: B/16 only
    if model.patch_size != 16 or model.embed_dim not in widths:
        raise CheckpointError(f"there are no '{source}' weights for a ViT with width "
                              f'{model.embed_dim} and patch {model.patch_size}; use a matching '
                              'preset or pass a file with --weights PATH.')
    url = URLS['in21k'][model.embed_dim] if source == 'in21k' else URLS[source]
    path = os.path.join(torch.hub.get_dir(), 'checkpoints', os.path.basename(url))
    if not os.path.isfile(path):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.hub.download_url_to_file(url, path, progress=True)
        except OSError as e:  # urllib's URLError and HTTPError are OSErrors
            raise CheckpointError(f'cannot download {url} ({e}); put that file at {path} by '
                                  'hand, pass a local checkpoint with --weights PATH, or try the '
                                  'program on random weights with --weights none.') from e
    return path


def _resize_pos_embed(pos, grid):
    """(1, 1+g*g, D) -> (1, 1+grid*grid, D), bicubic on the token grid; the class token's kept."""
    g = math.isqrt(pos.shape[1] - 1)
    if g * g != pos.shape[1] - 1:  # no square grid: left to the shape check to report
        return pos, None
    tok = pos[:, 1:].float().reshape(1, g, g, -1).permute(0, 3, 1, 2)  # (1, D, g, g)
    # antialias (as timm does): a shrunken grid, e.g. 14x14 -> 2x2 at 32 px, does not alias
    tok = F.interpolate(tok, size=(grid, grid), mode='bicubic', align_corners=False, antialias=True)
    tok = tok.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(pos.dtype)
    return torch.cat([pos[:, :1], tok], 1), f'{g}x{g} -> {grid}x{grid}'


def load_pretrained(model, source='in21k', verbose=True):
    """Fill every pretrained tensor of `model` from `source`, strictly (A and B left alone).
    Returns: source, path, container, format (key layout), loaded, ignored, resized."""
    report = dict(source=str(source), path=None, container=None, format=None, loaded=0,
                  ignored=[], resized=None)
    if source == 'none':
        if verbose:
            print("[vit] source 'none': the backbone keeps its random initialisation")
        return report
    path = _download(model, source) if source in URLS else os.fspath(source)
    sd, report['container'] = _read(path)
    layout = next((name for name in _RENAMES if _their_key(name, 'patch_embed.weight') in sd), None)
    if layout is None:
        raise CheckpointError(f'{path} is in no known ViT key layout (Google npz, timm, '
                              f'torchvision); its keys begin {", ".join(list(sd)[:4])}.')
    if layout == 'torchvision':  # the released file predates torchvision's MLP renaming (PR 6053)
        sd = {k.replace('mlp.linear_1.', 'mlp.0.').replace('mlp.linear_2.', 'mlp.3.'): v
              for k, v in sd.items()}
    target, ready = _fit(model, sd, layout, path, report)
    with torch.no_grad():  # state_dict() values are detached views of the parameters
        for ours, t in ready.items():
            target[ours].copy_(t)
    report.update(path=path, format=layout, loaded=len(ready))
    if verbose:
        resized = f', position embedding resized (bicubic) {report["resized"]}'
        print(f'[vit] {path}: {report["container"]} file, {layout} key layout, {len(ready)} '
              f'tensors loaded{resized if report["resized"] else ""}')
        print(f'[vit] ignored checkpoint keys: {", ".join(report["ignored"]) or "none"}')
    return report


def _fit(model, sd, layout, path, report):
    """(the model's pretrained tensors, {model key: checkpoint tensor in our layout}): every model
    tensor filled with its exact shape, every checkpoint key used or ignored, every value finite,
    or a CheckpointError that names the keys."""
    target = {k: v for k, v in model.state_dict().items() if k.rsplit('.', 1)[-1] not in ('A', 'B')}
    theirs = {k: _their_key(layout, k) for k in target}  # model key -> checkpoint key
    report['ignored'] = sorted(k for k in sd if k.startswith(_IGNORED[layout]))
    misfit = 'shape mismatches, checkpoint vs model'
    problems = {'missing keys': list(dict.fromkeys(k for k in theirs.values() if k not in sd)),
                'unexpected keys': sorted(set(sd) - set(theirs.values()) - set(report['ignored'])),
                misfit: []}
    ready = {}
    for ours, key in ((o, k) for o, k in theirs.items() if k in sd):
        fn = next((f for pattern, f in _TRANSFORMS[layout] if re.search(pattern, ours)), None)
        t, want = fn(sd[key]) if fn else sd[key], target[ours].shape
        if ours == 'pos_embed' and t.shape != want and t.dim() == 3 and t.shape[-1] == want[-1]:
            t, report['resized'] = _resize_pos_embed(t, model.grid)
        if t.shape != want:
            problems[misfit].append(f'{key} {tuple(sd[key].shape)} vs {ours} {tuple(want)}')
        ready[ours] = t
    problems = [f'{what} ({len(keys)}): {", ".join(keys[:4])}' for what, keys in problems.items()
                if keys]
    if problems:
        raise CheckpointError(f'{path} ({layout} layout) does not fit this ViT (width '
                              f'{model.embed_dim}, {len(model.blocks)} blocks): '
                              f'{"; ".join(problems)}; pick the preset that matches the checkpoint '
                              'or pass another file with --weights PATH.')
    bad = [theirs[k] for k, t in ready.items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:
        raise CheckpointError(f'{path}: {len(bad)} tensor(s) hold NaN or inf values '
                              f'({", ".join(bad[:4])}): the file is damaged; download it again or '
                              'pass another file with --weights PATH.')
    return target, ready
