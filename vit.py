"""A from-scratch ViT (B/16; S/16, Ti/16 for CPU) with LoRA on K and V, and strict loading of the
public checkpoints (URLS: Google npz, timm-style and torchvision state dicts, safetensors).
References: Janus-LoRA (C. Chen et al., ICML 2026); ViT (Dosovitskiy et al., ICLR 2021); LoRA (Hu et
al., ICLR 2022); AugReg (Steiner et al., TMLR 2022); SAM-trained ViT (Chen et al., ICLR 2022); DINO
(Caron et al., ICCV 2021)."""
import functools
import json
import math
import os
import re
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_AUGREG = 'https://storage.googleapis.com/vit_models/augreg/'  # big_vision's "howto-i21k-*" files
URLS = {'in21k': {768: _AUGREG + 'B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0.npz',
                  384: _AUGREG + 'S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0.npz',
                  192: _AUGREG + 'Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0.npz'},
        'sam': 'https://storage.googleapis.com/vit_models/sam/ViT-B_16.npz',
        'dino': 'https://dl.fbaipublicfiles.com/dino/dino_vitbase16_pretrain/'
                'dino_vitbase16_pretrain.pth',
        'torchvision': 'https://download.pytorch.org/models/vit_b_16-c867db91.pth'}
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
        # Janus-LoRA Theorem 3.1, Eq. (3), by autograd. A = A_out + A_in, A_in = A M M^T constant:
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
        """Fold scale * B @ A into the frozen weight, then a fresh pair (same Parameters) off M."""
        self.weight += self.scale * (self.B @ self.A).to(self.weight.dtype)
        self.reset_lora_(memory)

class Block(nn.Module):
    """Pre-norm attention, LoRA on K and V (not on Q nor the output projection), then the MLP."""
    def __init__(self, dim, num_heads, rank, scale):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)  # eps of the Google checkpoints
        self.attn = nn.ModuleDict(dict(q=nn.Linear(dim, dim), proj=nn.Linear(dim, dim),
                                       k=LoRALinear(dim, dim, rank, scale),
                                       v=LoRALinear(dim, dim, rank, scale)))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(dim, 4 * dim), act=nn.GELU(),
                                             fc2=nn.Linear(4 * dim, dim)))  # erf GELU, as trained

    def forward(self, x, memory=None):  # x (B, N+1, D) -> (x, h); h = norm1(x), K's and V's input
        h = self.norm1(x)  # float32 even under autocast
        if torch.is_autocast_enabled(x.device.type):  # one bf16 copy for q, k, v and OE
            h = h.to(torch.get_autocast_dtype(x.device.type))
        b, n, d = h.shape  # K and V share their input h, so their memory (D, m)
        q, k, v = (t.view(b, n, self.num_heads, -1).transpose(1, 2)  # (B, heads, N, D/heads)
                   for t in (self.attn.q(h), self.attn.k(h, memory), self.attn.v(h, memory)))
        y = F.scaled_dot_product_attention(q, k, v)  # (B, heads, N, D/heads)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x)), h

class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                 lora_rank=10, lora_scale=1.0):
        super().__init__()
        self.embed_dim, self.patch_size = embed_dim, patch_size
        self.grid = img_size // patch_size  # patches per side
        self.patch_embed = nn.Conv2d(3, embed_dim, patch_size, stride=patch_size)  # RGB
        # (1, 1, D) and (1, 1+N, D), trunc-normal std 0.02 as in ViT; the checkpoints overwrite them
        self.cls_token = nn.Parameter(nn.init.trunc_normal_(torch.empty(1, 1, embed_dim), std=0.02))
        self.pos_embed = nn.Parameter(nn.init.trunc_normal_(torch.empty(1, 1 + self.grid**2,
                                                                        embed_dim), std=0.02))
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, lora_rank, lora_scale)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        for name, p in self.named_parameters():  # only the LoRA factors train
            p.requires_grad_(name.endswith(('.A', '.B')))

    def encode(self, images, memory=None):
        """images (B, 3, H, W), each block's memory (D, m) or None -> z (B, D), K/V inputs."""
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

# Presets: 12 blocks, 64-wide heads; keywords override (img_size, patch_size, lora_rank, depth...)
PRESETS = {name: functools.partial(VisionTransformer, embed_dim=width, num_heads=width // 64)
           for name, width in [('vit_base', 768), ('vit_small', 384), ('vit_tiny', 192)]}
vit_base_patch16, vit_small_patch16, vit_tiny_patch16 = PRESETS.values()

# ---- Checkpoint loading, as tables per key layout: a model key's checkpoint key (substitutions in
# order); the tensor layout to ours (first match by model key); the keys dropped, the classifier's.
# Not fc_norm: trained on pooled tokens, it has no `norm` for our class token, so it must fail.
_RENAMES = {
    'npz': [(r'^cls_token$', 'cls'), (r'^pos_embed$', 'Transformer/posembed_input/pos_embedding'),
            (r'^patch_embed\.', 'embedding.'), (r'^norm\.', 'Transformer/encoder_norm.'),
            (r'^blocks\.(\d+)\.', r'Transformer/encoderblock_\1/'), (r'norm1', 'LayerNorm_0'),
            (r'norm2', 'LayerNorm_2'), (r'mlp\.fc1', 'MlpBlock_3/Dense_0'),
            (r'mlp\.fc2', 'MlpBlock_3/Dense_1'), (r'attn\.', 'MultiHeadDotProductAttention_1/'),
            (r'/q\.', '/query.'), (r'/k\.', '/key.'), (r'/v\.', '/value.'), (r'/proj\.', '/out.'),
            (r'(norm|LayerNorm_\d)\.weight$', r'\1/scale'),  # a LayerNorm weight is 'scale',
            (r'\.weight$', '/kernel'), (r'\.bias$', '/bias')],  # a conv or dense weight 'kernel'
    'timm': [(r'^patch_embed\.', 'patch_embed.proj.'), (r'attn\.[qkv]\.', 'attn.qkv.')],
    'torchvision': [(r'^cls_token$', 'class_token'), (r'^pos_embed$', 'encoder.pos_embedding'),
                    (r'^patch_embed\.', 'conv_proj.'), (r'^norm\.', 'encoder.ln.'),
                    (r'^blocks\.(\d+)\.', r'encoder.layers.encoder_layer_\1.'), (r'norm1', 'ln_1'),
                    (r'norm2', 'ln_2'), (r'attn\.[qkv]\.', 'self_attention.in_proj_'),
                    (r'attn\.proj', 'self_attention.out_proj'), (r'fc1', '0'), (r'fc2', '3')]}
_FUSED = [(rf'attn\.{n}\.', lambda t, j=j: t.chunk(3)[j]) for j, n in enumerate('qkv')]  # q; k; v
_TRANSFORMS = {
    'npz': [(r'patch_embed\.weight', lambda t: t.movedim((-1, -2), (0, 1))),  # HWIO -> (D, C, p, p)
            # q/k/v kernel (D, heads, D/heads) or a dense kernel (in, out) -> (out, in)
            (r'attn\.[qkv]\.weight|mlp\.fc\d\.weight', lambda t: t.reshape(t.shape[0], -1).T),
            (r'attn\.[qkv]\.bias', torch.flatten),  # (heads, D/heads) -> (D,)
            (r'attn\.proj\.weight', lambda t: t.reshape(-1, t.shape[-1]).T)],  # (heads, D/h, D)
    'timm': _FUSED, 'torchvision': _FUSED}
_IGNORED = r'^(head|pre_logits)[./]|^heads\.'  # the classifier: npz head/, timm head., tv heads.
_ST_DTYPES = {'F64': torch.float64, 'F32': torch.float32, 'F16': torch.float16,  # I64: a stray
              'BF16': torch.bfloat16, 'I64': torch.int64}  # buffer (position ids) is read, named
_ELSE = 'pass another file with --weights PATH.'

def load_pretrained(model, source='in21k'):
    """Fill every pretrained tensor of `model` (all but A, B) from `source`, a name in URLS, 'none'
    or a file, strictly (see _fit); print one line of what was loaded; return the file's path."""
    if source == 'none':
        return print("[vit] source 'none': the backbone keeps its random initialisation")
    path = _download(model, source) if source in URLS else os.fspath(source)
    sd, container = _read(path)
    # torchvision's released file predates its MLP renaming (PR 6053); no other layout has these
    sd = {k.replace('mlp.linear_1.', 'mlp.0.').replace('mlp.linear_2.', 'mlp.3.'): v
          for k, v in sd.items()}
    ready, note = _fit(model, sd, path)
    model.load_state_dict(ready, strict=False)  # not strict: A and B keep theirs
    print(f'[vit] {path}: {container} file, {note}')
    return path

def _fit(model, sd, path):
    """({model key: checkpoint tensor in our layout}, a log note), in the key layout that names the
    most model tensors: each filled at its exact shape, each checkpoint key used or ignored, each
    value finite; or a CheckpointError naming the keys."""
    want = {k: v.shape for k, v in model.state_dict().items() if not k.endswith(('.A', '.B'))}
    names = {layout: {k: functools.reduce(lambda key, rule: re.sub(*rule, key), rules, k)
                      for k in want} for layout, rules in _RENAMES.items()}  # ours -> theirs
    layout = max(names, key=lambda name: sum(key in sd for key in names[name].values()))
    theirs = names[layout]
    ready, resized, misfit = {}, '', []
    for ours, key in ((o, k) for o, k in theirs.items() if k in sd):
        fn = next((f for pattern, f in _TRANSFORMS[layout] if re.search(pattern, ours)), None)
        t = fn(sd[key]) if fn else sd[key]
        if ours == 'pos_embed' and t.shape != want[ours]:  # trained at another resolution
            t, resized = _resize_pos_embed(t, model.grid)
        if t.shape != want[ours]:
            misfit.append(f'{key} {tuple(sd[key].shape)} vs {ours} {tuple(want[ours])}')
        ready[ours] = t
    ignored = sorted(k for k in sd if re.match(_IGNORED, k))
    problems = {'missing keys': [k for k in dict.fromkeys(theirs.values()) if k not in sd],
                'unexpected keys': sorted(set(sd) - set(theirs.values()) - set(ignored)),
                'shape mismatches, checkpoint vs model': misfit}
    problems = ''.join(f'{what} ({len(found)}): {", ".join(found[:4])}; '
                       for what, found in problems.items() if found)
    if problems:
        raise CheckpointError(f'{path} ({layout} layout) does not fit this ViT (width '
                              f'{model.embed_dim}, {len(model.blocks)} blocks): {problems}' + _ELSE)
    bad = ', '.join(theirs[k] for k, t in ready.items() if not t.isfinite().all())
    if bad:
        raise CheckpointError(f'{path} has NaN or inf values ({bad}); download it anew or ' + _ELSE)
    return ready, (f'{layout} key layout, {len(ready)} tensors loaded{resized}, ignored checkpoint '
                   f'keys: {", ".join(ignored) or "none"}')

def _resize_pos_embed(pos, grid):
    """(1, 1+g*g, D) -> (1, 1+grid*grid, D), bicubic on the token grid; the class token's kept."""
    g = math.isqrt(pos.shape[1] - 1)
    if g * g != pos.shape[1] - 1:  # no square grid: left to the shape check to report
        return pos, ''
    tok = pos[:, 1:].float().reshape(1, g, g, -1).permute(0, 3, 1, 2)  # (1, D, g, g)
    # antialias (as timm does): a shrunken grid, e.g. 14x14 -> 2x2 at 32 px, does not alias
    tok = F.interpolate(tok, size=(grid, grid), mode='bicubic', antialias=True)
    tok = tok.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(pos.dtype)
    return torch.cat([pos[:, :1], tok], 1), f', position embedding resized {g}x{g} -> {grid}x{grid}'

def _read(path):
    """{key: tensor} and the container ('npz', 'safetensors', 'torch'), told apart by content."""
    try:
        with open(path, 'rb') as f:
            head = f.read(9)
        if head[8:9] == b'{':  # after the u64 size of its JSON header
            return _read_safetensors(path), 'safetensors'
        if head[:2] == b'PK':  # a zip: an .npz holds .npy members only, unlike torch.save's
            with np.load(path) as z:
                if all(name.endswith('.npy') for name in z.zip.namelist()):
                    return {k: torch.from_numpy(z[k]) for k in z.files}, 'npz'
        elif head[:1] != b'\x80':  # nor torch.save's legacy pickle
            raise CheckpointError(f'{path} is not a checkpoint: neither a zip (torch.save), a '
                                  'pickle, an .npz nor a .safetensors file; ' + _ELSE)
        sd = torch.load(path, map_location='cpu', weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- torch's unpickler fails on junk with a dozen types
        why = re.split(r'\.\s|\n', str(e))[0]  # the first sentence: torch's messages run on
        why = 'a pickled model object, not a state dict' if 'Unsupported global' in str(e) else why
        raise CheckpointError(f'cannot read {path}: absent, truncated or corrupt '
                              f'({type(e).__name__}: {why}); download it again or ' + _ELSE) from e
    # unwrapped from training scripts' {'model': state_dict, ...}; what is no dict fits no layout
    return sd.get('model', sd.get('state_dict', sd)) if isinstance(sd, dict) else {}, 'torch'

def _read_safetensors(path):
    """{key: tensor}: a u64 little-endian header size, a JSON header, then the raw tensor bytes."""
    with open(path, 'rb') as f:
        buf = bytearray(f.read())  # writable, as torch.frombuffer wants
    n = int.from_bytes(buf[:8], 'little')
    header = {k: v for k, v in json.loads(buf[8:8 + n]).items() if k != '__metadata__'}
    unread = ', '.join(sorted({v['dtype'] for v in header.values()} - set(_ST_DTYPES)))
    if unread:
        raise CheckpointError(f'{path} holds the safetensors dtype {unread}; convert it to F32.')
    # frombuffer raises ValueError when a tensor runs past the end of a truncated file
    return {k: torch.frombuffer(buf, dtype=_ST_DTYPES[v['dtype']], count=math.prod(v['shape']),
                                offset=8 + n + v['data_offsets'][0]).reshape(v['shape'])
            for k, v in header.items()}

def _download(model, source):
    """The hub-cache path of a named checkpoint, downloaded (with a progress bar) if not there."""
    url = (URLS[source] if source == 'in21k' else {768: URLS[source]}).get(model.embed_dim)
    if url is None or model.patch_size != 16:  # in21k in three widths, the others B/16 only
        raise CheckpointError(f"no '{source}' weights for a ViT of width {model.embed_dim}, "
                              f'patch {model.patch_size}; use a matching preset or ' + _ELSE)
    path = os.path.join(torch.hub.get_dir(), 'checkpoints', os.path.basename(url))
    if not os.path.isfile(path):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.hub.download_url_to_file(url, path)
        except OSError as e:  # urllib's URLError and HTTPError are OSErrors
            raise CheckpointError(f'cannot download {url} ({e}); put it at {path} by hand, or '
                                  'pass --weights PATH, or --weights none for random ones.') from e
    return path
