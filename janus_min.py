"""Janus-LoRA, minimal: class-incremental learning with a frozen ViT and LoRA on K and V, kept
stable by Online Estimation (OE) and Gradient Rectification (GR), plastic by the Decoupled Margin
Loss (DML).

Read it top-down beside the paper: (1) the method, from train_step, one training step, to what it
calls; (2) our variant of GR and the baselines; (3) the protocol, from a learner's start to a
task's metrics and the paper's analyses; (4) the program around them. Parts 1-3 use nothing
defined in part 4. Equations are numbered as in the paper's LaTeX source.

One run calls, in order: main -> run -> run_seed, which for each task calls start_task,
train_task (a loop of train_step), end_task, evaluate, record_analyses and run's after_task, a
checkpoint. To read the method, go straight to train_step, the first function of part 1.

Where the code reads the paper differently, or fills a silence (the README says why):
- M, not V: the safe gradient projects with M, the finished tasks' OE bases (the basis memory of
  the paper's Fig. 1), one a block for K and V; a task's V (k columns) joins M at its end until M
  fills the width, after D / k tasks (16 for ViT-B at k = 50), when K and V stop learning
  (protected, end_task, OnlineSubspace.merge). --memory oe-rolling projects with V, as the
  paper's words read.
- G is dL/dW of Eq. (12)'s total loss, as Sec. 3 says; the appendix says the task's (train_step).
- OE's samples are all the batch's tokens, taken off M: X_p = X (I - M M^T); its step comes after
  Adam's, on the K/V inputs of the forward pass before it (OnlineSubspace.update, train_step).
- OE's step, Eq. (9), is preconditioned by S^-1, S = V^T X_p^T X_p V, and eta decays as
  5 / (5 + t) within a task; Eq. (10)'s R has a positive diagonal (OnlineSubspace.update, qr_q).
- GR's ridge delta is relative to the mean eigenvalue of B^T B, or of A A^T (ridge).
- Eq. (4) as printed has the wrong shapes and no s: the chain rule gives s B^T G and s G A^T,
  and GR's Eqs. (6)-(7) take them without s (rectify_gradients_).
- DML's current prototypes are the batch's unit class means, in the graph; its hinge is averaged
  over the batch and the old prototypes: each finished class's unit mean of the unit features of
  its training images, under the test transform (dml_loss, end_task, class_prototypes).
- LoRA's life: s = 1; each task a fresh pair, A off M and B = 0, merged into W0 at the task's end
  (LoRALinear.reset_, LoRALinear.merge_).
- Under bf16 autocast A's split off M and OE's products stay in float32, GR and the small systems
  run in float64 (LoRALinear.forward, rectify_factors, OnlineSubspace.update).
- Ours beside the paper's: GR on Adam's step, --rectify update (rectified_adam_step_); the
  task-aware accuracy (evaluate); Fig. 2's violation relative, ||dW M|| / ||dW|| (violation).
- The protocol is the InfLoRA codebase's: inputs in [0, 1] (Config.input_range), classes in
  natural order (data.task_classes), a fresh Adam and lr schedule each task (adam, lr_factor),
  GPM's thresholds (end_task, gpm_extend).

References: C. Chen et al., "JANUS-LoRA: A Balanced Low-Rank Adaptation for Continual Learning",
ICML 2026. The protocol is that of the InfLoRA codebase (Liang & Li, CVPR 2024), on which the paper
ran; GPM: Saha et al., ICLR 2021.
"""
import signal
import sys
# Seconds of imports, the standard library's first: a Ctrl-C in any of them, or a Python
# without torch, ends in one line.
try:
    import argparse
    import collections
    import contextlib
    import copy
    import hashlib
    import importlib.metadata
    import json
    import math
    import os
    import re
    import shlex
    import socket
    import statistics
    import subprocess
    import time
    from dataclasses import asdict
    from dataclasses import dataclass
    from dataclasses import field
    from dataclasses import fields
    from dataclasses import replace
    from functools import partial
    try:
        import fcntl  # POSIX's file locks (Linux, macOS): a live run's folder is held
    except ImportError:  # Windows: runs without the lock (README)
        fcntl = None

    import torch
    import torch.nn.functional as F
    from torch import nn
    try:  # first of the modules that import torchvision: one built for another torch fails
        import torchvision
    except RuntimeError as e:  # e.g. "operator torchvision::nms does not exist"
        sys.exit(f"error: torchvision {importlib.metadata.version('torchvision')} does not fit "
                 f"torch {torch.__version__} ({e}): install the two together: pip uninstall -y "
                 "torch torchvision && pip install -r requirements.txt")

    import data
    import vit
except KeyboardInterrupt:
    print("\ninterrupted (SIGINT) while starting: nothing was saved", file=sys.stderr)
    sys.exit(128 + signal.SIGINT)
except ModuleNotFoundError as e:  # a Python outside the project's environment (README)
    sys.exit(f"error: {e} in {sys.executable}: activate the project's environment (. "
             ".venv/bin/activate), or install the packages: pip install -r requirements.txt")


def _opt(default, help, **argparse_kw):
    """A configuration field: its default and its --help line (its meaning and source)."""
    return field(default=default, metadata=dict(help=help, **argparse_kw))


@dataclass
class Config:
    """The hyperparameters, each a flag of `python janus_min.py --help`. None: the data set's.
    Without --method, the defaults run the paper's method, Janus-LoRA."""
    # Data and protocol: the paper's Sec. 4.1, and the InfLoRA codebase, which the paper ran on.
    dataset: str = _opt("cifar100", "data set (Sec. 4.1)", choices=list(data.DATASETS))
    data_dir: str = _opt("data", "folder that holds (or receives) the data set")
    tasks: int = _opt(None, "tasks T (default: CIFAR-100 10, as the paper's)")
    epochs: int = _opt(None, "epochs per task (default: CIFAR-100 20, ImageNet-R 50, synthetic 5)")
    batch_size: int = _opt(None, "batch size (default: 128, Sec. 4.1; synthetic 16)")
    img_size: int = _opt(None, "input resolution (default: 224, the paper's; synthetic 64)")
    limit_per_class: int = _opt(None, "keep at most this many training images per class (ours)")
    input_range: str = _opt("unit", "the pixels' range: unit: [0, 1], as InfLoRA's code; half: "
                            "[-1, 1], as Google's checkpoints were trained; imagenet: ImageNet's "
                            "mean and std, as DINO's; checkpoint: the one of --weights",
                            choices=["unit", "checkpoint", "half", "imagenet"])
    # The backbone and its LoRA pairs (Sec. 3.1 and 4.1).
    model: str = _opt("vit_base", "backbone (the paper's: ViT-B/16)", choices=list(vit.PRESETS))
    weights: str = _opt("in21k", "in21k (the paper's), sam, dino (Table 4), none, or a file")
    patch_size: int = _opt(16, "patch size (the paper's: 16; another needs --weights none)")
    rank: int = _opt(10, "LoRA rank r on K and V (Sec. 4.1)")
    lora_scale: float = _opt(1.0, "LoRA scale s of Eq. (1) (ours: the paper does not give it)")
    # The method (Sec. 3 and 4.1), and our readings where the paper is silent (README).
    method: str = _opt(None, "a method of the paper's tables: its flags, put before yours")
    lr: float = _opt(5e-4, "Adam's learning rate (the InfLoRA codebase's; the paper gives none)")
    schedule: str = _opt("inflora", "lr per epoch: InfLoRA's quarter cosine, or a half cosine",
                         choices=["inflora", "cosine"])
    k: int = _opt(50, "rank k of each block's OE basis V (Sec. 4.1); M grows by k a task (ours)")
    oe_lr: float = _opt(1.0, "OE's step eta at a task's start; 1: one of subspace iteration (ours)")
    oe_decay_steps: int = _opt(5, "OE's step halves after this many, then decays as 1/t (ours)")
    delta: float = _opt(1e-4, "GR's ridge delta, relative to the mean eigenvalue (ours)")
    margin: float = _opt(0.3, "DML's margin m (Sec. 4.1)")
    lambda_dml: float = _opt(1.0, "DML's weight lambda in Eq. (12) (Sec. 4.1)")
    tau: float = _opt(0.07, "DML's temperature tau (Sec. 4.1)")
    oe: bool = _opt(True, "Online Estimation and the safe gradient (Table 1's ablation)")
    gr: bool = _opt(True, "Gradient Rectification (Table 1's ablation)")
    dml: bool = _opt(True, "the Decoupled Margin Loss (Table 1's ablation)")
    rectify: str = _opt("grad", "GR on the gradients Adam takes (the paper's) or on Adam's step "
                        "(ours)", choices=["grad", "update"])
    memory: str = _opt("oe", "memory M: each task's OE basis joins it (ours), V itself (the "
                       "paper's words), or GPM's", choices=["oe", "oe-rolling", "gpm"])
    gpm_threshold: list = _opt(None, "GPM's energy share at task 1 and at the end (InfLoRA's: "
                               "0.95 1, ImageNet-R 0.98 1)", nargs=2, type=float)
    lora_a: str = _opt("trained", "each task's A: trained (the paper's), or off M and frozen "
                       "(InfLoRA)", choices=["trained", "inflora"])
    # The run.
    seeds: list = _opt((0,), "seeds; several give mean +- std (the paper: 5)", nargs="+", type=int,
                       action="extend")
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    precision: str = _opt("bf16", "CUDA's: bf16 autocast (ours) or fp32 (InfLoRA's); CPU: fp32",
                          choices=["bf16", "fp32"])
    compile: str = _opt("auto", "the ViT's blocks compiled by torch.compile (ours); auto: on "
                        "for CUDA, off on a CPU (README: Speed)", choices=["auto", "on", "off"],
                        nargs="?", const="on")
    workers: int = _opt(None, "loader processes of the file-based data sets (default, and most: "
                        "the cores)")
    out: str = _opt(None, "output folder (default: runs/<dataset>-<time>)")
    resume: str = _opt(None, "continue the run in this folder after its last finished task")
    # The other modes.
    benchmark: bool = _opt(False, "time plain LoRA and Janus-LoRA steps, then exit",
                           action="store_true")
    steps: int = _opt(20, "--benchmark: timed rounds (after 5 warm-up steps)")
    reproduce: str = _opt(None, "run each row of a table or figure of the paper, then table.md")
    row: str = _opt(None, "with --reproduce: run this row alone (one job of an array)")
    dry_run: bool = _opt(False, "with --reproduce: print the rows' commands", action="store_true")


# ==== 1. The method (Sec. 3) ======================================================================
@dataclass
class Learner:
    """What the method carries from one task to the next. Under --memory oe each block's M is fixed
    during a task, k columns more each task (at most D); V trains off it and joins it at the end."""
    model: nn.Module  # the frozen ViT; its K and V layers are LoRALinear, merged at each task's end
    heads: nn.ModuleList  # one linear head per task so far; the last is the current task's
    oe: "OnlineSubspace"  # OE's basis V of each block for the current task; None without OE
    memory: list  # each block's memory M (D, m): the finished tasks' OE (or GPM's) bases
    prototypes: torch.Tensor  # (old classes, D), unit rows: DML's old prototypes, C_past


def train_step(learner, opt, images, y, cfg):
    """One step of "The Integrated Janus-LoRA Update Process" (Sec. 3): the loss, the safe gradient,
    GR and Adam, then OE. images (B, 3, H, W); y (B,) labels within the current task; opt: Adam on
    the LoRA factors and the current head. Returns the loss and the number right as tensors, as
    reading them would make a GPU wait."""
    model, head = learner.model, learner.heads[-1]

    # The loss, Eq. (12): the current head's cross-entropy plus lambda times DML, Eq. (11).
    # z (B, D) is the class token after the final LayerNorm; kv_inputs[i] (B, N+1, D) is block i's
    # LayerNorm-ed input, which its K and V layers, LoRALinear below, share. On CUDA the frozen
    # backbone runs under bf16 autocast (--precision); LoRALinear splits A off M in float32.
    bf16 = images.is_cuda and cfg.precision == "bf16"
    with torch.autocast(images.device.type, torch.bfloat16, enabled=bf16):
        z, kv_inputs = model.encode(images)
    z = z.float()
    logits = head(z)
    loss = F.cross_entropy(logits, y)
    if cfg.dml:
        dml = dml_loss(z, y, learner.prototypes, cfg.margin, cfg.tau, head.out_features)
        loss = loss + cfg.lambda_dml * dml

    # The safe gradient, Theorem 3.1: G_safe = G (I - M M^T) for G = dL/dW of each K and V layer,
    # where M is its block's memory, set at the task's start (start_task). The forward pass made
    # the projection: LoRALinear (below) holds A's part in span(M) constant, so this backward pass
    # leaves s B^T G_safe in A.grad and s G_safe A^T in B.grad.
    opt.zero_grad(set_to_none=True)
    loss.backward()

    # GR, Eqs. (5)-(7): the factor gradients whose composite update s (B dA + dB A) best matches
    # G_safe. Adam takes them, as the paper says. Ours, --rectify update, rectifies the step that
    # Adam proposes instead, since Adam's per-coordinate scaling moves a step out of the safe set.
    layers = lora_layers(model)
    if not cfg.gr:
        opt.step()
    elif cfg.rectify == "grad":
        rectify_gradients_(layers, cfg.delta)
        opt.step()
    else:
        rectified_adam_step_(opt, layers, cfg.delta)

    # OE, Eqs. (8)-(10): each block's basis V learns from the K/V inputs of the forward pass above,
    # made before Adam's step, staying off the memory. Ours: V joins M at the task's end, and until
    # then the safe gradient projects with M alone, because projecting out the current task's own
    # subspace would remove most of its gradient.
    if learner.oe is not None:
        learner.oe.update(kv_inputs, learner.memory)
    return loss.detach(), (logits.argmax(1) == y).sum()


# ---- LoRA on K and V, and the safe gradient of Theorem 3.1 ---------------------------------------
class LoRALinear(nn.Linear):
    """Eq. (1): a frozen linear layer W0 (the ViT's K or V) plus s B A, with A (r, d_in) and
    B (d_out, r) trained. M (d_in, m) is its block's orthonormal memory, set at each task's start
    (start_task). The gradients are safe: the chain rule's of G_safe = G (I - M M^T). With SGD,
    A's steps are then off M, so A stays off M (reset_ starts it there) and s B A M = 0; Adam's
    per-coordinate scaling moves A into span(M) (in a two-task test of one layer, a fifth of the
    update's norm, ||dW M|| / ||dW||), which --rectify update fixes."""

    def __init__(self, in_features, out_features, rank, scale):
        super().__init__(in_features, out_features)  # W0 and its bias, the checkpoint's
        self.requires_grad_(False)
        self.scale = float(scale)
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, rank))
        self.M = torch.zeros(in_features, 0)  # none yet; start_task sets it
        self.reset_()

    def forward(self, x):  # x (..., d_in) -> (..., d_out)
        out = F.linear(x, self.weight, self.bias)
        if self.M.shape[1] == 0:  # nothing to protect yet
            return out + self.scale * F.linear(F.linear(x, self.A), self.B)
        # Theorem 3.1 through autograd. Split A = A_out + A_in, with A_in = A M M^T its part in
        # span(M), and hold A_in, and B where it multiplies A_in, constant. The output and dL/dx
        # do not change. With G = dL/dW and P = I - M M^T, A's gradient flows through A_out = A P
        # alone, so dL/dA = (s B^T G) P = s B^T G_safe; B's flows through its copy times A_out, so
        # dL/dB = s G (A P)^T = s (G P) A^T = s G_safe A^T, as P is symmetric. A test checks
        # these two, the output and dL/dx against autograd through a dense W0 + s B A. Under bf16
        # autocast, A's gradient is exactly off M (P applied in float32), B's accurate to bf16:
        # harmless, as a step dB changes dW M = s dB (A M) by nothing while A M = 0.
        with torch.autocast(x.device.type, enabled=False):  # the projection in float32 at least
            dtype = torch.promote_types(self.A.dtype, torch.float32)
            A, M = self.A.to(dtype), self.M.to(dtype)
            A_in = (A @ M) @ M.T  # (r, d_in)
            A_out = A - A_in
        # Both parts in one product of 2r columns: x A_out^T B^T + x A_in^T B^T.
        xA = F.linear(x, torch.cat([A_out, A_in.detach()]).to(x.dtype))  # (..., 2r)
        return out + self.scale * F.linear(xA, torch.cat([self.B, self.B.detach()], 1))

    @torch.no_grad()
    def reset_(self, M=None):
        """A fresh pair for a new task: A Kaiming-uniform, as nn.Linear's weight, with its rows
        moved off span(M), so that the update starts off the memory (ours); B = 0."""
        # drawn on the CPU, so that a run's random numbers do not depend on the device
        self.A.copy_(nn.init.kaiming_uniform_(torch.empty(self.A.shape), a=math.sqrt(5)))
        if M is not None:
            M = M.to(self.A.dtype)
            self.A -= (self.A @ M) @ M.T
            if M.shape[1] == M.shape[0]:  # a full memory: an exact 0, no round-off for GR to grow
                self.A.zero_()
        self.B.zero_()

    @torch.no_grad()
    def merge_(self, M):
        """A task's end: fold s B A into W0, then a fresh pair off the memory M of the next task."""
        self.weight += self.scale * (self.B @ self.A).to(self.weight.dtype)
        self.reset_(M)


def lora_layers(model):
    """The LoRA layers, K then V of each block: layer j belongs to block j // 2."""
    return [layer for block in model.blocks for layer in (block.attn.k, block.attn.v)]


# ---- The Decoupled Margin Loss, Eq. (11) ---------------------------------------------------------
def dml_loss(z, y, old_prototypes, margin=0.3, tau=0.07, num_classes=None):
    """Eq. (11). z (B, D) features; y (B,) labels of the current task (of num_classes); old
    prototypes (P, D), unit rows. The current prototypes are the batch's unit class means, each
    sample in its own class's, and the gradient flows through them too (ours: the paper does not
    say); so a class of one sample in the batch gives z.p = 1."""
    z = F.normalize(z.float(), dim=1)
    onehot = F.one_hot(y, num_classes or int(y.max()) + 1).float()  # (B, C)
    protos = F.normalize(onehot.T @ z, dim=1)  # (C, D); a class absent from the batch: 0
    absent = onehot.sum(0) == 0  # (C,): left out of the softmax, which runs over C_t
    logits = (z @ protos.T / tau).masked_fill(absent, -math.inf)
    intra = F.cross_entropy(logits, y)  # -log softmax of z.p_y / tau
    if old_prototypes.shape[0] == 0:
        return intra
    hinge = F.relu(z @ old_prototypes.T - margin)  # (B, P): max(0, s_ij - m)
    return intra + hinge.mean()


# ---- GR: Gradient Rectification, Eqs. (5)-(7) ----------------------------------------------------
def rectify_gradients_(layers, delta):
    """Replace the LoRA pairs' factor gradients by GR's, for all layers in one batch."""
    A = torch.stack([layer.A.detach() for layer in layers])  # (L, r, d_in)
    B = torch.stack([layer.B.detach() for layer in layers])  # (L, d_out, r)
    s = layers[0].scale
    # Autograd left the chain rule of G_safe: s B^T G_safe and s G_safe A^T. Eq. (4) as printed,
    # (dW)^T B and A^T dW, has the shapes wrong and no s; GR's Eqs. (6)-(7) take these without s.
    BtG = torch.stack([layer.A.grad for layer in layers]) / s  # B^T G_safe (L, r, d_in)
    GAt = torch.stack([layer.B.grad for layer in layers]) / s  # G_safe A^T (L, d_out, r)
    dA, dB = rectify_factors(BtG, GAt, A, B, s, delta)
    for layer, a, b in zip(layers, dA, dB):
        layer.A.grad.copy_(a)
        layer.B.grad.copy_(b)


def rectify_factors(BtG, GAt, A, B, scale, delta):
    """GR from B^T G_safe (..., r, d_in) and G_safe A^T (..., d_out, r) alone: G_safe itself,
    d_out x d_in, is never formed. In float64, as the r x r systems can be ill-conditioned."""
    dtype = BtG.dtype
    BtG, GAt, A, B = BtG.double(), GAt.double(), A.double(), B.double()
    # Why (delta -> 0; G = G_safe; P_B = B (B^T B)^-1 B^T, P_A = A^T (A A^T)^-1 A): s B dA = P_B G,
    # R = (I - P_B) G and s dB A = R P_A = (I - P_B) G P_A. The residual (I - P_B) G (I - P_A) is
    # orthogonal to every B X + Y A: this is the exact minimiser of Eq. (5), which the paper calls
    # non-convex but is linear least squares in (dA, dB). If A M = 0, then P_A M = 0, and as
    # G M = 0, s (B dA + dB A) M = 0: it stays off M. Eq. (5) fits s (B dA + dB A), hence the
    # 1/s. dA scales as 1 / |B|: large while B is small, and 0 at a task's first step, where
    # B = 0; Adam, which scales each coordinate's step to about lr, undoes that scaling.
    dA = spd_solve(ridge(gram(B), delta), BtG) / scale  # Eq. (6), delta relative (ours)
    RAt = GAt - scale * B @ (dA @ A.mT)  # R A^T = G A^T - s B (dA A^T): neither R nor G formed
    # Eq. (7) transposed, dB^T = (A A^T)^-1 (R A^T)^T / s, as spd_solve solves from the left.
    dB = spd_solve(ridge(gram(A.mT), delta), RAt.mT).mT / scale
    return dA.to(dtype), dB.to(dtype)


# ---- The small linear algebra of GR, which OE uses too -------------------------------------------
def gram(X):
    """X^T X (..., k, k) of X (..., n, k), in float64: float32's round-off can fail Cholesky."""
    X = X.double()
    return X.mT @ X


def ridge(S, delta):
    """S + delta * mean(eig S) * I for Gram matrices S (..., r, r)."""
    lam = delta * S.diagonal(dim1=-2, dim2=-1).mean(-1) + torch.finfo(S.dtype).tiny  # S = 0: finite
    return S + lam[..., None, None] * torch.eye(S.shape[-1], dtype=S.dtype, device=S.device)


def spd_solve(S, rhs):
    """S^-1 rhs for positive definite S (..., n, n) by Cholesky; cholesky_ex, unlike cholesky,
    does not check the result, which would make a GPU wait."""
    L = torch.linalg.cholesky_ex(S).L
    y = torch.linalg.solve_triangular(L, rhs, upper=False)
    return torch.linalg.solve_triangular(L.mT, y, upper=True)


# ---- OE: Online Estimation, Eqs. (8)-(10) --------------------------------------------------------
class OnlineSubspace:
    """OE's basis V (L, D, k): for each of L blocks, an orthonormal basis of the current task's K/V
    inputs, kept off the block's memory M."""

    def __init__(self, blocks, dim, k, lr=1.0, decay_steps=5, device=None):
        self.k, self.lr, self.decay_steps = k, lr, decay_steps
        self.V = fresh_basis(torch.zeros(blocks, dim, 0, device=device), k)  # (L, D, k)
        self.t = 0  # this task's steps so far: the step size decays with them

    @torch.no_grad()
    def update(self, X, memory):
        """One step on Eq. (8), (1/2) ||X_p - X_p V V^T||^2 per block. Ours: the samples X_p are
        all the batch's tokens, off the memory: X_p = X (I - M M^T). X: each block's K/V inputs
        (..., D); memory: each block's M (D, m)."""
        V, M = self.V, stack_blocks(memory)  # (L, D, k), (L, D, m)
        if V.shape[-1] == 0:  # a full memory leaves nothing to learn
            return
        # The step. With C = X_p^T X_p V, Eq. (8)'s gradient is -2 C + C V^T V + V V^T C, which is
        # -(I - V V^T) C at V^T V = I. As M^T V = 0, X_p V = X V (x @ v below), and so
        # S = (X_p V)^T (X_p V) = V^T C. The step below, `grad`, is that gradient times S^-1:
        # -(I - V V^T) C S^-1. So V~ = V - eta grad = V + eta (C S^-1 - V (V^T C) S^-1)
        # = (1 - eta) V + eta C S^-1 (ridge aside): at eta = 1, C S^-1, whose Q spans X_p^T X_p V,
        # one step of subspace iteration. And as V^T grad = 0, V~^T V~ = I + eta^2 grad^T grad >= I:
        # qr_q's Cholesky is safe.
        CS = []
        for x, v in zip(X, V):
            x = x.reshape(-1, v.shape[0]).float()  # (n, D)
            xv = x @ v  # (n, k): X_p V
            S = ridge(gram(xv), 1e-6)  # (k, k) preconditioner; its diagonal: each column's energy
            # S^-1 before X^T: after it, S^-1 would blow X^T's round-off up along the directions
            # where S is singular (a batch of fewer tokens than k), in which the step is 0.
            CS.append(x.T @ spd_solve(S, xv.mT.double()).mT.to(x.dtype))  # (D, k): X^T X_p V S^-1
        CS = off_span(torch.stack(CS), M)  # C S^-1 = (I - M M^T) X^T X_p V S^-1
        grad = -(CS - V @ (V.mT @ CS))  # ours: Eq. (8)'s gradient at V^T V = I, times S^-1
        # Ours: eta decays as 5 / (5 + t), which averages the batches' noise.
        lr = self.lr * self.decay_steps / (self.decay_steps + self.t)
        V_tilde = V - lr * grad  # Eq. (9), its step preconditioned by S^-1 (ours)
        Q = qr_q(V_tilde)  # Eq. (10): V <- Q of V_tilde = QR; ours: R's diagonal > 0, no flips
        # Off M again, so that no round-off leaks into span(M); in place, since under --memory
        # oe-rolling the LoRA layers hold views of V.
        self.V.copy_(off_span(Q, M))
        self.t += 1

    @torch.no_grad()
    def merge(self, memory):
        """A task's end (ours): M <- orth([M, V]) per block. Returns the new memory, and starts a
        fresh V off it for the next task."""
        M = torch.linalg.qr(torch.cat([stack_blocks(memory), self.V], dim=-1)).Q  # (L, D, m + k)
        self.V = fresh_basis(M, self.k)
        return list(M)


def fresh_basis(M, k):
    """A random orthonormal V (L, D, k) off M (L, D, m), uniform (Haar) among those; a full memory
    leaves no room for it."""
    L, D, m = M.shape
    # drawn on the CPU, so that a run's random numbers do not depend on the device
    V = torch.randn(L, D, min(k, D - m)).to(M.device)
    # Q with R's diagonal > 0, as Gram-Schmidt's: uniform. LAPACK's Q alone is not: V[0, 0] <= 0.
    Q, R = torch.linalg.qr(off_span(V, M))
    return Q * R.diagonal(dim1=-2, dim2=-1).sign()[..., None, :]


def off_span(V, M):
    """(I - M M^T) V: V's columns without their part in span(M)."""
    return V - M @ (M.mT @ V)


def rows_off_span(G, M):
    """G (I - M M^T): G's rows off span(M), Theorem 3.1's form for a dense G (..., d_out, d_in)."""
    return G - (G @ M) @ M.mT


def stack_blocks(memory):
    """Each block's memory (D, m_i) as one (L, D, m), zero columns padding GPM's narrower ones."""
    m = max(M.shape[1] for M in memory)
    return torch.stack([F.pad(M, (0, m - M.shape[1])) for M in memory])


def qr_q(V):
    """Eq. (10)'s Q of V = QR (..., n, k) with R's diagonal > 0: V^T V = R^T R, so R^T is the
    Cholesky factor of V^T V, and Q = V R^-1. OE's V~^T V~ >= I (OnlineSubspace.update) keeps the
    Cholesky safe; in float64, far faster than QR."""
    R = torch.linalg.cholesky_ex(gram(V)).L.mT
    return torch.linalg.solve_triangular(R, V.double(), upper=True, left=False).to(V.dtype)


# ==== 2. Ours and the baselines ===================================================================
# ---- Ours: --rectify update, GR on the step that Adam proposes (README) --------------------------
def rectified_adam_step_(opt, layers, delta):
    """Adam proposes a step, which GR then rectifies against each layer's memory M."""
    before = [(layer.A.detach().clone(), layer.B.detach().clone()) for layer in layers]
    opt.step()
    rectify_updates_(layers, before, [layer.M for layer in layers], delta)


@torch.no_grad()
def rectify_updates_(layers, before, memories, delta):
    """The step Adam took from `before`, each layer's (A, B), as dW = s (B dA + dB A): projected by
    Theorem 3.1, rectified by GR, and split between A and B with the least norm."""
    A0 = torch.stack([a for a, _ in before])  # (L, r, d_in)
    B0 = torch.stack([b for _, b in before])  # (L, d_out, r)
    s = layers[0].scale
    dA = torch.stack([layer.A for layer in layers]) - A0  # Adam's proposed step
    dB = torch.stack([layer.B for layer in layers]) - B0
    M = stack_blocks(memories)
    # B^T dW_safe and dW_safe A^T, with products r wide only
    BtW = rows_off_span(s * ((B0.mT @ B0) @ dA + (B0.mT @ dB) @ A0), M)
    Ap = rows_off_span(A0, M).mT  # (I - M M^T) A^T  (L, d_in, r)
    WAt = s * (B0 @ (dA @ Ap) + dB @ (A0 @ Ap))
    rA, rB = least_norm_split(*rectify_factors(BtW, WAt, A0, B0, s, delta), A0, B0)
    for layer, a, b in zip(layers, A0 + rA, B0 + rB):
        layer.A.copy_(a)
        layer.B.copy_(b)


def least_norm_split(dA, dB, A, B):
    """Of the steps (dA + C A, dB - B C), which keep the composite B dA + dB A, the one of least
    ||dA||^2 + ||dB||^2: C solves (B^T B) C + C (A A^T) = B^T dB - dA A^T. With A and B of full
    rank r these are all the steps with that composite. In float64, as GR."""
    dtype = dA.dtype
    dA, dB, A, B = dA.double(), dB.double(), A.double(), B.double()
    P, Q = gram(B), gram(A.mT)  # (..., r, r)
    r, batch = P.shape[-1], P.shape[:-2]
    I = torch.eye(r, dtype=P.dtype, device=P.device)
    # Row-major vec(P C + C Q) = (P kron I + I kron Q^T) vec(C), Q^T = Q: an r^2 x r^2 semidefinite
    # system, consistent, solved with a round-off ridge (its least-norm solution where singular).
    K = torch.einsum("...ik,jl->...ijkl", P, I) + torch.einsum("ik,...jl->...ijkl", I, Q)
    K = ridge(K.reshape(*batch, r * r, r * r), r * torch.finfo(P.dtype).eps)
    rhs = (B.mT @ dB - dA @ A.mT).reshape(*batch, r * r, 1)
    C = spd_solve(K, rhs).reshape(P.shape)
    return (dA + C @ A).to(dtype), (dB - B @ C).to(dtype)


# ---- The baselines: GPM's memory (LoRA-GPM) and InfLoRA's A, as the InfLoRA codebase -------------
@torch.no_grad()
def kv_covariance(model, images, cfg):
    """Each block's uncentred K/V-input covariance (L, D, D) over every token of the images."""
    C, n = 0.0, 0
    for _, kv_inputs, _ in batches(model, images, cfg):
        X = [x.float().flatten(0, 1) for x in kv_inputs]  # (B * (N+1), D) per block
        C = C + torch.stack([x.T @ x for x in X])
        n += X[0].shape[0]
    return C / n


def gpm_extend(M, C, threshold):
    """GPM: M (D, m) plus the fewest leading directions of (I - M M^T) C that bring the captured
    share of C's energy to the threshold; a direction's energy is its squared singular value."""
    C, M64 = C.double(), M.double()  # once a task: float64 keeps the memory orthonormal
    total = torch.linalg.svdvals(C).square().sum()
    U, s, _ = torch.linalg.svd(C - M64 @ (M64.T @ C))
    e = s.square() / total  # (D,): each residual direction's share
    before = (1 - e.sum()) + torch.cumsum(e, 0) - e  # the share held before adding direction i
    r = min(int((before < threshold).sum()), C.shape[0] - M.shape[1])  # never past the width
    return torch.cat([M, U[:, :r].to(M.dtype)], dim=1)


def inflora_a(C, M, rank):
    """InfLoRA's A (r, D), off span(M): the top-r left singular vectors of (I - M M^T) C, over
    sqrt(3) as its code scales them."""
    C, M64 = C.double(), M.double()  # float64: the trailing vectors' round-off stays off M
    U = off_span(torch.linalg.svd(C - M64 @ (M64.T @ C)).U[:, :rank], M64)
    return (U.T / math.sqrt(3)).to(M.dtype)


# ==== 3. The protocol: InfLoRA's (a head per task, no exemplars, no task id at test) =============
def build_model(cfg):
    """The backbone of cfg.model with LoRA on K and V, loaded from cfg.weights, in eval mode for
    good (the ViT has no dropout). Returns it and the path of the weights' file (None: random)."""
    torch.manual_seed(0)  # with --weights none, one random backbone plays the checkpoint for all
    kv_layer = partial(LoRALinear, rank=cfg.rank, scale=cfg.lora_scale)
    model = vit.PRESETS[cfg.model](img_size=cfg.img_size, patch_size=cfg.patch_size,
                                   kv_layer=kv_layer)
    weights_file = vit.load_pretrained(model, cfg.weights)
    model.requires_grad_(False)  # frozen: start_task lets the LoRA factors train
    return model.eval(), weights_file


def compiled(cfg):
    """Whether the ViT's blocks run compiled. --compile auto compiles on CUDA, where a whole run
    gains from it (README: Speed), and not on a CPU, where TorchInductor needs a C++ compiler."""
    return cfg.compile == "on" or (cfg.compile == "auto" and cfg.device.startswith("cuda"))


def start_learner(cfg, seed, backbone):
    """A learner for one seed: a copy of the backbone, fresh LoRA pairs and OE, no memory yet."""
    torch.manual_seed(seed)  # the only generator a run draws from; the loaders seed their own
    model = copy.deepcopy(backbone).to(cfg.device)
    for layer in lora_layers(model):
        layer.reset_()  # the first task's A comes from this seed too
    if compiled(cfg):  # ours: compiled in place, so the checkpoints' names stay the same
        # A block is traced anew for each new shape, and the memory's width grows each task. Its
        # width, a plain attribute's (LoRALinear.M), soon becomes a dynamic size, but the traces
        # of the first tasks, with and without gradients, exceed dynamo's default of 8.
        torch._dynamo.config.cache_size_limit = 64  # recompile_limit's name in every torch >= 2.4
        for block in model.blocks:
            block.compile()
    L, D = len(model.blocks), model.embed_dim
    oe = None
    if cfg.oe and cfg.memory != "gpm":
        oe = OnlineSubspace(L, D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, cfg.device)
    memory = [torch.zeros(D, 0, device=cfg.device)] * L  # task 1 has nothing to protect
    return Learner(model, nn.ModuleList(), oe, memory, torch.zeros(0, D, device=cfg.device))


def new_record(seed):
    """What a seed's run measures, task by task: results.json's entry before its metrics."""
    return {"seed": seed, "acc_matrix": [], "task_aware": [], "sample_acc": [], "task_seconds": [],
            "throughput": [], "violation": {"k": [], "v": []}, "interference": [], "geometry": []}


def run_seed(learner, record, splits, cfg, after_task):
    """One seed: every task not finished yet, in turn, measured into `record`: after each task, a
    row of each accuracy matrix, from which `metrics` gives ACC, MAA and BWT when the seed is done;
    and the paper's analyses. after_task(learner, record) is the program's (it saves them)."""
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    for t in range(len(record["acc_matrix"]), cfg.tasks):
        start = time.time()  # a task's time: training and the method's passes, not the evaluation
        start_task(learner, t, tasks, splits, cfg)
        memory = [layer.M.clone() for layer in lora_layers(learner.model)[::2]]  # what it protects
        record["throughput"].append(train_task(learner, t, tasks, splits, cfg, record["seed"]))
        factors = end_task(learner, t, tasks, splits, cfg)
        record["task_seconds"].append(time.time() - start)
        acc, aware, sample = evaluate(learner.model, learner.heads, splits, tasks, cfg)
        record["acc_matrix"].append(acc)
        record["task_aware"].append(aware)
        record["sample_acc"].append(sample)
        print(f"seed {record['seed']} task {t + 1} accuracy per task: "
              f"{' '.join(f'{a:.2f}' for a in acc)}  | mean {sum(acc) / len(acc):.2f}  | over "
              f"samples {sample:.2f}  | task-aware mean {sum(aware) / len(aware):.2f}  | "
              f"{record['task_seconds'][-1]:.1f} s", flush=True)
        record_analyses(record, learner, t, factors, memory, splits, cfg)
        after_task(learner, record)


def start_task(learner, t, tasks, splits, cfg):
    """Task t's start: a fresh head, each LoRA layer given the memory it protects; with --lora-a
    inflora, InfLoRA's A, designed from the task's K/V inputs off the memory, and frozen."""
    model = learner.model
    learner.heads.append(nn.Linear(model.embed_dim, len(tasks[t])).to(cfg.device))
    M = protected(learner, cfg)
    for j, layer in enumerate(lora_layers(model)):
        layer.M = M[j // 2]  # K and V of block j // 2 share its input, and so its memory
        layer.A.requires_grad_(cfg.lora_a == "trained")  # InfLoRA trains B alone
        layer.B.requires_grad_(True)
    if learner.oe is not None:
        learner.oe.t = 0  # each task's OE starts with large steps
    if cfg.lora_a == "inflora":
        C = kv_covariance(model, data.subset(splits.train_eval, tasks[t]), cfg)  # (L, D, D)
        A = [inflora_a(C_i, M_i, cfg.rank) for C_i, M_i in zip(C, M)]  # K and V share an A
        with torch.no_grad():
            for j, layer in enumerate(lora_layers(model)):
                layer.A.copy_(A[j // 2])


def protected(learner, cfg):
    """Each block's M that its LoRA pairs stay off during a task: the finished tasks' memory; or,
    with --memory oe-rolling (the paper's words read literally), OE's V as each step moves it."""
    if cfg.memory == "oe-rolling" and learner.oe is not None:
        return list(learner.oe.V)  # views of V, which OnlineSubspace.update changes in place
    return learner.memory


class Diverged(Exception):
    """The loss is no longer finite: the run cannot go on."""


def train_task(learner, t, tasks, splits, cfg, seed):
    """Task t's training: cfg.epochs epochs of train_step, a line per epoch and one every 30 s
    within a long epoch; in the run's first epoch, at its first 30-s line or at its end, a note of
    how long the run's training takes at that speed. Returns the images per second of each
    epoch."""
    local = torch.full((splits.num_classes,), -1, device=cfg.device)  # class id -> head's index
    local[tasks[t]] = torch.arange(len(tasks[t]), device=cfg.device)
    images = data.subset(splits.train, tasks[t])
    # The loader's own generator draws its order, crops and flips.
    loader = data.make_loader(images, cfg.batch_size, True, cfg.workers, seed * 1000 + t,
                              cfg.device)
    opt = adam(learner, cfg)
    speeds = []
    pending = t == 0 and seed == cfg.seeds[0]  # the run's estimate, due in its first epoch
    for epoch in range(cfg.epochs):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(epoch, cfg.epochs, cfg.schedule)
        start = printed_at = time.time()  # the epoch's start, and its last progress line's
        loss_sum, correct, seen = 0.0, 0, 0
        for i, (x, y) in enumerate(loader, 1):
            x, y = x.to(cfg.device, non_blocking=True), local[y.to(cfg.device)]
            loss, right = train_step(learner, opt, x, y, cfg)
            loss_sum = loss_sum + loss * len(y)  # tensors, read once an epoch
            correct = correct + right
            seen += len(y)
            if time.time() - printed_at > 30:
                printed_at = time.time()
                print(f"seed {seed} task {t + 1} epoch {epoch + 1}: {i}/{len(loader)} steps, loss "
                      f"{float(loss_sum) / seen:.4f}", flush=True)
                if pending:  # 30 s into a long first epoch: a ViT-B on a CPU takes days
                    pending = False
                    print(estimate(seen / (printed_at - start), splits, cfg), flush=True)
        loss = float(loss_sum) / seen
        if not math.isfinite(loss):  # a diverged run must not go on to write results
            raise Diverged(f"task {t + 1} epoch {epoch + 1}: the loss is {loss}; lower --lr and "
                           "start again with another --out")
        speeds.append(seen / (time.time() - start))
        print(f"seed {seed} task {t + 1}/{cfg.tasks} epoch {epoch + 1}/{cfg.epochs}  loss "
              f"{loss:.4f}  train acc {100.0 * float(correct) / seen:5.2f}%  "
              f"{speeds[-1]:7.1f} img/s", flush=True)
        if pending:  # the end of a first epoch shorter than 30 s
            pending = False
            print(estimate(speeds[-1], splits, cfg), flush=True)
    return speeds


def estimate(speed, splits, cfg):
    """The note of how long the run's training takes at `speed` images per second."""
    total = cfg.epochs * len(splits.train) * len(cfg.seeds)  # images to train
    return (f"note: at {speed:.1f} img/s on {cfg.device}, the run's training ({cfg.epochs} "
            f"epoch(s) of {len(splits.train)} images, {len(cfg.seeds)} seed(s)) takes about "
            f"{duration(total / speed)}")


def adam(learner, cfg):
    """Adam, with betas (0.9, 0.999) as the InfLoRA codebase's, on the LoRA factors that train
    and the current head."""
    factors = [p for layer in lora_layers(learner.model) for p in (layer.A, layer.B)]
    params = [p for p in factors if p.requires_grad] + list(learner.heads[-1].parameters())
    return torch.optim.Adam(params, lr=cfg.lr)


def lr_factor(epoch, epochs, schedule):
    """The lr of a task's epoch as a factor of --lr: InfLoRA's CosineSchedule as its code steps it,
    cos(99 pi e / (200 (K - 1))) for e = epoch - 1 after an epoch at 1; or a half cosine."""
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * epoch / epochs))
    if epoch == 0 or epochs == 1:  # the codebase divides by zero at K = 1: one epoch at lr
        return 1.0
    return math.cos(99 * math.pi * (epoch - 1) / (200 * (epochs - 1)))


@torch.no_grad()
def end_task(learner, t, tasks, splits, cfg):
    """Task t's end: DML's prototypes of its classes, the memory's update, the LoRA merge. Returns
    the task's factors (A, B) of each layer from before the merge, for the analyses."""
    images = data.subset(splits.train_eval, tasks[t])  # the test transform
    z, y = features(learner.model, images, cfg)
    learner.prototypes = torch.cat([learner.prototypes, class_prototypes(z, y, tasks[t])])
    if cfg.oe and cfg.memory == "oe":  # ours: this task's OE basis joins the memory
        learner.memory = learner.oe.merge(learner.memory)
    elif cfg.oe and cfg.memory == "gpm":  # a pass over the task's images: what OE avoids
        C = kv_covariance(learner.model, images, cfg)
        first, last = cfg.gpm_threshold  # InfLoRA's schedule: t / T of the way, t from 0
        threshold = first + (last - first) * t / cfg.tasks
        learner.memory = [gpm_extend(M, C_i, threshold) for M, C_i in zip(learner.memory, C)]
    layers = lora_layers(learner.model)
    factors = [(layer.A.clone(), layer.B.clone()) for layer in layers]
    M = protected(learner, cfg)
    for j, layer in enumerate(layers):
        layer.merge_(M[j // 2])  # W0 += s B A, and a fresh pair off the next task's memory
    return factors


@torch.no_grad()
def class_prototypes(z, y, classes):
    """(len(classes), D): each class's normalised mean of normalised features (DML's C_past)."""
    z = F.normalize(z, dim=1)
    return torch.stack([F.normalize(z[y == c].mean(0), dim=0) for c in classes])


@torch.no_grad()
def evaluate(model, heads, splits, tasks, cfg):
    """Row t of the accuracy matrices, per seen task: task-agnostic (InfLoRA's: the argmax over
    all heads) and task-aware (ours: the true task's head); and over the seen test samples."""
    seen = torch.tensor([c for classes in tasks[:len(heads)] for c in classes], device=cfg.device)
    z, y = features(model, data.subset(splits.test, seen.tolist()), cfg)
    task_of = torch.empty(int(seen.max()) + 1, dtype=torch.long, device=cfg.device)
    for i, classes in enumerate(tasks[:len(heads)]):
        task_of[classes] = i
    logits = torch.cat([head(z) for head in heads], dim=1)  # (n, seen classes), in `seen`'s order
    other_task = task_of[seen][None, :] != task_of[y][:, None]  # (n, seen classes)
    agnostic = seen[logits.argmax(1)]
    aware = seen[logits.masked_fill(other_task, -math.inf).argmax(1)]
    rows = [[100.0 * float((pred == y)[task_of[y] == i].float().mean()) for i in range(len(heads))]
            for pred in (agnostic, aware)]
    return rows[0], rows[1], 100.0 * float((agnostic == y).float().mean())


@torch.no_grad()
def features(model, images, cfg):
    """z (n, D) and the labels y (n,) of the images, in their order."""
    pairs = [(z, y) for z, _, y in batches(model, images, cfg)]
    return torch.cat([z for z, _ in pairs]), torch.cat([y for _, y in pairs])


def batches(model, images, cfg):
    """(z, K/V inputs, y) of each batch of the images in order, under the run's autocast."""
    for x, y in data.make_loader(images, cfg.batch_size, False, cfg.workers, 0, cfg.device):
        x = x.to(cfg.device)
        with torch.autocast(x.device.type, torch.bfloat16,
                            enabled=x.is_cuda and cfg.precision == "bf16"):  # as train_step
            z, kv_inputs = model.encode(x)
        yield z.float(), kv_inputs, y.to(cfg.device)


def metrics(acc):
    """ACC, MAA, BWT (Sec. 4.1) of acc[t][i], the accuracy (%) on task i after task t (i <= t is
    read); BWT is undefined (None) with one task."""
    T = len(acc)
    maa = sum(sum(acc[t][: t + 1]) / (t + 1) for t in range(T)) / T
    bwt = sum(acc[T - 1][i] - acc[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else None
    return {"ACC": sum(acc[T - 1][:T]) / T, "MAA": maa, "BWT": bwt}


# ---- The paper's analyses after each task: the null-space violation against the memory and on
# real activations (Fig. 2), DML's geometry (Fig. 3 and the appendix's density) --------------------
def record_analyses(record, learner, t, factors, memory, splits, cfg):
    """Task t's analyses into record; factors: its (A, B) per layer; memory: the M it protected."""
    for j, name in enumerate("kv"):  # factors[j::2]: each block's K (j = 0) or V (j = 1) pair
        pairs = zip(factors[j::2], memory)
        record["violation"][name].append([violation(A, B, M) for (A, B), M in pairs])
    if t == 0:  # no past tasks, no old prototypes
        record["interference"].append(None)
        record["geometry"].append(None)
        return
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    seen = data.subset(splits.test, [c for classes in tasks[:t + 1] for c in classes])
    energy, z, y = probe(learner.model, factors, seen, tasks[t], cfg)
    past, now = energy.sqrt().tolist()
    record["interference"].append({"past": past, "current": now})
    record["geometry"].append(dml_geometry(z, y, learner.prototypes, tasks[t][0]))
    violations = [fmt(mean(record["violation"][n][-1]), ".2e") for n in "kv"]
    print(f"seed {record['seed']} task {t + 1} analyses: its K/V update changed the outputs of "
          f"the past tasks' test images by {mean(past):.3g} (RMS), its own by {mean(now):.3g} "
          f"(Fig. 2); ||dW M|| / ||dW|| {violations[0]} (K), {violations[1]} (V); "
          f"{100 * record['geometry'][-1]['danger']:.1f}% of its test images in DML's danger "
          "zone, within cosine 0.5 of an old class (Fig. 3)", flush=True)


@torch.no_grad()
def violation(A, B, M):
    """||dW M||_F / ||dW||_F of a task's update dW = s B A, never forming dW; None where it is
    undefined (no memory yet, or no update, as under a full memory)."""
    den = ((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt()  # ||B A||_F^2 = tr(B^T B A A^T)
    if M.shape[1] == 0 or den == 0:
        return None
    return float((B @ (A @ M)).norm() / den)


@torch.no_grad()
def probe(model, factors, images, current, cfg):
    """Fig. 2 on real activations: per K/V layer, the mean of ||x dW^T||^2 over the past tasks'
    tokens and over the current task's, (2, layers); and the current task's z and y. x: the K/V
    inputs of the model after the task (merged), not of the model that learned the past tasks."""
    energy, tokens, zs, ys = 0.0, 0.0, [], []
    for z, kv_inputs, y in batches(model, images, cfg):
        now = (y[:, None] == torch.tensor(current, device=y.device)).any(1)  # (B,)
        e = []
        for j, (A, B) in enumerate(factors):  # K and V of block j // 2 share its input
            u = kv_inputs[j // 2].float() @ A.T  # (B, N+1, r)
            e.append(cfg.lora_scale ** 2 * ((u @ (B.T @ B)) * u).sum((1, 2)))  # per image
        e = torch.stack(e, 1)  # (B, layers)
        energy = energy + torch.stack([e[~now].sum(0), e[now].sum(0)])
        tokens = tokens + torch.stack([(~now).sum(), now.sum()])[:, None] * kv_inputs[0].shape[1]
        zs.append(z[now])
        ys.append(y[now])
    return energy / tokens, torch.cat(zs), torch.cat(ys)


def dml_geometry(z, y, prototypes, old, bins=20):
    """One task's test features z (n, D), classes y: cos_old, the largest cosine to an old class's
    prototype (< old), and cos_own, to its own; the shares the paper reads; cos_old's histogram."""
    z = F.normalize(z.float(), dim=1)
    cos_old = (z @ prototypes[:old].T).amax(1)  # (n,)
    cos_own = (z * prototypes[y]).sum(1)
    return {"danger": float((cos_old > 0.5).float().mean()),
            "safe": float((cos_old < 0.2).float().mean()),
            "closer_to_old": float((cos_old > cos_own).float().mean()),
            "hist": (torch.histc(cos_old, bins, -1, 1) / len(z)).tolist(),
            "cos_old": [round(v, 4) for v in cos_old.tolist()],
            "cos_own": [round(v, 4) for v in cos_own.tolist()]}


def mean(values):
    """The mean of the defined values (None: undefined, left out), or None."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def fmt(value, spec=".2f"):
    """A number for a table, or '-' where it is undefined."""
    return "-" if value is None else format(value, spec)


def duration(seconds):
    """A time span in the largest unit of which two have passed: 45 s, 2.5 min, 6.1 days."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


# ==== 4. The program: flags, the run folder and resume, results, plots, --benchmark, --reproduce ==
# --method NAME: its flags, and its name in the paper's tables.
METHODS = {"janus": ("", "Janus-LoRA"),
           "janus-rolling": ("--memory oe-rolling", "Janus-LoRA, M = V"),
           "finetune": ("--no-oe --no-gr --no-dml", "Fine-Tuning"),
           "lora-gpm": ("--memory gpm --no-gr --no-dml", "LoRA-GPM"),
           "lora-gpm-gr": ("--memory gpm --no-dml", "LoRA-GPM + GR"),
           "inflora": ("--memory gpm --lora-a inflora --no-gr --no-dml", "InfLoRA")}
SWITCHES = ("oe", "gr", "dml", "rectify", "memory", "lora_a")  # what tells the methods apart
# What a resume may change: the machine's, more seeds, and where the data and the weights lie now
# (the weights are checked against the SHA-256 of those the run started from).
RESUME_FREE = ("device", "workers", "compile", "seeds", "data_dir", "weights")
RUN_FREE = RESUME_FREE + ("resume", "out")  # what may differ between two configs of one run
PATHS = ("data_dir", "weights", "out", "resume")  # the flags that take a path
EXAMPLES = """examples:
  python janus_min.py --dataset synthetic --model vit_tiny --weights none   # a first run
  python janus_min.py --dataset cifar100 --seeds 0 1 2 3 4 --out runs/cifar
  python janus_min.py --resume runs/cifar                                  # after an interruption
  python janus_min.py --reproduce ablation --dataset imagenet-r --dry-run"""
q = shlex.quote  # a path as one shell word, so that a suggested command pastes as it is


class ConfigError(Exception):
    """Flags that cannot run together, or a run folder that cannot be used."""


class Unwritten(Exception):
    """A file of the command's that could not be written (a full disk, a lost mount)."""


def flag(name):
    return "--" + name.replace("_", "-")


def path(name, text):
    """The value of the path flag `name` as a user types it: ~ expanded, and ./ before a leading
    dash, which argparse would take for a flag; an empty one is refused."""
    if not text:  # ConfigError, not argparse's ValueError: one line, not the usage
        raise ConfigError(f"{name} '': an empty path: give one")
    text = os.path.expanduser(text)
    return os.path.join(".", text) if text.startswith("-") else text


class Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors in one line: --help gives the usage."""

    def error(self, message):
        self.exit(2, f"error: {message} (--help lists the flags)\n")


def choices(f):
    """The values the flag of Config's field f takes, where it names them."""
    return {"method": list(METHODS), "reproduce": list(REPRODUCE)}.get(f.name, f.metadata.get(
        "choices"))


def parser():
    """The parser of Config's fields; what it returns holds only the flags typed."""
    p = Parser(prog="janus_min.py", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
               argument_default=argparse.SUPPRESS,
               formatter_class=argparse.RawDescriptionHelpFormatter,
               allow_abbrev=False)  # a prefix is no flag: --seed is not --seeds
    for f in fields(Config):
        kw = dict(f.metadata)
        if f.name in PATHS:
            kw["type"] = partial(path, flag(f.name))
        if choices(f):
            kw["choices"] = choices(f)
        if f.type is bool and f.default:  # the ablation's switches: --NAME and --no-NAME
            kw["action"] = argparse.BooleanOptionalAction
            kw["help"] += " (default: on)"
        elif f.type is not bool:
            kw.setdefault("type", f.type)
            default = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            kw["help"] += "" if f.default is None else f" (default: {default})"
        p.add_argument(flag(f.name), **kw)
    return p


def parse(argv):
    """The values of the flags in argv, the typed --method's flags first; and those typed alone."""
    typed = vars(parser().parse_args(argv))
    preset = METHODS[typed["method"]][0].split() if "method" in typed else []
    return {**vars(parser().parse_args(preset)), **typed}, typed


def to_argv(values):
    """The flags that give these Config values."""
    argv = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + name)
        else:
            argv += [flag(name), *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return argv


def configure(argv):
    """The checked Config of argv, the data set's defaults and the device filled in, and the flags
    typed; --resume DIR: the run's own Config, but for the flags that may change."""
    values, typed = parse(argv)
    if "resume" in typed:
        saved = saved_run(typed["resume"])["config"]
        fixed = {name: value for name, value in typed.items()  # a flag as the run has it: no change
                 if name not in RESUME_FREE + ("resume",) and value != saved[name]}
        if fixed:
            raise ConfigError(f"--resume continues the run with its own {shown(saved, fixed)}: "
                              f"for {shown(typed, fixed)}, start a new run in a new folder (a "
                              "resume may change only --device, --workers, --compile, --data-dir, "
                              "--weights, and add --seeds)")
        seeds = saved["seeds"]
        if not set(typed.get("seeds", seeds)) >= set(seeds):
            raise ConfigError(f"--resume: the run has the seeds {' '.join(map(str, seeds))}; give "
                              "all of them (and more to add seeds) or none")
        values = {**saved, **typed}
    cfg = Config(**values)
    defaults = {key: value for key, value in data.DATASETS[cfg.dataset].items()
                if key != "num_classes" and getattr(cfg, key) is None}
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpm = (0.98, 1.0) if cfg.dataset == "imagenet-r" else (0.95, 1.0)  # InfLoRA's configs
    cfg = replace(cfg, **defaults, device=device, seeds=list(cfg.seeds),
                  gpm_threshold=list(cfg.gpm_threshold or gpm),
                  workers=cores() if cfg.workers is None else min(cfg.workers, cores()),
                  **absolute_paths(cfg))
    check(cfg, typed)
    notes(cfg, typed)
    return cfg, typed


def absolute_paths(cfg):
    """--data-dir and a --weights file as absolute paths, so that a resume finds them from any
    folder."""
    paths = {"data_dir": os.path.abspath(cfg.data_dir)}
    if cfg.weights not in (*vit.URLS, "none") and os.path.isfile(cfg.weights):  # a name wins
        paths["weights"] = os.path.abspath(cfg.weights)
    return paths


def check(cfg, typed):
    """Refuse a value that cannot run, in one line that names its flag and says what to do; on a
    resume, a value of the run's own that no flag typed names config.json, where it came from."""
    width = vit.PRESETS[cfg.model].keywords["embed_dim"]
    gpus = torch.cuda.device_count()
    device = re.fullmatch(r"cpu|cuda(:\d+)?", cfg.device)
    rows = REPRODUCE[cfg.reproduce][1] if cfg.reproduce else {}
    first, last = cfg.gpm_threshold
    floats = [f.name for f in fields(Config) if float in (f.type, f.metadata.get("type"))]
    checks = [  # (flag, whether its value can run, what to say of it)
        *[(name, torch.tensor(getattr(cfg, name), dtype=torch.float64).isfinite().all(),
           "must be finite") for name in floats],  # argparse takes inf and nan
        *[(name, getattr(cfg, name) > 0, "must be positive")
          for name in ("lr", "tau", "lora_scale", "delta", "oe_lr")],
        *[(name, getattr(cfg, name) >= 0, "must be 0 or more")
          for name in ("margin", "lambda_dml", "workers")],
        *[(name, getattr(cfg, name) >= 1, "must be 1 or more")
          for name in ("epochs", "batch_size", "img_size", "patch_size", "oe_decay_steps",
                       "steps")],
        ("limit_per_class", cfg.limit_per_class is None or cfg.limit_per_class >= 1,
         "must be 1 or more"),
        *[(name, 1 <= getattr(cfg, name) <= width, f"must lie in 1..{width}, the width of "
          f"{cfg.model}") for name in ("rank", "k")],
        ("img_size", cfg.patch_size < 1 or cfg.img_size % cfg.patch_size == 0,  # < 1: refused
         "must be a multiple of --patch-size"),
        ("gpm_threshold", 0 < first <= last <= 1, "must be two numbers, 0 < first <= last <= 1"),
        ("lora_a", cfg.lora_a == "trained" or not cfg.gr,
         "freezes A, which GR trains: add --no-gr"),
        ("input_range", cfg.input_range != "checkpoint" or cfg.weights in vit.PRETRAINED_INPUT,
         "needs a named --weights: for a file, pass half or imagenet"),
        ("seeds", len(set(cfg.seeds)) == len(cfg.seeds), "must name each seed once"),
        ("seeds", all(0 <= s < 2**32 for s in cfg.seeds), "must lie in 0 .. 2^32 - 1"),
        ("device", device, "is not a device: use auto, cpu, cuda or cuda:N"),
        ("device", not device or cfg.device == "cpu" or int(cfg.device[5:] or 0) < gpus,
         f"is not a GPU that torch sees ({gpus} of them): use cpu, or cuda:N below that"),
        ("row", cfg.row is None or cfg.reproduce, "goes with --reproduce NAME"),
        ("row", cfg.row is None or cfg.row in rows, f"is not a row: choose one of {list(rows)}"),
        ("dry_run", not cfg.dry_run or cfg.reproduce, "goes with --reproduce NAME"),
        ("method", not (cfg.method and cfg.reproduce), "goes: --reproduce sets its rows' own"),
    ]
    for name, ok, fix in checks:
        said = f"{' '.join(to_argv({name: getattr(cfg, name)}))}: {fix}"  # as typed: --seeds 1 1
        if not ok and cfg.resume and name not in typed:  # the run's own value, config.json's
            if name not in RESUME_FREE:
                raise unwritten(cfg.resume, "config.json", said)
            said += (f" (config.json's value, which a resume may change: --resume {q(cfg.resume)} "
                     f"{flag(name)} VALUE)")
        if not ok:
            raise ConfigError(said)
    data.task_classes(data.DATASETS[cfg.dataset]["num_classes"], cfg.tasks)  # T divides them


def notes(cfg, typed):
    """A note for the flags typed that have no effect with the others, and for a memory that will
    fill before the last task."""
    if cfg.benchmark:  # its variants set the method; it trains on a random batch, one task
        moot = {"method oe gr dml rectify memory lora_a gpm_threshold epochs schedule seeds "
                "weights input_range data_dir workers limit_per_class reproduce row dry_run "
                "resume": True}
    else:
        moot = {"memory k oe_lr oe_decay_steps gpm_threshold": not cfg.oe,
                "k oe_lr oe_decay_steps": cfg.memory == "gpm", "gpm_threshold": cfg.memory != "gpm",
                "delta rectify": not cfg.gr, "margin lambda_dml tau": not cfg.dml, "steps": True,
                "workers": cfg.dataset in data.IN_MEMORY}  # loader processes read files
    moot["precision"] = cfg.device == "cpu"  # bf16 autocast is CUDA's
    moot = {name for names, off in moot.items() if off for name in names.split()} & set(typed)
    if cfg.reproduce:  # a flag that each row sets is the row's
        rows = REPRODUCE[cfg.reproduce][1]
        chosen = [rows[cfg.row]] if cfg.row else rows.values()
        moot |= set.intersection(*[set(parse(flags.split())[1]) for flags in chosen]) & set(typed)
    if moot:
        print(f"note: {' '.join(map(flag, sorted(moot)))}: no effect with these settings, ignored")
    if typed.get("workers", 0) > cores() and "workers" not in moot:
        print(f"note: --workers {typed['workers']}: this machine has {cores()} cores, which more "
              f"loader processes would only share (each holds torch in memory): {cores()} used")
    width = vit.PRESETS[cfg.model].keywords["embed_dim"]
    full = math.ceil(width / cfg.k)  # the tasks after which each block's memory is full
    if cfg.oe and cfg.memory == "oe" and full < cfg.tasks and not cfg.benchmark:
        print(f"note: --k {cfg.k} fills each block's memory ({cfg.model}: width {width}) after "
              f"task {full} of {cfg.tasks}: the later tasks cannot change K and V")


def cores():
    """The cores this process may use: the default and the most of --workers."""
    return os.cpu_count() or 1


def shown(values, names):
    """The flags that give these names their values: --lr 0.001 --seeds 0 1."""
    return " ".join(to_argv({name: values[name] for name in names}))


def describe(c):
    """The method of a config dict, by its name in the paper, or its switches."""
    for flags, name in METHODS.values():
        preset = asdict(Config(**parse(flags.split())[0]))
        if all(c[s] == preset[s] for s in SWITCHES):
            return name
    return "custom: " + ", ".join(f"{s} {c[s]}" for s in SWITCHES)


# ---- The run folder: config.json at its start, checkpoint.pt after each task, results.json -------
def run(cfg, typed):
    """A run in its folder: every seed not finished yet, then the summary and the plots."""
    started = time.time()
    cfg.out = cfg.resume or cfg.out or os.path.join("runs", f"{cfg.dataset}-"
                                                    f"{time.strftime('%Y%m%d-%H%M%S')}")
    take(cfg.out, "config.json", None if cfg.resume else {"argv": to_argv(typed),
                                                          "config": asdict(cfg)})
    try:
        splits, backbone, weights = load_data_and_model(cfg)
    except (data.DataError, vit.CheckpointError):
        if not cfg.resume:  # nothing ran: the same command may claim the folder again
            os.remove(os.path.join(cfg.out, "config.json"))
        raise
    source = backbone_file(weights)  # once: it hashes the file
    runs, state = previous(cfg, source) if cfg.resume else ([], None)
    results = {"config": asdict(cfg), "environment": environment(cfg), "runs": runs}
    code = results["environment"]["code"]
    per_class = collections.Counter(splits.train.targets).values()
    train = sum(min(n, cfg.limit_per_class or n) for n in per_class)  # what each seed trains on
    print(f"{cfg.dataset}: {train} training images, {cfg.tasks} tasks; "
          f"{describe(asdict(cfg))}; {results['environment']['precision']}; out {q(cfg.out)}")
    save = partial(save_checkpoint, cfg=cfg, backbone=source)
    seeds = [s for s in cfg.seeds if s not in {r["seed"] for r in runs}]
    if state:  # the interrupted seed first: a new seed's checkpoint would replace its own
        seeds.sort(key=lambda s: s != state["record"]["seed"])
    for seed in seeds:
        learner, record = start_learner(cfg, seed, backbone), new_record(seed)
        if state and state["record"]["seed"] == seed:  # interrupted: after its last finished task
            restore(learner, record, state, cfg.device)
        # each code that ran the seed: one more if it was edited between an interruption and now
        record["code"] = [c for c in record.get("code", []) if c != code] + [code]
        run_seed(learner, record, data.thin(splits, cfg.limit_per_class, seed), cfg, save)
        runs.append(results_entry(record, cfg.tasks))
        write_json(os.path.join(cfg.out, "results.json"), {**results, "summary": summarize(runs)})
    results["summary"] = summarize(runs)
    print_summary(results)
    paths = [os.path.join(cfg.out, "results.json"), *plot(results, cfg.out)]
    print(f"wrote {' '.join(map(q, paths))}")
    print(f"done in {duration(time.time() - started)}")
    return 0


# A folder holds one kind of thing, told by its first file; a run's other files are the run's too.
KINDS = {"config.json": "a run", "reproduce.json": "a --reproduce set",
         "benchmark.json": "a --benchmark's timings", "results.json": "a run",
         "checkpoint.pt": "a run"}


def take(out, first, config=None):
    """The folder --out for a command whose first file is `first`: held (hold) and claimed
    (claim), or refused in one line."""
    if holder := hold(out):
        raise ConfigError(f"{q(out)} is in use by {holder}, which still runs: wait for it to "
                          "end, or choose another --out")
    claim(out, first, config)


def claim(out, first, config=None):
    """Claim a folder for a command whose first file is `first`: refused if it holds another
    kind's files, or runs in its folders (but a set's, its rows), or a run when config is given,
    a new run's: its config.json, created at once, so that of two runs started at once on one
    folder, the second is refused."""
    files, subfolders = holding(out)
    if files and (config or KINDS[files[0]] != KINDS[first]):
        raise ConfigError(f"{q(out)} holds {kind_of(out, files)}, or choose another --out")
    if subfolders and first != "reproduce.json":
        raise ConfigError(f"{q(out)} holds runs in its folders, as {q(subfolders[0])}: choose "
                          "another --out")
    if not config:
        return
    try:
        with open(os.path.join(out, first), "x") as f:
            json.dump(config, f, indent=1)
    except FileExistsError:  # claimed since
        raise ConfigError(f"{q(out)} holds {kind_of(out, [first])}, or choose another "
                          "--out") from None


def holding(folder):
    """The files of KINDS in a folder, its first file first; and its folders that hold a run (a
    set's rows, or the runs in a folder like runs/)."""
    files = [name for name in KINDS if os.path.isfile(os.path.join(folder, name))]
    subfolders = os.scandir(folder) if os.path.isdir(folder) else []
    return files, sorted(e.name for e in subfolders
                         if os.path.isfile(os.path.join(e.path, "config.json")))


def kind_of(folder, files):
    """What a folder that holds these files of KINDS holds, and how to go on with it."""
    if files[0] == "config.json":
        return f"a run: continue it with --resume {q(folder)}"
    if files[0] == "reproduce.json":
        argv = read_run_file(folder, "reproduce.json")["argv"] + ["--out", folder]
        return f"a --reproduce set, a row in each folder: continue the set with: {command(argv)}"
    if files[0] == "benchmark.json":
        return ("a --benchmark's timings, which have no run to continue: run the --benchmark "
                "command again to time again")
    return f"{' and '.join(files)} of another run: move them out"


def make_folder(out):
    """The folder --out, made if need be: the folders made for it, deepest first. A file in its
    way, or no right to write, is bad input."""
    made, parent = [], os.path.abspath(out)
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(out, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--out {q(out)}: a file is in the way of this folder") from None
    except OSError as e:
        raise ConfigError(f"--out {q(out)}: cannot write there ({e.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"--out {q(out)}: cannot write there (no permission)")
    return made


HELD = {}  # the run folders this process holds: {real path: (its lock file, the folders made)}


def hold(folder):
    """Take the lock of a run folder, made if need be: None, or its holder (pid and host) if
    another live process has it. The system releases a lock when its process dies, so a live
    run's folder is told from an interrupted one's. A process takes a folder once (a --reproduce
    row, then its run), until release()."""
    key = os.path.realpath(folder)
    if key in HELD or fcntl is None:  # held already (a --reproduce row); Windows: no lock (README)
        make_folder(folder)
        return None
    made, lock = [], os.path.join(key, "lock")
    while True:
        made += make_folder(folder)
        try:
            f = open(lock, "a+")
        except FileNotFoundError:  # its folder removed as we made it, by a start that failed
            continue
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(f.fileno()), os.stat(lock)):
                break
        except BlockingIOError:  # a live process holds it: its line names it
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return holder
        except FileNotFoundError:
            pass
        f.close()  # its holder removed it as we took it: take the one there now
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    HELD[key] = (f, made)
    return None


def release(keys):
    """Give back the run folders of these keys of HELD: each lock file removed before its lock
    goes (so that the next holder takes a file of its own), and the folders made for it that
    are left empty (nothing ran)."""
    for key in keys:
        f, made = HELD.pop(key)
        with contextlib.suppress(FileNotFoundError):
            os.remove(f.name)
        f.close()
        for folder in made:  # deepest first: a folder that holds anything stays, and its parents
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def load_data_and_model(cfg):
    """The splits in the input range asked for, the backbone and its weights' path; if both the
    data and the weights are missing, one line says so, and on a resume how to continue with them
    where they lie now."""
    kind = vit.PRETRAINED_INPUT[cfg.weights] if cfg.input_range == "checkpoint" else cfg.input_range
    mean_std = vit.MEAN_STD.get(kind, (0.0, 1.0))  # unit: ToTensor's [0, 1] as it is
    try:
        splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size, *mean_std)
    except data.DataError as e:
        try:
            build_model(cfg)  # the weights too, so that one line names all that is missing
        except vit.CheckpointError as also:
            raise data.DataError(f"{e} And: {also}{moved(cfg, 'data_dir', 'weights')}") from None
        raise data.DataError(f"{e}{moved(cfg, 'data_dir')}") from None
    try:
        return (splits, *build_model(cfg))
    except vit.CheckpointError as e:
        raise vit.CheckpointError(f"{e}{moved(cfg, 'weights')}") from None


def moved(cfg, *names):
    """On a resume, the end of a line that cannot find the run's data or weights: the command that
    continues the run with them where they lie now."""
    paths = [word for name in names for word in (flag(name), "PATH")]
    return f" If they moved: {command(['--resume', cfg.resume, *paths])}" if cfg.resume else ""


def backbone_file(weights):
    """Which backbone a run started from: its file's path and the SHA-256 of its content."""
    return {"path": os.path.abspath(weights), "sha256": sha256(weights)} if weights else None


def sha256(*paths):
    """The SHA-256 of the files' contents, one after the other, read 1 MiB at a time."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(partial(f.read, 2**20), b""):
                digest.update(block)
    return digest.hexdigest()


def save_checkpoint(learner, record, cfg, backbone):
    """checkpoint.pt after a task: the learner, the seed's record and the generator, with the run's
    configuration and backbone; written whole or not at all (written)."""
    state = {"config": asdict(cfg), "backbone": backbone, "record": record,
             "kv": nn.ModuleList(lora_layers(learner.model)).state_dict(),  # W0, A and B
             "heads": [head.state_dict() for head in learner.heads],
             "V": learner.oe and learner.oe.V, "memory": learner.memory,
             "prototypes": learner.prototypes, "rng": torch.get_rng_state()}
    with written(os.path.join(cfg.out, "checkpoint.pt")) as tmp:
        torch.save(state, tmp)


def restore(learner, record, state, device):
    """A seed that an interruption stopped: the learner and record as save_checkpoint left them."""
    nn.ModuleList(lora_layers(learner.model)).load_state_dict(state["kv"])
    for head in state["heads"]:
        learner.heads.append(nn.Linear(*head["weight"].shape[::-1]).to(device))
        learner.heads[-1].load_state_dict(head)
    if learner.oe is not None:
        learner.oe.V = state["V"]
    learner.memory, learner.prototypes = state["memory"], state["prototypes"]
    record.update(state["record"])
    torch.set_rng_state(state["rng"].cpu())  # last: the heads above drew from it
    print(f"seed {record['seed']}: resumed after task {len(record['acc_matrix'])}", flush=True)


def previous(cfg, backbone):
    """A resumed run's finished seeds, and its checkpoint (None if none), as saved_run found them;
    the checkpoint refused unless its backbone has the same content (its file may have moved);
    then config.json takes the resume's config (its device, paths, more seeds)."""
    runs, state = finished(cfg.out), None
    if os.path.exists(os.path.join(cfg.out, "checkpoint.pt")):
        state = read_run_file(cfg.out, "checkpoint.pt", cfg.device)
    if state and (state["backbone"] or {}).get("sha256") != (backbone or {}).get("sha256"):
        theirs, ours = (f"{b['path']} (SHA-256 {b['sha256'][:16]}...)" if b else
                        "no file (random weights, or a named checkpoint)"
                        for b in (state["backbone"], backbone))
        raise ConfigError(f"{q(os.path.join(cfg.out, 'checkpoint.pt'))}: the run started from the "
                          f"backbone {theirs}, not {ours}: pass that file with --resume "
                          f"{q(cfg.out)} --weights PATH to continue it")
    config = read_run_file(cfg.out, "config.json")
    write_json(os.path.join(cfg.out, "config.json"), {**config, "config": asdict(cfg)})
    return runs, state


def unlike(saved, config):
    """The fields, fixed within a run, whose values in two saved configs differ."""
    return [k for k, v in config.items() if k not in RUN_FREE and saved.get(k) != v]


def differ(saved, cfg):
    """The flags whose values in a saved config differ from cfg's, of those fixed within a run."""
    return " ".join(map(flag, unlike(saved, asdict(cfg))))


def finished(folder):
    """The entries of the finished seeds in a folder's results.json (none if it has none)."""
    if not os.path.exists(os.path.join(folder, "results.json")):
        return []
    return read_run_file(folder, "results.json")["runs"]


def saved_run(folder):
    """The config.json of the run in a folder, for --resume, once the run's files are read and
    agree; a folder that holds no run, or beside it another kind's file, gets one line that says
    what it holds and what to do."""
    if not os.path.isdir(folder):
        raise ConfigError(f"--resume {q(folder)}: " + (
            "a file: name the run's folder, which holds its config.json" if os.path.exists(folder)
            else f"no such folder: check the path, or start a run there with --out {q(folder)}"))
    files, subfolders = holding(folder)
    if subfolders and not files:
        raise ConfigError(f"{q(folder)} holds no run, but its folders do: continue one, as "
                          f"--resume {q(os.path.join(folder, subfolders[0]))}")
    if not files:
        raise ConfigError(f"{q(folder)} holds no run: start one there with --out {q(folder)}")
    if KINDS[files[0]] != "a run":
        raise ConfigError(f"{q(folder)} holds {kind_of(folder, files)}")
    if stray := [name for name in files if KINDS[name] != "a run"]:
        raise ConfigError(f"{q(folder)} holds a run and, beside it, {stray[0]}, "
                          f"{KINDS[stray[0]]}: move {stray[0]} out of it to continue the run")
    read = {name: read_run_file(folder, name) for name in dict.fromkeys(["config.json", *files])}
    agree(folder, read)
    return read["config.json"]


def agree(folder, read):
    """Refuse a run's files (read: {name: content}) whose configurations disagree, in one line that
    names the one to put right. results.json and checkpoint.pt hold the configuration they were
    made with: where config.json differs from them, config.json was changed; where one of them
    differs from the other two, it came from another run. Their seeds are config.json's."""
    config, off = read["config.json"]["config"], {}
    for name, obj in read.items():
        names = unlike(obj["config"], config)
        if not set(obj["config"]["seeds"]) <= set(config["seeds"]):  # a seed config.json lacks
            names.append("seeds")
        if names:
            off[name] = names
    if not off:
        return
    name, names = next(iter(off.items()))  # results.json's first: its seeds are finished
    theirs, ours = shown(read[name]["config"], names), shown(config, names)
    if len(off) < len(read) - 1:  # the third file agrees with config.json
        raise ConfigError(f"{q(os.path.join(folder, name))} belongs to another run (its {theirs}, "
                          f"not config.json's {ours}): {RUN_FILES[name][1]}")
    raise ConfigError(f"{q(os.path.join(folder, 'config.json'))} has {ours}, not the {theirs} that "
                      f"{name} was made with: put that back in it to continue the run")


# What the program reads of each file of a run folder (a shape, see misfit), and what to do when a
# file is not so. A seed's record as new_record starts it; its entry in results.json, with metrics.
ROWS = [[(float, int, type(None))]]  # an accuracy matrix: a row a task; None: a task not yet seen
RECORD = {**{key: type(value) for key, value in new_record(0).items()}, "acc_matrix": ROWS,
          "task_aware": ROWS, "violation": {"k": list, "v": list}}
METRICS = {"ACC": float, "MAA": float, "BWT": (float, type(None))}  # BWT: None with one task
RUN_FILES = {
    "config.json": ({"argv": [str], "config": Config},
                    "restore it, or start the run again with another --out"),
    "results.json": ({"config": Config, "runs": [{**RECORD, **METRICS, "task_aware": {
                      "acc_matrix": ROWS, **METRICS}}]},
                     "restore it, or move it out of the folder (it keeps its seeds' numbers) to "
                     "run them again"),
    "checkpoint.pt": ({"config": Config, "backbone": (dict, type(None)), "record": RECORD,
                       "kv": dict, "heads": [dict], "V": (torch.Tensor, type(None)),
                       "memory": [torch.Tensor], "prototypes": torch.Tensor,
                       "rng": torch.Tensor},
                      "restore it, or move it out of the folder to run its seed again from its "
                      "first task"),
    "reproduce.json": ({"argv": [str]}, "delete it, and continue the set with its --reproduce "
                       "command")}


def read_run_file(folder, name, device="cpu"):
    """A file of a run folder (a checkpoint loaded on device), as RUN_FILES says it must be: its
    shape (misfit), and for the files that hold seeds, their records as run writes them
    (misrecorded); else one line that names the file and says what to do."""
    path = os.path.join(folder, name)
    shape, fix = RUN_FILES[name]
    try:
        if name.endswith(".pt"):
            obj = torch.load(path, map_location=device, weights_only=True)
        else:
            with open(path) as f:
                obj = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{q(path)} is missing: {fix}") from None
    except Exception as e:  # noqa: BLE001 -- torch's unpickler fails on a damaged file many ways
        json_error = isinstance(e, ValueError) and name.endswith(".json")  # says where, in a line
        said = f"is damaged ({e})" if json_error else f"cannot be read ({type(e).__name__})"
        raise ConfigError(f"{q(path)} {said}: {fix}") from None
    seeded = name in ("results.json", "checkpoint.pt")
    if problem := misfit(obj, shape) or (seeded and misrecorded(obj)):
        raise unwritten(folder, name, problem)
    return obj


def unwritten(folder, name, problem):
    """The error of a run file that is not as this program writes it: the problem, what to do."""
    return ConfigError(f"{q(os.path.join(folder, name))} is not as this program writes it "
                       f"({problem}): {RUN_FILES[name][1]}")


def misfit(value, shape, where=""):
    """What keeps a value read from a run file from its shape (None: nothing). A shape is a type,
    a tuple of shapes (any one), [shape] (a list of such), a dict (these keys at least, each of its
    shape), a frozenset (one of these names), or Config: a saved config, exactly its fields, each
    of saved_shape."""
    if isinstance(shape, tuple):
        problems = [misfit(value, s, where) for s in shape]
        return None if None in problems else problems[0]
    if isinstance(shape, frozenset):  # a flag's choices
        if isinstance(value, str) and value in shape:
            return None
        return f"{where} is {value!r}, not one of {', '.join(sorted(shape))}"
    if shape is Config:
        shape = {f.name: saved_shape(f) for f in fields(Config)}
        unknown = sorted(set(value) - set(shape)) if isinstance(value, dict) else []
        if unknown:  # Config(**value) would fail
            return f"{where} has {', '.join(unknown)}, which no flag sets"
    kind = type(shape) if isinstance(shape, (dict, list)) else shape
    if not isinstance(value, kind):
        return f"{where or 'it'} has type {type(value).__name__}, not {kind.__name__}"
    inner = []  # (value, shape, where) of what it holds
    if isinstance(shape, list):
        inner = [(v, shape[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(shape, dict):
        if lacks := [key for key in shape if key not in value]:
            return f"{where or 'it'} lacks {', '.join(lacks)}"
        inner = [(value[k], s, f"{where}.{k}" if where else k) for k, s in shape.items()]
    return next(filter(None, (misfit(*args) for args in inner)), None)


def saved_shape(f):
    """The shape of a Config field in a saved config: its flag's type (a float may be written as an
    int) or choices, a list of it for a list, None too where the default is None (configure fills
    it in)."""
    item = f.metadata.get("type", f.type)
    item = frozenset(choices(f)) if choices(f) else (float, int) if item is float else item
    kind = [item] if f.type is list else item
    return (kind, type(None)) if f.default is None else kind


def misrecorded(obj):
    """What keeps the seeds in results.json or checkpoint.pt from being as run writes them (None:
    nothing): seeds of its config, each once; each record as run_seed makes it after t of the
    config's T tasks (results.json: all T), an item a task in each list and accuracy rows of the
    tasks seen; and results.json's entries as results_entry makes them: rows padded with None to
    T, metrics those of the matrices."""
    T, seeds, done = obj["config"]["tasks"], obj["config"]["seeds"], "runs" in obj
    entries = {f"runs[{i}]": e for i, e in enumerate(obj["runs"])} if done else {
        "record": obj["record"]}
    ran = [e["seed"] for e in entries.values()]
    if not set(ran) <= set(seeds) or len(set(ran)) < len(ran):
        return f"its seeds {ran} are not among its config's seeds {seeds}, each once"
    for where, entry in entries.items():
        rows = {"acc_matrix": entry["acc_matrix"],
                "task_aware": entry["task_aware"]["acc_matrix"] if done else entry["task_aware"]}
        rows = {k: [row[:i + 1] for i, row in enumerate(m)] for k, m in rows.items()}  # unpadded
        record, t = {**entry, **rows}, len(rows["acc_matrix"])
        lists = [record[k] for k in RECORD if k not in ("seed", "violation")]
        lists += record["violation"].values()
        if not (1 <= t <= T and (t == T or not done) and all(len(v) == t for v in lists) and all(
                len(row) == i + 1 and None not in row for m in rows.values()
                for i, row in enumerate(m))):
            return (f"{where} is not a record of {'its' if done else '1 to'} {T} tasks: an item a "
                    "task in each list, accuracy rows of the tasks seen")
        made = results_entry(record, T) if done else record
        if changed := [k for k in entry if entry[k] != made[k]]:
            return f"{where}.{changed[0]} is not what its accuracy rows give"
    return None


def write_json(path, obj):
    write_file(path, json.dumps(obj, indent=1))


def write_file(path, text):
    """A text file written whole or not at all (written)."""
    with written(path) as tmp, open(tmp, "w") as f:
        f.write(text)


@contextlib.contextmanager
def written(path):
    """A file written whole or not at all: the caller writes the temporary file given, the
    process's own (the jobs of an array write table.md and reproduce.json at once), which is then
    renamed to path. If writing fails (a full disk, a lost mount), it is removed, and Unwritten
    says why."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch.save's, from its zip writer
        raise Unwritten(f"cannot write {q(path)} ({e})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def environment(cfg):
    """Where results.json's numbers come from: the versions, the device, the code; and the
    precision they ran in: bf16 autocast is CUDA's, so a CPU runs in fp32 whatever --precision
    says."""
    cuda = cfg.device.startswith("cuda")
    cpu = f"cpu ({torch.get_num_threads()} threads)"
    device = torch.cuda.get_device_name(cfg.device) if cuda else cpu
    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "device": device,
            "precision": f"{cfg.device} {cfg.precision if cuda else 'fp32'}",
            "compiled": compiled(cfg), "code": code_version()}


def code_version():
    """The code that ran: the SHA-256 of janus_min.py, vit.py and data.py, and git's commit of
    their folder, '-dirty' with changes not committed (None outside git, or without git)."""
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"],
                             cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                             text=True)
        commit = git.stdout.strip() if git.returncode == 0 else None
    except OSError:  # no git on this machine
        commit = None
    return {"sha256": sha256(__file__, vit.__file__, data.__file__), "git": commit}


# ---- Results: results.json's entries and the summary ---------------------------------------------
def results_entry(record, T):
    """A seed's entry of results.json: its record, with each accuracy matrix padded with None to T
    columns and given its metrics."""
    def matrix(acc):
        return {"acc_matrix": [row + [None] * (T - len(row)) for row in acc], **metrics(acc)}
    return {**record, **matrix(record["acc_matrix"]), "task_aware": matrix(record["task_aware"])}


def summarize(runs):
    """Over the seeds: the mean and the sample standard deviation (n - 1; None for one seed) of
    ACC, MAA, BWT, the accuracy over samples, and the task-aware three."""
    def stats(values):  # undefined (None) if any run's is, as BWT with one task
        if None in values:
            return {"mean": None, "std": None}
        return {"mean": statistics.fmean(values),
                "std": statistics.stdev(values) if len(values) > 1 else None}

    def three(entries):
        return {key: stats([e[key] for e in entries]) for key in ("ACC", "MAA", "BWT")}
    return {"std": "sample standard deviation over the seeds (n - 1); null for one seed",
            **three(runs), "sample_ACC": stats([r["sample_acc"][-1] for r in runs]),
            "task_aware": three([r["task_aware"] for r in runs])}


def print_summary(results):
    """The last seed's accuracy matrix, and the summary over the seeds."""
    last, s = results["runs"][-1], results["summary"]
    print(f"accuracy (%) on each task (columns) after each task (rows), seed {last['seed']}:")
    print("after task | " + " ".join(f"task {i + 1:<2d}" for i in range(len(last["acc_matrix"]))))
    for t, row in enumerate(last["acc_matrix"]):
        print(f"{t + 1:10d} | " + " ".join(f"{fmt(a, '.1f'):>7s}" for a in row))
    stats = [f"{k} {fmt(s[k]['mean'])}" + ("" if s[k]["std"] is None else f" +- {s[k]['std']:.2f}")
             for k in ("ACC", "MAA", "BWT", "sample_ACC")]
    print("  ".join(stats) + f"  over {len(results['runs'])} seed(s); task-aware ACC "
          f"{s['task_aware']['ACC']['mean']:.2f}")
    print("ACC: the mean accuracy on the tasks after the last; MAA: its mean over the run; BWT: "
          "the mean change of a task's accuracy from its end to the run's (< 0: forgetting); +-: "
          "the sample std over seeds")


# ---- Plots, with matplotlib where it is installed ------------------------------------------------
def plot(results, out):
    """trajectory.png (Fig. 5) of all seeds; violation.png (Fig. 2) and angular.png (Fig. 3) of the
    first seed. Returns their paths (none without matplotlib)."""
    if not (Figure := figure_class()):
        return []
    c, runs, paths = results["config"], results["runs"], []
    for draw in (plot_trajectory, plot_violation, plot_angular):
        fig = Figure(figsize=(13, 4.4), layout="constrained")
        seed = "" if draw is plot_trajectory else f", seed {runs[0]['seed']}"
        fig.suptitle(f"{c['dataset']}, T={c['tasks']}, {describe(c)}{seed}", fontsize=9)
        draw(fig, runs)
        for ax in fig.axes:  # a legend where there is something to name, beside the panel: on
            if ax.get_legend_handles_labels()[0]:  # it, it would cover bars or points
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
        paths.append(os.path.join(out, draw.__name__.removeprefix("plot_") + ".png"))
        fig.savefig(paths[-1], dpi=120)
    return paths


def figure_class():
    """matplotlib's Figure (not pyplot: no window, no global state), or None, said in a line,
    where matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plots (results.json has the numbers)")
        return None
    return Figure


def seen_curves(entries):
    """(seeds, T): each seed's mean accuracy on the tasks seen so far, after each task (Fig. 5),
    from its accuracy matrix."""
    return torch.tensor([[mean(row[:t + 1]) for t, row in enumerate(e["acc_matrix"])]
                         for e in entries], dtype=torch.float64)  # as results.json's


def plot_trajectory(fig, runs):
    """Fig. 5: the mean accuracy on the tasks seen so far, after each task."""
    ax = fig.subplots()
    for label, entries in (("task-agnostic (the paper's)", runs),
                           ("task-aware (ours)", [r["task_aware"] for r in runs])):
        curves = seen_curves(entries)
        x = list(range(1, curves.shape[1] + 1))
        ax.plot(x, curves.mean(0), "o-", label=f"{label}, mean of {len(curves)} seed(s)")
        if len(curves) > 1:
            ax.fill_between(x, curves.min(0).values, curves.max(0).values, alpha=0.2,
                            label="its min-max over the seeds")
    ax.set(xlabel="task", ylabel="mean accuracy on the tasks seen (%)", xticks=x)


def plot_violation(fig, runs):
    """Fig. 2 per block, mean over tasks 2..T: the share of each task's update on the memory; and
    the change it makes to the past tasks' outputs, beside the current task's own."""
    run = runs[0]
    if len(run["interference"]) < 2:
        return fig.text(0.5, 0.5, "one task: no memory to protect yet, nothing to show",
                        ha="center")
    inter = [i for i in run["interference"] if i]
    left, right = fig.subplots(1, 2)
    for j, n in enumerate("kv"):  # each block's K and V side by side; layer j of block j // 2
        for ax, tasks in ((left, run["violation"][n]), (right, [i["past"][j::2] for i in inter])):
            means = [mean(col) for col in zip(*tasks)]  # per block; task 1's violation: None
            x = [b + 0.8 + 0.4 * j for b in range(len(means))]
            if any(m is not None for m in means):
                ax.bar(x, [m or 0 for m in means], 0.4, label=n.upper())
        right.plot(x, [mean(col) for col in zip(*[i["current"][j::2] for i in inter])],
                   "k" + "_x"[j], ms=7,  # K's mark a dash, V's a cross
                   label=f"{n.upper()} on the current task's inputs (reference)")
    if not left.patches:  # no bar: every violation undefined
        left.text(0.5, 0.5, "nothing to measure:\nno memory M (Fine-Tuning keeps none),\nor no "
                  "update", transform=left.transAxes, ha="center", va="center")
    for ax, name, ylabel in (
            (left, "against the memory M", "share of the update on M: ||dW M|| / ||dW||"),
            (right, "on the past tasks' test inputs X",
             "RMS change of their outputs: ||X dW^T|| / sqrt(n)")):
        ax.set(xlabel="block", xticks=range(1, len(x) + 1), ylabel=ylabel,
               title=f"{name} (mean over tasks 2..T)")
    fig.supxlabel("dW = s B A: a task's LoRA update of K or V; M: the memory it was to stay off; "
                  "X: the past tasks' K/V inputs, n tokens", fontsize=8)


def plot_angular(fig, runs):
    """Fig. 3 and the appendix's density: the last task's test samples, cos_old against cos_own,
    and each task's density of cos_old (DML pushes it below the margin)."""
    tasks = [(t + 1, g) for t, g in enumerate(runs[0]["geometry"]) if g]
    if not tasks:
        return fig.text(0.5, 0.5, "one task: no old prototypes yet, nothing to show",
                        ha="center")
    left, right = fig.subplots(1, 2)
    t, g = tasks[-1]
    values = g["cos_old"] + g["cos_own"] + [0.5]  # the danger zone's line stays in view
    lims = (min(values) - 0.05, max(values) + 0.05)  # past the points: a cosine of 1 stays whole
    left.scatter(g["cos_old"], g["cos_own"], s=6, alpha=0.5)
    left.plot(lims, lims, "k--", lw=0.8, label=f"below: closer to old, {g['closer_to_old']:.3f}")
    left.axvline(0.5, color="red", ls="--", label=f"danger zone, {g['danger']:.3f}")
    left.set(xlabel="cos_old: largest cosine to an old prototype", xlim=lims, ylim=lims,
             ylabel="cos_own: cosine to its own prototype", title=f"task {t}'s test samples")
    width = 2 / len(g["hist"])  # dml_geometry's bins over [-1, 1]
    for k, (t, g) in enumerate(tasks):  # each its marker and line style: equal lines stay seen
        right.plot([-1 + width * (i + 0.5) for i in range(len(g["hist"]))], g["hist"],
                   marker="osD^v<>"[k % 7], ls=("-", "--", ":", "-.")[k % 4], mfc="none", ms=5,
                   label=f"task {t}")
    right.set(xlabel="cos_old", ylabel="share of the task's test samples", title="cos_old per task")
    fig.supxlabel("prototype: a class's mean unit feature; danger zone (the paper's Fig. 3): "
                  "cos_old > 0.5, a sample close to an old class", fontsize=8)


# ---- The paper's figures of a --reproduce set (SET_FIGURES), from its rows' results.json ---------
def plot_set(cfg, out, rows, done, missing):
    """The figures that the paper draws of the set (SET_FIGURES) into out, from `done`, the
    finished rows' results.json ({row: its results}); each title names the rows `missing`.
    Returns their paths (none without matplotlib, or without a finished row)."""
    figures = SET_FIGURES.get(cfg.reproduce, ())
    if not (figures and done and (Figure := figure_class())):
        return []
    c = next(iter(done.values()))["config"]  # the set's rows share the data set and T
    seeds = "/".join(map(str, sorted({len(r["runs"]) for r in done.values()})))
    left_out = f"\nnot finished, not drawn: {', '.join(missing)}" if missing else ""
    paths = []
    for title, draw in figures:
        fig = Figure(figsize=(13, 4.4), layout="constrained")
        fig.suptitle(f"{title}\n{c['dataset']}, T={c['tasks']}, {c['epochs']} epoch(s) a task, "
                     f"{seeds} seed(s) a row{left_out}", fontsize=9)
        draw(fig, rows, done)
        handles, labels = fig.axes[0].get_legend_handles_labels()  # the others draw the same rows
        if handles:  # beside the panels: on one, it would cover lines or bars
            fig.legend(handles, labels, loc="outside right upper", fontsize=7)
        paths.append(os.path.join(out, draw.__name__.removeprefix("plot_") + ".png"))
        fig.savefig(paths[-1], dpi=120)
    return paths


def row_label(row, flags, config):
    """A row's name in a figure: the paper's name of its method, or its own flags."""
    name = describe(config)
    return f"{row}: {flags if name.startswith('custom') else name}"


def row_style(i):
    """The colour, marker and line style of a set's i-th row, the same in every panel; hollow
    markers and four line styles keep rows with equal values seen."""
    return dict(color=f"C{i % 10}", marker="osD^v<>ph*"[i % 10], ls=("-", "--", ":", "-.")[i % 4],
                mfc="none", ms=5)


def plot_trajectories(fig, rows, done):
    """Fig. 5: each row's mean accuracy on the tasks seen, after each task, task-agnostic (the
    paper's) and task-aware; the mean over its seeds, a band of ± their sample std (n - 1). And
    beside them Fig. 2 on real inputs: what each row's updates did to the past tasks' outputs."""
    *axes, change = fig.subplots(1, 3, width_ratios=(3, 3, 2))
    axes[1].sharey(axes[0])
    plot_output_change(change, rows, done)
    for i, (row, r) in enumerate(done.items()):
        label = row_label(row, rows[row], r["config"])
        for ax, entries in zip(axes, (r["runs"], [run["task_aware"] for run in r["runs"]])):
            curves = seen_curves(entries)  # (seeds, T)
            x, m = range(1, curves.shape[1] + 1), curves.mean(0)
            ax.plot(x, m, label=label, **row_style(i))
            if len(curves) > 1:  # a std needs two seeds
                s = curves.std(0)  # torch's default: the sample std
                ax.fill_between(x, m - s, m + s, color=row_style(i)["color"], alpha=0.15, lw=0)
    for ax, name in zip(axes, ("task-agnostic (the paper's):\nthe argmax over all heads",
                               "task-aware (ours):\nthe true task's head")):
        ax.set(xlabel="after task", xticks=x)
        ax.set_title(name, fontsize=9)
        label_ends(ax, ".2f")
    axes[0].set(ylabel="mean accuracy on the tasks seen (%)")
    fig.supxlabel("line: the mean over a row's seeds, its last value at its end; band, with two "
                  "seeds or more: ± their sample std; bars: the means over tasks 2..T, the K/V "
                  "layers and the seeds", fontsize=8)


def plot_output_change(ax, rows, done):
    """Fig. 2 on real inputs, a pair of bars a row: the RMS change that its tasks' updates made to
    the K/V outputs of the past tasks' test images (filled), and of the current task's (hatched),
    on a log scale, as they differ by orders of magnitude where a memory keeps the past."""
    for i, (row, r) in enumerate(done.items()):
        changes = [mean([v for run in r["runs"] for task in run["interference"] if task
                         for v in task[inputs]]) for inputs in ("past", "current")]
        bars = ax.bar([i - 0.2, i + 0.2], [nan(c) for c in changes], 0.4,
                      color=row_style(i)["color"], edgecolor="k", lw=0.5)
        bars[1].set_hatch("//")
        # Horizontal values would run into their neighbours' once a set has more than a few rows.
        ax.bar_label(bars, [fmt(c, ".2g") for c in changes], padding=2, fontsize=7, rotation=90)
    ax.set(yscale="log", xticks=range(len(done)), ylabel="RMS change of the K/V outputs")
    ax.set_xticklabels([row.replace("-", "-\n") for row in done], fontsize=8)
    ax.set_title("Fig. 2 on real inputs: the test\nimages of the past tasks (filled),\nof the "
                 "current task (hatched)", fontsize=9)
    ax.margins(y=0.3)  # room for the values above the bars


def plot_sweep(fig, rows, done):
    """Fig. 4a, 4b and the appendix's lambda: ACC and MAA, and BWT, over the value that the rows
    sweep, each the mean over the seeds with ± their sample std (n - 1) as error bars."""
    key = next(iter(parse(rows[next(iter(done))].split())[1]))  # the one flag of each row
    x = [r["config"][key] for r in done.values()]
    stats = [summarize(r["runs"]) for r in done.values()]
    left, right = fig.subplots(1, 2)
    for ax, metric, style in ((left, "ACC", "o-C0"), (left, "MAA", "s--C1"),
                              (right, "BWT", "D-C2")):  # BWT's colour its own
        ax.errorbar(x, [nan(st[metric]["mean"]) for st in stats], capsize=4, fmt=style,
                    yerr=[nan(st[metric]["std"]) for st in stats], label=metric)
    meaning = next(f.metadata["help"] for f in fields(Config) if f.name == key).split(";")[0]
    for ax, ylabel in ((left, "accuracy (%)"), (right, "BWT (percentage points; < 0: forgetting)")):
        ax.set(xlabel=f"{flag(key)}: {meaning}", xticks=x, ylabel=ylabel)
    left.set(title="ACC: on all tasks after the last; MAA: its mean over the run")
    right.set(title="BWT: the mean change of a task's accuracy from its end to the run's")
    fig.supxlabel("point: the mean over a row's seeds; error bar, with two seeds or more: ± their "
                  "sample std", fontsize=8)


def plot_gr_plugin(fig, rows, done):
    """Fig. 6: ACC, MAA and BWT of each row, before GR and after, a bar each: the mean over its
    seeds, ± their sample std (n - 1), its value, and after the first its change from it."""
    names = [row_label(row, rows[row], r["config"]).replace(": ", "\n") for row, r in done.items()]
    for ax, metric in zip(fig.subplots(1, 3), ("ACC", "MAA", "BWT")):
        stats = [summarize(r["runs"])[metric] for r in done.values()]
        first = nan(stats[0]["mean"])
        for i, s in enumerate(stats):
            change = nan(s["mean"]) - first  # NaN where one is undefined: BWT of one task
            text = fmt(s["mean"]) + (f" ({change:+.2f})" if i and math.isfinite(change) else "")
            bars = ax.bar(i, nan(s["mean"]), yerr=s["std"], capsize=4, color=row_style(i)["color"])
            ax.bar_label(bars, [text], padding=3, fontsize=8)
        ax.axhline(0, color="k", lw=0.8)
        ax.margins(y=0.15)  # room for the values above the bars
        lo, hi = ax.get_ylim()
        if hi - lo < 1:  # bars of 0, as a BWT with nothing forgotten: an axis, not round-off's
            ax.set_ylim(lo - 1, hi + 1)
        ax.set(xticks=range(len(names)), xticklabels=names, title=metric,
               ylabel="BWT (percentage points; < 0: forgetting)" if metric == "BWT"
               else f"{metric} (%)")
    fig.supxlabel("bar: the mean over a row's seeds, its value above it, in brackets its change "
                  "from the first; error bar, with two seeds or more: ± their sample std",
                  fontsize=8)


def plot_efficiency(fig, rows, done):
    """The appendix's efficiency figures: each row's training time per task, its cumulative time
    and its throughput each epoch, the means over its seeds."""
    per_task, total, speed = fig.subplots(1, 3)
    for i, (row, r) in enumerate(done.items()):
        seconds = torch.tensor([run["task_seconds"] for run in r["runs"]],
                               dtype=torch.float64).mean(0)  # (T,)
        speeds = torch.tensor([[v for task in run["throughput"] for v in task]
                               for run in r["runs"]], dtype=torch.float64).mean(0)  # (T epochs,)
        x = range(1, len(seconds) + 1)
        per_task.plot(x, seconds, label=row_label(row, rows[row], r["config"]), **row_style(i))
        total.plot(x, seconds.cumsum(0), **row_style(i))
        speed.plot(range(1, len(speeds) + 1), speeds, **row_style(i))
    label_ends(total, ".1f")
    per_task.set(xlabel="task", xticks=x, ylabel="training time (s)", title="per task")
    total.set(xlabel="after task", xticks=x, ylabel="training time so far (s)",
              title="cumulative, its total at its end")
    speed.set(xlabel="epoch of the run: task 1's epochs, then task 2's, ...",
              ylabel="throughput (images / s)", title="throughput each epoch")
    speed.locator_params(axis="x", integer=True)
    fig.supxlabel("each the mean over a row's seeds; a task's time: its training and the "
                  "method's own passes (OE's, GPM's), not its evaluation", fontsize=8)


def nan(value):
    """A value for matplotlib, which leaves NaN out: None, undefined, as NaN."""
    return math.nan if value is None else value


def label_ends(ax, spec):
    """Each line's last value written at its end, in its colour, inside the frame: texts closer
    than a text's height are moved apart, up from the lowest, then down from the frame's top."""
    lo, hi = ax.get_xlim()
    ax.set_xlim(right=hi + 0.25 * (hi - lo))  # room for the texts: a fifth of the frame
    lo, hi = ax.get_ylim()
    gap = 0.05 * (hi - lo)  # a 7-pt text is about 4 % of a panel of a 4.4-inch figure
    lines = sorted(ax.lines, key=lambda line: line.get_ydata()[-1])
    y = [line.get_ydata()[-1] for line in lines]
    for i in range(1, len(y)):
        y[i] = max(y[i], y[i - 1] + gap)
    y[-1] = min(y[-1], hi - gap / 2)
    for i in reversed(range(len(y) - 1)):
        y[i] = min(y[i], y[i + 1] - gap)
    for line, at in zip(lines, y):
        x, value = line.get_xydata()[-1]
        ax.annotate(format(value, spec), (x, at), xytext=(6, 0), textcoords="offset points",
                    va="center", color=line.get_color(), fontsize=7, annotation_clip=False)


# ---- --benchmark: the time of a step -------------------------------------------------------------
BENCHMARKED = {"plain": "--method finetune", "janus-grad": "--method janus",
               "janus-update": "--method janus --rectify update"}  # plain LoRA; GR two ways


def benchmark(cfg):
    """Plain LoRA and Janus-LoRA (GR on the gradients, and ours on Adam's step), whatever --method
    says: a step of each in turn on one random batch, and the median of the per-round ratios."""
    out = cfg.out or os.path.join("runs", f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}")
    take(out, "benchmark.json")  # before the timing: a bad --out must not lose it
    cuda = cfg.device.startswith("cuda")
    sync = torch.get_device_module(cfg.device).synchronize  # CUDA's kernels run asynchronously
    classes = data.DATASETS[cfg.dataset]["num_classes"] // cfg.tasks
    backbone, _ = build_model(replace(cfg, weights="none"))  # random weights: the same cost
    m = min(cfg.k * (cfg.tasks // 2), backbone.embed_dim - cfg.k)  # the memory at mid-run
    images = torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, device=cfg.device)
    y = torch.randint(0, classes, (cfg.batch_size,), device=cfg.device)
    steps, peak_mb, ms = {}, dict.fromkeys(BENCHMARKED), {name: [] for name in BENCHMARKED}
    for name, flags in BENCHMARKED.items():  # built and warmed up one by one: each one's memory
        preset = Config(**parse(flags.split())[0])
        vcfg = replace(cfg, **{s: getattr(preset, s) for s in SWITCHES})
        if cuda:  # its own memory: the peak above what the variants before it hold
            held = torch.cuda.memory_allocated(cfg.device)
            torch.cuda.reset_peak_memory_stats(cfg.device)
        learner = mid_run_learner(vcfg, backbone, m, classes)
        steps[name] = partial(train_step, learner, adam(learner, vcfg), images, y, vcfg)
        for _ in range(5):  # warm-up: the allocator, kernels, Adam's state
            steps[name]()
        if cuda:
            peak_mb[name] = (torch.cuda.max_memory_allocated(cfg.device) - held) / 2**20
    for _ in range(cfg.steps):
        for name, step in steps.items():
            sync(cfg.device)
            start = time.perf_counter()
            step()
            sync(cfg.device)  # a step's time ends when its kernels do
            ms[name].append(1e3 * (time.perf_counter() - start))
    report = {name: dict(ms_per_step=statistics.median(t), peak_mb=peak_mb[name],
                         images_per_s=1e3 * cfg.batch_size / statistics.median(t),
                         x_plain=statistics.median(a / p for a, p in zip(t, ms["plain"])))
              for name, t in ms.items()}
    env = environment(cfg)
    print(f"{cfg.model}, batch {cfg.batch_size}, {cfg.img_size} px, memory {m} columns a block, "
          f"{env['precision']}, compiled {env['compiled']}, {cfg.steps} rounds:\n"
          "variant        ms/step  images/s  peak MiB  x plain (median)")
    for name, r in report.items():
        print(f"{name:14s} {r['ms_per_step']:7.1f} {r['images_per_s']:9.1f} "
              f"{fmt(r['peak_mb'], '9.0f'):>9s} {r['x_plain']:8.3f}")
    write_json(os.path.join(out, "benchmark.json"),
               {"config": asdict(cfg), "environment": env, "variants": report})
    print(f"wrote {q(os.path.join(out, 'benchmark.json'))}")
    return 0


def mid_run_learner(cfg, backbone, m, classes):
    """A learner halfway through a run: a random memory of m columns a block, V and A off it, old
    prototypes, and the current task's head."""
    learner = start_learner(cfg, 0, backbone)
    L, D = len(backbone.blocks), backbone.embed_dim
    if cfg.oe:
        learner.memory = list(torch.linalg.qr(torch.randn(L, D, m)).Q.to(cfg.device))
        if learner.oe is not None:  # GPM's memory comes with no OE basis
            learner.oe.V = fresh_basis(stack_blocks(learner.memory), cfg.k)
        for j, layer in enumerate(lora_layers(learner.model)):
            layer.reset_(learner.memory[j // 2])
    prototypes = F.normalize(torch.randn(classes * (cfg.tasks // 2), D), dim=1)
    learner.prototypes = prototypes.to(cfg.device)
    start_task(learner, 0, [list(range(classes))], None, cfg)
    return learner


# ---- --reproduce: every row of a table or figure of the paper, in one command --------------------
# NAME: (what it reproduces, {row: its flags}), the sweeps' values as the paper names them (README)
REPRODUCE = {
    "demo": ("the quick start (ours): Janus-LoRA beside Fine-Tuning, and with GR on Adam's step",
             {"finetune": "--method finetune", "janus": "--method janus",
              "janus-update": "--method janus --rectify update"}),
    "ablation": ("Table 1: OE, GR, DML on and off (rows 1-7)", dict(zip("1234567", [
        "--no-oe --no-gr --no-dml", "--no-oe --no-gr", "--no-gr --no-dml", "--no-oe --no-dml",
        "--no-dml", "--no-gr", ""]))),
    "methods": ("Tables 2 and 3: the methods we implement",
                {m: f"--method {m}" for m in ("finetune", "lora-gpm", "inflora", "janus")}),
    "oe-vs-gpm": ("Table 5: OE against GPM in one epoch (Janus-LoRA otherwise; our reading)",
                  {"gpm": "--memory gpm --epochs 1", "oe": "--epochs 1"}),
    "gr-plugin": ("Fig. 6: GR as a plug-in to LoRA-GPM",
                  {m: f"--method {m}" for m in ("lora-gpm", "lora-gpm-gr")}),
    "k": ("Fig. 4a: the rank k of the OE basis", {f"k{v}": f"--k {v}" for v in (25, 50, 75, 100)}),
    "margin": ("Fig. 4b: the DML margin m",
               {f"m{v}": f"--margin {v}" for v in (0.1, 0.2, 0.3, 0.4, 0.5)}),
    "lambda": ("the appendix's figure: the DML weight lambda",
               {f"l{v}": f"--lambda-dml {v}" for v in (0.5, 1.0, 1.5, 2.0)}),
    "backbones": ("Table 4: Janus-LoRA on other pre-trainings",
                  {w: f"--weights {w}" for w in ("in21k", "sam", "dino")}),
}
# NAME: the figures the paper draws of it (title, function); the appendix's times for every set
# whose rows are several methods (they differ in SWITCHES). Table 4 and 5 are tables alone.
FIG5 = ("Fig. 5: the mean accuracy on the tasks seen, after each task; and Fig. 2's measure on "
        "real inputs", plot_trajectories)
TIMES = ("the appendix's efficiency figures: per-task and cumulative training time, throughput",
         plot_efficiency)
SET_FIGURES = {
    "demo": (FIG5, TIMES), "ablation": (FIG5, TIMES), "methods": (FIG5, TIMES),
    "oe-vs-gpm": (TIMES,),
    "gr-plugin": (("Fig. 6: ACC, MAA and BWT before and after GR", plot_gr_plugin), TIMES),
    "k": (("Fig. 4a: ACC, MAA and BWT over the rank k of the OE basis", plot_sweep),),
    "margin": (("Fig. 4b: ACC, MAA and BWT over the DML margin m", plot_sweep),),
    "lambda": (("the appendix's lambda figure: ACC, MAA and BWT over the DML weight lambda",
                plot_sweep),),
}


def reproduce(cfg, typed):
    """Each row into OUT/<row>/ with the flags typed and the row's own: a row that another live
    process holds is left to it, a finished row skipped, an interrupted one continued; a row run
    with other flags is refused. Then table.md and the paper's figures of the rows finished."""
    what, rows = REPRODUCE[cfg.reproduce]
    out = cfg.out = cfg.out or os.path.join("runs", f"{cfg.reproduce}-{cfg.dataset}-T{cfg.tasks}")
    common = to_argv({k: v for k, v in typed.items() if k not in ("reproduce", "row", "dry_run",
                                                                  "out")})
    print(f"--reproduce {cfg.reproduce}: {what}; {len(rows)} rows on {cfg.dataset}, T={cfg.tasks}, "
          f"into {q(out)}")
    claim(out, "reproduce.json")  # not held: the jobs of an array share it, each holds its row
    for row in [cfg.row] if cfg.row else rows:
        folder = os.path.join(out, row)
        if not cfg.dry_run and (holder := hold(folder)):  # until main ends; run() finds it held
            print(f"{row}: {q(folder)} is in use by {holder}: skipped, that process runs it")
            continue
        argv = common + rows[row].split() + ["--out", folder]
        if os.path.exists(os.path.join(folder, "config.json")):
            saved = saved_run(folder)["config"]
            if other := differ(saved, configure(argv)[0]):
                raise ConfigError(f"row {row}: {q(folder)} was run with other {other}; choose "
                                  "another --out, or remove that folder")
            if set(cfg.seeds) <= {r["seed"] for r in finished(folder)}:
                print(f"{row}: finished, skipped")
                continue
            free = {k: v for k, v in parse(argv)[1].items() if k in RESUME_FREE}  # --device...
            argv = ["--resume", folder, *to_argv(free)]
        print(f"{row}: {command(argv)}", flush=True)
        if cfg.dry_run:
            continue
        try:
            run(*configure(argv))
        except (ConfigError, vit.CheckpointError, data.DataError, Diverged) as e:
            raise type(e)(f"row {row}: {without_fixes(str(e), rows[row])}") from None
        finally:  # once a row has run, --resume OUT names the command that continues the set
            if os.path.exists(os.path.join(folder, "config.json")):
                write_json(os.path.join(out, "reproduce.json"),
                           {"argv": reproduce_argv(cfg, typed)})
    if not cfg.dry_run:
        write_set(cfg, out, rows)
    return 0


def write_set(cfg, out, rows):
    """table.md and the paper's figures of the set from its finished rows' results.json (with
    --row, or a row held elsewhere, some may not have run): those not finished are named."""
    done = {row: read_run_file(os.path.join(out, row), "results.json") for row in rows
            if os.path.exists(os.path.join(out, row, "results.json"))}  # once a seed finished
    missing = [row for row in rows if row not in done]
    paths = [write_table(cfg, out, rows, done, missing), *plot_set(cfg, out, rows, done, missing)]
    left_out = f" (rows not finished, left out: {', '.join(missing)})" if missing else ""
    print(f"wrote {' '.join(map(q, paths))}{left_out}")


# What table.md's columns measure, below it.
TABLE_NOTE = """\
ACC, MAA, BWT: Sec. 4.1's, task-agnostic as the paper's (the argmax over all seen tasks' heads);
task-aware: the true task's head alone. Output change: the RMS change that each task's LoRA update
makes to the K/V outputs of the past tasks' test inputs, and of the current task's (Fig. 2 on real
inputs; the mean over tasks 2..T, the K/V layers and the seeds): the method keeps the first small
and the second not. Violation: the share of each update on the memory M, ||dW M|| / ||dW|| (Fig.
2). Danger share: the test samples closer than 0.5 in cosine to an old prototype (Fig. 3). s /
task: a task's training time. The accuracy over all test samples, InfLoRA's logs' (the ACC where
the tasks' test sets are of one size), is results.json's summary's sample_ACC. With random weights
(--weights none) the features do not tell the tasks apart until K and V adapt to them, so the
task-agnostic ACC and BWT follow how far each method moves the current task's outputs, as much as
what it forgets: read them beside the task-aware columns and the output change."""


def write_table(cfg, out, rows, done, missing):
    """table.md: each finished row's metrics, task-agnostic and task-aware (mean ± sample std over
    seeds), the output change of the past tasks' inputs and the current task's, the analyses and
    the time; what they measure below it. Returns its path."""
    left_out = f" Rows not finished, left out: {', '.join(missing)}." if missing else ""
    lines = [f"# --reproduce {cfg.reproduce}: {REPRODUCE[cfg.reproduce][0]}",
             f"{cfg.dataset}, T = {cfg.tasks}; mean ± sample std over seeds; the paper's: README."
             + left_out, "",
             "| row | flags | seeds | ACC | MAA | BWT | task-aware ACC | task-aware BWT | output "
             "change, past tasks | output change, current task | violation | danger share | "
             "s / task |", "|" + "---|" * 13]
    for row, results in done.items():
        runs, s = results["runs"], summarize(results["runs"])
        violations = [v for r in runs for n in "kv" for task in r["violation"][n] for v in task]
        change = [mean([v for r in runs for i in r["interference"] if i for v in i[inputs]])
                  for inputs in ("past", "current")]  # task 1's: None, no past tasks
        cells = [row, f"`{rows[row] or '(none)'}`", len(runs),
                 *[fmt(m["mean"]) + ("" if m["std"] is None else f" ± {m['std']:.2f}") for m in
                   (s["ACC"], s["MAA"], s["BWT"], s["task_aware"]["ACC"], s["task_aware"]["BWT"])],
                 *[fmt(c, ".3g") for c in change], fmt(mean(violations), ".2e"),
                 fmt(mean([g["danger"] for r in runs for g in r["geometry"] if g]), ".3f"),
                 fmt(mean([x for r in runs for x in r["task_seconds"]]), ".1f")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    text = "\n".join(lines + ["", TABLE_NOTE])
    write_file(os.path.join(out, "table.md"), text + "\n")
    print(text)
    return os.path.join(out, "table.md")


def without_fixes(message, flags):
    """An error's message without the fixes (", or ..." clauses) that name one of a row's own flags,
    which the user cannot change for that row."""
    said, *fixes = message.split(", or ")
    own = [rf"{flag(name)}\b" for name in parse(flags.split())[1]]
    return ", or ".join([said, *[f for f in fixes if not any(re.search(r, f) for r in own)]])


def reproduce_argv(cfg, typed):
    """The flags of a --reproduce command as typed, its paths absolute, but --out and --dry-run:
    with --out, the command that continues the set from any folder."""
    return to_argv({k: getattr(cfg, k) for k in typed if k not in ("out", "dry_run")})


def command(argv):
    """The shell command that runs this program with argv from the current folder: the script by
    its path from here, or its absolute path outside it."""
    here = os.path.join(os.path.realpath(os.getcwd()), "")
    return shlex.join(["python", os.path.realpath(__file__).removeprefix(here), *argv])


def interrupt(signum, frame):
    """Ctrl-C, and SIGTERM (a scheduler's at a time limit or a pre-emption): the command stops,
    once: the signals that follow are ignored to the process's end, lest a second Ctrl-C break the
    line that says how to go on."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt(signum)


def main(argv=None):
    """python janus_min.py [flags] (see --help): bad input and a diverged loss end in one line that
    says what to do (exit 2); Ctrl-C, SIGTERM and an output whose reader has gone (| head) in the
    command that continues (130, 143, 141), as does a file that cannot be written (exit 1);
    anything else is a bug, and keeps its traceback. At its end the folders it holds are
    released, its loader workers ended, and the signals' handlers restored unless a signal came
    (interrupt)."""
    cfg = None
    held = set(HELD)
    handlers = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cfg, typed = configure(argv)  # None: sys.argv's
        if cfg.benchmark:
            return benchmark(cfg)
        return reproduce(cfg, typed) if cfg.reproduce else run(cfg, typed)
    except (ConfigError, vit.CheckpointError, data.DataError, Diverged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, BrokenPipeError, Unwritten) as e:
        if isinstance(e, BrokenPipeError):  # the reader of the output has gone: as at SIGPIPE
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the rest: nowhere
            e = KeyboardInterrupt(signal.SIGPIPE)
        if cfg and cfg.reproduce:
            then = "continue the set with: " + command(reproduce_argv(cfg, typed) +
                                                       ["--out", cfg.out])
        elif cfg and cfg.out and os.path.exists(os.path.join(cfg.out, "config.json")):
            then = "continue with: " + command(["--resume", cfg.out])
        else:
            then = "nothing was saved"
        if isinstance(e, Unwritten):
            print(f"error: {e}: {then}", file=sys.stderr)
            return 1
        signum = e.args[0] if e.args else signal.SIGINT  # SIGTERM: see interrupt
        print(f"\ninterrupted ({signal.Signals(signum).name}): {then}", file=sys.stderr)
        return 128 + signum  # the shell's code of a process that a signal ended
    finally:
        release(set(HELD) - held)
        data.end_workers()
        for s, handler in handlers.items():  # after a signal, those that follow stay ignored
            if signal.getsignal(s) is interrupt:
                signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
