"""Janus-LoRA, minimal: class-incremental learning with a frozen ViT and LoRA on its K and V
layers, kept stable by Online Estimation (OE) and Gradient Rectification (GR), and kept plastic
by the Decoupled Margin Loss (DML). Equations are numbered as in the paper's LaTeX source.

How to read it. Part 1 reads top-down with the paper open: the notation, the settings (Config),
what a learner carries (Learner), one training step (train_step) and what it calls (LoRA with
the safe gradient, DML, GR, OE), then the task loop (run_seed) and one task's start, training,
end and evaluation, and the metrics. Part 2 holds our variant of GR and the baselines, part 3 the
paper's analyses, part 4 the program (flags, run folders, outputs, --reproduce, --benchmark,
main), which parts 1-3 do not use. A run calls main -> run -> run_one -> run_seed.

Where the code departs from the paper's text, or fills a silence, the README's table "Where we
depart from the paper's text" says what, why, and which flag returns to the paper's reading.

References: C. Chen et al., "JANUS-LoRA: A Balanced Low-Rank Adaptation for Continual Learning",
ICML 2026. The protocol is that of the InfLoRA codebase (Liang & Li, CVPR 2024), on which the paper
ran. GPM: Saha et al., ICLR 2021. LoRA-Pro: Wang et al., ICLR 2025.
"""
import argparse
import contextlib
import copy
import errno
import hashlib
import inspect
import io
import json
import math
import os
import re
import shlex
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache, partial
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

import data
import vit

try:
    import fcntl  # POSIX's file locks (Linux, macOS): one process per seed of a run
except ImportError:  # Windows: runs without the lock
    fcntl = None


# ==== Part 1. The method (Sec. 3) and the task loop ===============================================
# Notation: the paper's symbols, and ours for G, M and w. A key or value layer (K or V) maps x
# to x W^T, W = W0 + s B A (Eq. (1)): W0 (d_out, d_in) frozen, A (r, d_in) and B (d_out, r)
# trained, s the LoRA scale; in a ViT, d_in = d_out = D. G = dL/dW, L the loss (Eq. (12)'s
# L_total). A block's K and V layers share their input, the K/V input; a batch's K/V inputs X
# have a row per token. The block's memory M (D, w) holds w orthonormal columns: the directions
# of the finished tasks' K/V inputs that later updates must leave alone (Fig. 1's "Basis Memory").
# OE's basis V (D, k) spans the k leading directions of the current task's K/V inputs and joins M
# at the task's end (the paper's V is for all past tasks: README). X off M is X (I - M M^T).

@dataclass
class Config:
    """Every setting a run computes with, each a flag (--lora-scale 2 sets lora_scale) whose --help
    is its comment. A value is the paper's where its text gives one (the section is named), else
    the InfLoRA codebase's value, else ours; None takes the data set's value (data.DATASETS)."""
    # The method (Sec. 3 and 4.1). oe, gr and dml are Table 1's switches.
    rank: int = 10  # LoRA's rank r on K and V (Sec. 4.1); 0: no LoRA, the heads alone
    lora_scale: float = 1.0  # LoRA's scale s of Eq. (1) (ours: the paper gives none)
    k: int = 50  # the rank k of each block's OE basis V (Sec. 4.1)
    margin: float = 0.3  # DML's margin m (Sec. 4.1)
    tau: float = 0.07  # DML's temperature tau (Sec. 4.1)
    lambda_dml: float = 1.0  # DML's weight lambda in Eq. (12) (Sec. 4.1)
    delta: float = 1e-6  # GR's Tikhonov constant delta, Eqs. (6)-(7), App. A.2 (the value is ours)
    oe: bool = True  # the safe gradient and its memory, OE's memory or GPM's memory (Table 1)
    gr: bool = True  # GR (Table 1)
    dml: bool = True  # DML (Table 1)
    # OE's step on Eq. (8): Eq. (9)'s gradient step (plain), or one preconditioned (ours; the
    # README's table of departures says why it is the default)
    oe_step: Literal["preconditioned", "plain"] = "preconditioned"
    oe_lr: float = 1.0  # OE's first step size per task (ours: the paper gives none)
    oe_decay_steps: int = 5  # OE's step size falls to half after this many steps (ours)
    # Each task's fresh A: off the memory M (our choice for Janus-LoRA; the paper does not say), as
    # LoRA and the InfLoRA codebase draw it (the baselines' A), or InfLoRA's A, designed and frozen
    lora_a: Literal["off-memory", "kaiming", "inflora"] = "off-memory"
    # M: the finished tasks' OE bases (Fig. 1's Basis Memory), OE's current V (Sec. 3.2's words
    # read literally), or GPM's basis (LoRA-GPM, InfLoRA)
    memory: Literal["tasks", "rolling", "gpm"] = "tasks"
    # GPM's energy shares at tasks 1 and T (InfLoRA's code: 0.95 and 1; ImageNet-R 0.98 and 1)
    gpm_threshold: tuple[float, float] = None
    rectify: Literal["grad", "update"] = "grad"  # GR on the gradients (Sec. 3) or the step (ours)
    # Training (Sec. 4.1; the InfLoRA codebase's values where the paper gives none)
    lr: float = 5e-4  # Adam's learning rate (the InfLoRA codebase's value)
    epochs: int = None  # epochs per task (Sec. 4.1: CIFAR-100 20, ImageNet-R 50)
    batch_size: int = None  # images per step (Sec. 4.1: 128)
    # The data and the backbone (Sec. 4.1)
    dataset: Literal[tuple(data.DATASETS)] = "cifar100"  # the benchmark
    tasks: int = None  # the number of tasks T (CIFAR-100: 10)
    img_size: int = None  # the input resolution (224; synthetic 64, Fashion-MNIST 28)
    # ours: at most this many training images per class (the test set stays whole)
    limit_per_class: int = None
    # The pixels' range: [0, 1] (unit, as the InfLoRA codebase feeds them), the --weights' training
    # range (checkpoint), [-1, 1] (half) or ImageNet's mean and std (imagenet)
    input_range: Literal["unit", "checkpoint", "half", "imagenet"] = "unit"
    model: Literal[tuple(vit.PRESETS)] = "vit_base"  # the backbone (the paper's backbone: ViT-B/16)
    weights: str = "in21k"  # in21k (the paper's weights), dino (Table 4), none (random) or a file
    patch_size: int = None  # the patch size (16, as the paper's ViT-B/16; Fashion-MNIST 7)
    # The machine: bf16 and compiled blocks are ours, for speed on CUDA
    device: str = "auto"  # auto (CUDA if there is one), cpu, cuda or cuda:N
    precision: Literal["bf16", "fp32"] = "bf16"  # the backbone's on CUDA (a CPU runs fp32)
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile the blocks (auto: on CUDA)
    workers: int = None  # loader processes of the file-based data sets (default: the cores)


@dataclass
class Learner:
    """What the method carries from one task to the next."""
    model: nn.Module  # the frozen ViT, whose K and V layers are LoRALinear
    heads: nn.ModuleList = field(default_factory=nn.ModuleList)  # a head per task; last: current
    subspace: "OnlineSubspace" = None  # OE's V of each block; None without OE or under GPM
    memory: list = None  # each block's memory M (D, w)
    prototypes: torch.Tensor = None  # (old classes, D), unit rows: DML's old prototypes, C_past


def train_step(learner, opt, images, y, cfg):
    """One step of "The Integrated Janus-LoRA Update Process" (end of Sec. 3) on n images (n, 3,
    size, size) of labels y (n,) in the current head: the loss, its safe gradient, GR, Adam, OE.
    Returns the loss and the number right, as tensors: reading them would make a GPU wait."""
    model, head = learner.model, learner.heads[-1]
    # z (n, D) is the class token after the final LayerNorm, the heads' input; kv_inputs[i]
    # (n, 1 + patches, D) is block i's K/V input, for OE. On CUDA: bf16 autocast (ours).
    bf16 = images.is_cuda and cfg.precision == "bf16"
    with torch.autocast(images.device.type, torch.bfloat16, enabled=bf16):
        z, kv_inputs = model.encode(images)
    z = z.float()
    logits = head(z)
    # Eq. (12): L_total = L_task + lambda L_DML, with L_task the current head's cross-entropy.
    loss = F.cross_entropy(logits, y)
    if cfg.dml:
        dml = dml_loss(z, y, learner.prototypes, cfg.margin, cfg.tau, head.out_features)
        loss = loss + cfg.lambda_dml * dml
    # Theorem 3.1, with M for the paper's X_past: the backward pass leaves in A.grad and B.grad
    # the factor gradients of G_safe = G (I - M M^T), not those of G (LoRALinear.forward).
    opt.zero_grad(set_to_none=True)
    loss.backward()
    # GR, Eqs. (5)-(7): the factor gradients whose composite update best matches G_safe. Adam
    # takes them, as Sec. 3 says. Adam's per-coordinate scaling moves its step off the safe
    # direction; --rectify update (ours, part 2) rectifies Adam's step instead.
    layers = lora_layers(model)
    if cfg.gr and cfg.rectify == "grad":
        rectify_gradients_(layers, cfg.delta)
    if cfg.gr and cfg.rectify == "update":
        rectified_adam_step_(opt, layers, cfg.delta)
    else:
        opt.step()
    # OE, Eqs. (8)-(10): each block's V takes a step on this batch's K/V inputs.
    if learner.subspace is not None:
        learner.subspace.update(kv_inputs, learner.memory, cfg.oe_step)
        if cfg.memory == "rolling":  # M is V itself, as this step leaves it
            give_memory(model, protected(learner, cfg))
    return loss.detach(), (logits.argmax(1) == y).sum()


# ---- LoRA on K and V, and the safe gradient of Theorem 3.1 ---------------------------------------
class LoRALinear(nn.Linear):
    """Eq. (1): a frozen linear layer W0 (a ViT's K or V) plus s B A. Its backward pass gives the
    factor gradients of the safe gradient G_safe = G (I - M M^T) (Theorem 3.1, Eq. (3), with M for
    X_past), with no d_out x d_in matrix formed. M (D, w) is its block's memory (start_task)."""

    def __init__(self, in_features, out_features, rank, scale):
        super().__init__(in_features, out_features)  # W0 and its bias, from the checkpoint
        self.requires_grad_(False)
        self.scale = float(scale)
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, rank))
        self.M = torch.zeros(in_features, 0)  # no memory yet
        self.reset_()

    def forward(self, x):  # x (..., d_in) -> (..., d_out)
        out = F.linear(x, self.weight, self.bias)
        if self.M.shape[1] == 0:  # nothing to protect yet
            return out + self.scale * F.linear(F.linear(x, self.A), self.B)
        # The derivation. Split A = A_out + A_in, where A_in = A M M^T is A's part in span(M) and
        # A_out = A (I - M M^T). The output x A^T B^T = x A_out^T B^T + x A_in^T B^T is the same.
        # Hold A_in constant, and also B where it multiplies A_in. Then A's gradient flows through
        # A_out alone: dL/dA = (s B^T G)(I - M M^T) = s B^T G_safe. B's flows through the term
        # with A_out alone: dL/dB = s G A_out^T = s G (I - M M^T) A^T = s G_safe A^T. These are
        # the chain rule's factor gradients of G_safe; dL/dx is unchanged.
        with torch.autocast(x.device.type, enabled=False):  # the split in float32 at least
            A = self.A.to(torch.promote_types(self.A.dtype, torch.float32))
            M = self.M.to(A.dtype)
            A_in = (A @ M) @ M.T  # (r, d_in)
            A_out = A - A_in
        # Both terms in one product of 2r columns: x [A_out; A_in]^T [B, B]^T.
        xA = F.linear(x, torch.cat([A_out, A_in.detach()]).to(x.dtype))  # (..., 2r)
        return out + self.scale * F.linear(xA, torch.cat([self.B, self.B.detach()], 1))

    @torch.no_grad()
    def reset_(self, M=None):
        """A fresh pair for a new task: B = 0, and A Kaiming-uniform as LoRA and the InfLoRA
        codebase draw it; given M, A's rows are then moved off M (ours: see rectify_factors)."""
        # drawn on the CPU, so that a run's random numbers do not depend on the device
        if self.A.numel():  # rank 0: no adapter, nothing to draw
            self.A.copy_(nn.init.kaiming_uniform_(torch.empty(self.A.shape), a=math.sqrt(5)))
        if M is not None:
            M = M.to(self.A.dtype)
            # A <- A (I - M M^T). Under a full memory (w = D) this leaves round-off, which Eq. (7)'s
            # R A^T (A A^T + delta I)^-1 would multiply by up to 1 / delta: A is then set to 0.
            self.A -= (self.A @ M) @ M.T
            if M.shape[1] == M.shape[0]:
                self.A.zero_()
        self.B.zero_()

    @torch.no_grad()
    def merge_(self):
        """A task's end: W0 <- W0 + s B A (ours), so that each task starts a fresh pair, and the
        deployed model is a plain ViT, with the "identical deployment costs" of App. B.2."""
        self.weight += self.scale * (self.B @ self.A).to(self.weight.dtype)


def lora_layers(model):
    """The LoRA layers, K then V of each block: layer j belongs to block j // 2."""
    return [layer for block in model.blocks for layer in (block.attn.k, block.attn.v)]


# ---- The Decoupled Margin Loss, Eq. (11) ---------------------------------------------------------
def dml_loss(z, y, old_prototypes, margin=0.3, tau=0.07, num_classes=None):
    """Eq. (11) for features z (n, D) of classes y (n,) among the current task's num_classes, and
    the old prototypes (old classes, D), unit rows. The current prototypes: the batch's unit class
    means, in the graph (ours: the paper does not say). In task 1, the first term alone."""
    z = F.normalize(z.float(), dim=1)
    onehot = F.one_hot(y, num_classes or int(y.max()) + 1).float()  # (n, classes)
    protos = F.normalize(onehot.T @ z, dim=1)  # (classes, D); a class absent from the batch: 0
    absent = onehot.sum(0) == 0  # the softmax runs over C_t, the classes in the batch
    logits = (z @ protos.T / tau).masked_fill(absent, -math.inf)
    # -log( exp(z_i . p_yi / tau) / sum over c in C_t of exp(z_i . p_c / tau) ), batch mean
    intra = F.cross_entropy(logits, y)
    if old_prototypes.shape[0] == 0:
        return intra
    # mean over i in the batch, p_j in C_past of max(0, s_ij - m), s_ij = z_i . p_j (not scale s)
    hinge = F.relu(z @ old_prototypes.T - margin)  # (n, old classes)
    return intra + hinge.mean()


# ---- GR: Gradient Rectification, Eqs. (5)-(7) ----------------------------------------------------
def rectify_gradients_(layers, delta):
    """Replace each LoRA layer's factor gradients by GR's factor updates, all in one batch."""
    A = torch.stack([layer.A.detach() for layer in layers])  # (layers, r, d_in)
    B = torch.stack([layer.B.detach() for layer in layers])  # (layers, d_out, r)
    s = layers[0].scale
    # The chain rule gives A.grad = s B^T G_safe and B.grad = s G_safe A^T, all that GR needs.
    # (Eq. (4) prints them as (dW)^T B, of A^T's shape (d_in, r), and A^T dW, defined only where
    # r = d_out, both without s.)
    BtG = torch.stack([layer.A.grad for layer in layers]) / s  # B^T G_safe (layers, r, d_in)
    GAt = torch.stack([layer.B.grad for layer in layers]) / s  # G_safe A^T (layers, d_out, r)
    dA, dB = rectify_factors(BtG, GAt, A, B, s, delta)
    for layer, a, b in zip(layers, dA, dB):
        layer.A.grad.copy_(a)
        layer.B.grad.copy_(b)


def rectify_factors(BtG, GAt, A, B, scale, delta):
    """GR's dA (..., r, d_in) and dB (..., d_out, r), Eqs. (6)-(7), from B^T G_safe and G_safe A^T
    alone, G_safe never formed. In float64: B^T B + delta I is ill-conditioned once B has grown."""
    # Why it is right, as delta -> 0, for B and A of rank r. Let P_B = B (B^T B)^-1 B^T project
    # onto span(B), and P_A = A^T (A A^T)^-1 A onto A's row space. Eq. (6) gives s B dA =
    # P_B G_safe, so that R = (I - P_B) G_safe, and Eq. (7) gives s dB A = R P_A. What is left of
    # G_safe, (I - P_B) G_safe (I - P_A), is orthogonal to every B U + U' A. So Eq. (5) is a
    # linear least-squares problem in (dA, dB), not a non-convex one, and this is a minimiser.
    # The composite s (B dA + dB A) = P_B G_safe + G_safe P_A - P_B G_safe P_A is LoRA-Pro's
    # equivalent gradient. Where A M = 0, it leaves span(M) alone (G_safe M = 0, P_A M = 0):
    # hence each task's A is drawn off M (LoRALinear.reset_). Adam's per-coordinate scaling of
    # these gradients moves A off that, which --rectify update (ours, part 2) puts right.
    dtype = BtG.dtype
    BtG, GAt, A, B = BtG.double(), GAt.double(), A.double(), B.double()
    eye = delta * torch.eye(B.shape[-1], dtype=B.dtype, device=B.device)  # delta I (r, r)
    # Eq. (6): dA = (1/s) (B^T B + delta I)^-1 B^T G_safe
    dA = spd_solve(gram(B) + eye, BtG) / scale
    # R A^T = G_safe A^T - s B (dA A^T), with neither R nor G_safe formed
    RAt = GAt - scale * B @ (dA @ A.mT)
    # Eq. (7): dB = (1/s) R A^T (A A^T + delta I)^-1, solved transposed, from the left
    dB = spd_solve(gram(A.mT) + eye, RAt.mT).mT / scale
    return dA.to(dtype), dB.to(dtype)


def gram(X):
    """X^T X of X (..., rows, cols), in float64, where float32's round-off fails Cholesky on
    rank-one inputs (test_oe_stays_positive_definite_and_orthonormal_and_converges)."""
    X = X.double()
    return X.mT @ X


def ridge(S, eps):
    """S + eps * mean(eig S) * I for Gram matrices S (..., size, size): a ridge relative to S."""
    lam = eps * S.diagonal(dim1=-2, dim2=-1).mean(-1) + torch.finfo(S.dtype).tiny  # S = 0: finite
    return S + lam[..., None, None] * torch.eye(S.shape[-1], dtype=S.dtype, device=S.device)


def spd_solve(S, rhs):
    """S^-1 rhs for positive definite S (..., size, size), by Cholesky. cholesky_ex, unlike
    cholesky, does not check its result, which would make a GPU wait."""
    low = torch.linalg.cholesky_ex(S).L  # S = low low^T
    y = torch.linalg.solve_triangular(low, rhs, upper=False)
    return torch.linalg.solve_triangular(low.mT, y, upper=True)


# ---- OE: Online Estimation, Eqs. (8)-(10) --------------------------------------------------------
class OnlineSubspace:
    """OE's basis V (blocks, D, k): for each block, an orthonormal basis of the k leading
    directions of the current task's K/V inputs, kept off the block's memory M."""

    def __init__(self, blocks, dim, k, lr=1.0, decay_steps=5, device=None):
        self.k, self.lr, self.decay_steps = k, lr, decay_steps
        self.V = fresh_basis([torch.zeros(dim, 0, device=device)] * blocks, k)  # (blocks, D, k)
        self.steps = 0  # the steps taken with this V

    @torch.no_grad()
    def update(self, X, memory, step="preconditioned"):
        """One step of OE on every block, Eqs. (8)-(10), on X_p = X (I - M M^T) (ours: the paper
        does not project): each block's K/V inputs X (..., D), every token a sample."""
        V, M = self.V, stack_blocks(memory)  # (blocks, D, k), (blocks, D, w)
        if V.shape[-1] == 0:  # a full memory leaves nothing to learn
            return
        # Eq. (8)'s loss (1/2) ||X_p - X_p V V^T||^2 has the gradient -2 E + E V^T V + V V^T E,
        # with E = X_p^T X_p V. Since V^T V = I, it is -(I - V V^T) E.
        E_step = []  # per block, E scaled for the step: E / ||X_p||^2, or E S^-1 (ours)
        for x, v, M_i in zip(X, V, M):
            x = x.reshape(-1, v.shape[0]).float()  # (tokens, D)
            xv = x @ v  # (tokens, k): X_p V, as V is off M
            if step == "plain":
                # Eq. (9)'s step, divided by ||X_p||^2, the sum of X_p^T X_p's eigenvalues: each
                # eigenvalue of X_p^T X_p / ||X_p||^2 is at most 1, whatever the inputs' scale.
                energy = x.square().sum() - (x @ M_i).square().sum()
                E_step.append(x.T @ xv / energy.clamp_min(torch.finfo(x.dtype).tiny))
            else:
                # Ours: the gradient times S^-1, S = V^T E = (X_p V)^T (X_p V) plus a ridge. At
                # a step size of 1, V - (-(I - V V^T) E S^-1) = E S^-1, whose columns span
                # X_p^T X_p V: a step of subspace iteration. Computed as X^T (X_p V S^-1).
                S = ridge(gram(xv), 1e-6)  # (k, k)
                E_step.append(x.T @ spd_solve(S, xv.mT.double()).mT.to(x.dtype))
        E_step = off_span(torch.stack(E_step), M)  # X_p^T = (I - M M^T) X^T
        grad = -(E_step - V @ (V.mT @ E_step))  # Eq. (8)'s gradient, scaled as above
        # eta = oe_lr oe_decay_steps / (oe_decay_steps + steps), halved after oe_decay_steps (ours)
        eta = self.lr * self.decay_steps / (self.decay_steps + self.steps)
        V_tilde = V - eta * grad  # Eq. (9)
        # V~^T V~ = I + eta^2 grad^T grad >= I, as V^T grad = 0: qr_q's Cholesky is safe.
        Q = qr_q(V_tilde)  # Eq. (10): V <- Q of V~ = Q R
        self.V = off_span(Q, M)  # off M again, so that no round-off leaks into span(M)
        self.steps += 1

    @torch.no_grad()
    def merge(self, memory):
        """A task's end: each block's M takes V's k columns (fewer where M has less room left), and
        a fresh V is drawn off the new M, its steps from 0. Returns the new memory."""
        room = [min(self.k, M.shape[0] - M.shape[1]) for M in memory]
        memory = [torch.linalg.qr(torch.cat([M, v[:, :c]], dim=-1)).Q
                  for M, v, c in zip(memory, self.V, room)]
        self.V = fresh_basis(memory, self.k)
        self.steps = 0
        return memory


def fresh_basis(memory, k):
    """A random orthonormal V (blocks, D, k) off each block's memory M (D, w), uniform (Haar) among
    those. A block with room for fewer than k columns, D - w, gets that many, then zero columns."""
    M = stack_blocks(memory)  # (blocks, D, w)
    blocks, D, _ = M.shape
    room = torch.tensor([min(k, D - M_i.shape[1]) for M_i in memory])  # (blocks,)
    # drawn on the CPU, so that a run's random numbers do not depend on the device
    V = torch.randn(blocks, D, int(room.max())).to(M.device)
    # Q with R's diagonal > 0, as Gram-Schmidt gives it, is uniform (Mezzadri, Notices of the AMS,
    # 2007); LAPACK's Q is not, and its signs may differ between devices.
    Q, R = torch.linalg.qr(off_span(V, M))
    keep = torch.arange(V.shape[-1]) < room[:, None]  # the columns each block has room for
    return Q * (R.diagonal(dim1=-2, dim2=-1).sign() * keep.to(M.device))[..., None, :]


def off_span(V, M):
    """(I - M M^T) V: V's columns without their part in span(M)."""
    return V - M @ (M.mT @ V)


def stack_blocks(memory):
    """Each block's memory (D, w_i) as one (blocks, D, w), zero columns padding the narrower."""
    w = max(M.shape[1] for M in memory)
    return torch.stack([F.pad(M, (0, w - M.shape[1])) for M in memory])


def qr_q(V):
    """Eq. (10)'s Q of V = Q R (..., D, k), triangular R's diagonal > 0: as V^T V = R^T R, R^T is
    the Cholesky factor of V^T V, and Q = V R^-1: a k x k factorisation, not a D x k QR."""
    VtV = gram(V)
    VtV = VtV + torch.diag_embed((VtV.diagonal(dim1=-2, dim2=-1) == 0).to(VtV.dtype))  # 0 stays 0
    R = torch.linalg.cholesky_ex(VtV).L.mT
    return torch.linalg.solve_triangular(R, V.double(), upper=True, left=False).to(V.dtype)


# ---- The task loop, the InfLoRA codebase's protocol: exemplar-free, a linear head per task trained
# by its cross-entropy, and at test the argmax over all heads, with no task id -------------------
def build_model(cfg):
    """cfg.model with LoRA on K and V, cfg.weights loaded, frozen, in eval mode (no dropout)."""
    torch.manual_seed(0)  # with --weights none, one random backbone plays the checkpoint for all
    kv_layer = partial(LoRALinear, rank=cfg.rank, scale=cfg.lora_scale)
    model = vit.PRESETS[cfg.model](img_size=cfg.img_size, patch_size=cfg.patch_size,
                                   kv_layer=kv_layer)
    vit.load_pretrained(model, cfg.weights)
    return model.requires_grad_(False).eval()


def start_learner(cfg, seed, backbone):
    """A learner for one seed: a copy of the backbone, its first LoRA pairs, OE, no memory."""
    torch.manual_seed(seed)  # the only generator a run draws from; the loaders seed their own
    model = copy.deepcopy(backbone).to(cfg.device)
    for layer in lora_layers(model):
        layer.reset_()  # the first task's A comes from this seed too
    if cfg.compile == "on":
        compile_blocks(model)  # ours, part 2: for speed on CUDA
    blocks, D = len(model.blocks), model.embed_dim
    learner = Learner(model, memory=[torch.zeros(D, 0, device=cfg.device)] * blocks,
                      prototypes=torch.zeros(0, D, device=cfg.device))
    if cfg.oe and cfg.memory != "gpm":  # GPM's memory needs no OE
        learner.subspace = OnlineSubspace(blocks, D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps,
                                          cfg.device)
    return learner


def run_seed(learner, record, splits, cfg, after_task):
    """The task loop of one seed: each task that `record` (new_record, part 3) does not hold yet,
    trained, evaluated and analysed; after_task(learner, record) saves it, before it is reported.
    splits: the training and test images with their classes (data.load_dataset)."""
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    for t in range(len(record["acc_matrix"]), cfg.tasks):
        start = time.time()  # a task's time: its start, training and end (the method's passes)
        memory = start_task(learner, t, tasks, splits, cfg)
        record["throughput"].append(train_task(learner, t, tasks, splits, cfg, record["seed"]))
        oe = learner.subspace and (learner.subspace.V, learner.memory)  # for the analyses
        factors = end_task(learner, t, tasks, splits, cfg)
        record["task_seconds"].append(time.time() - start)
        probe, sums = analyses_probe(factors, oe, tasks[t], cfg)  # the analyses, part 3
        acc, aware, sample, z, y = evaluate(learner, splits, tasks, cfg, probe)
        record["acc_matrix"].append(acc)
        record["task_aware"].append(aware)
        record["sample_acc"].append(sample)
        analyses = record_analyses(record, learner, t, factors, memory, z, y, sums, cfg)
        after_task(learner, record)
        print(f"seed {record['seed']} task {t + 1} accuracy per task: {' '.join(map(fmt, acc))}  | "
              f"mean {fmt(sum(acc) / len(acc))}  | task-aware mean {fmt(sum(aware) / len(aware))}"
              f"  | {record['task_seconds'][-1]:.1f} s\n{analyses}", flush=True)


def start_task(learner, t, tasks, splits, cfg):
    """Task t's start: a fresh head, each LoRA layer given the memory M it protects (--memory
    rolling: V, at each step), InfLoRA's A (part 2) if asked. Returns each block's M now."""
    model = learner.model
    learner.heads.append(nn.Linear(model.embed_dim, len(tasks[t])).to(cfg.device))
    M = protected(learner, cfg)
    give_memory(model, M)
    for layer in lora_layers(model):
        layer.A.requires_grad_(cfg.lora_a != "inflora" and cfg.rank > 0)  # InfLoRA: B alone
        layer.B.requires_grad_(cfg.rank > 0)
    if cfg.lora_a == "inflora":  # the InfLoRA baseline, part 2
        set_inflora_a(model, M, data.subset(splits.train_eval, tasks[t]), cfg)
    return [M_i.clone() for M_i in M]


def protected(learner, cfg):
    """Each block's M for the LoRA layers: the memory; under --memory rolling, OE's V itself."""
    if cfg.memory == "rolling" and learner.subspace is not None:
        return list(learner.subspace.V)
    return learner.memory


def give_memory(model, memory):
    """Each K/V layer's M: its block's memory, as K and V of block j // 2 share their input."""
    for j, layer in enumerate(lora_layers(model)):
        layer.M = memory[j // 2]


def train_task(learner, t, tasks, splits, cfg, seed):
    """Task t's training: cfg.epochs epochs of train_step, a line per epoch. Returns the images per
    second of each epoch."""
    local = torch.full((splits.num_classes,), -1, device=cfg.device)  # class -> the head's index
    local[tasks[t]] = torch.arange(len(tasks[t]), device=cfg.device)
    images = data.subset(splits.train, tasks[t])
    # the loader's own generator draws the order, the crops and the flips
    loader = data.make_loader(images, cfg.batch_size, True, cfg.workers, seed * 1000 + t,
                              cfg.device)
    opt, speeds = adam(learner, cfg), []
    for epoch in range(cfg.epochs):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(epoch, cfg.epochs)
        start = time.time()
        loss_sum, correct, seen = 0.0, 0, 0
        for x, y in loader:
            x, y = x.to(cfg.device, non_blocking=True), local[y.to(cfg.device)]
            loss, right = train_step(learner, opt, x, y, cfg)
            loss_sum = loss_sum + loss * len(y)  # tensors, read once per epoch
            correct = correct + right
            seen += len(y)
        loss = float(loss_sum) / seen
        if not math.isfinite(loss):
            raise FloatingPointError(f"task {t + 1} epoch {epoch + 1}: the loss is {loss}: lower "
                                     "--lr (a new run, in a folder of its own)")
        speeds.append(seen / (time.time() - start))
        print(f"seed {seed} task {t + 1}/{cfg.tasks} epoch {epoch + 1}/{cfg.epochs}  loss "
              f"{loss:.4f}  train acc {100.0 * float(correct) / seen:5.2f}%  "
              f"{speeds[-1]:7.1f} img/s", flush=True)
        if t == 0 and epoch == 0:  # how long a seed takes at this speed (part 3)
            print(estimate(speeds[-1], splits, cfg), flush=True)
    return speeds


def adam(learner, cfg):
    """Adam (betas 0.9, 0.999, Sec. 4.1) on the LoRA factors that train and the current head."""
    factors = [p for layer in lora_layers(learner.model) for p in (layer.A, layer.B)]
    params = [p for p in factors if p.requires_grad] + list(learner.heads[-1].parameters())
    return torch.optim.Adam(params, lr=cfg.lr)


def lr_factor(epoch, epochs):
    """The lr factor of a task's epoch (from 0) of `epochs`, as the InfLoRA codebase steps its
    CosineSchedule under Adam: 1, then cos(99 pi (epoch - 1) / (200 (epochs - 1)))."""
    if epoch == 0 or epochs == 1:  # the codebase divides by zero with one epoch: one epoch at lr
        return 1.0
    return math.cos(99 * math.pi * (epoch - 1) / (200 * (epochs - 1)))


@torch.no_grad()
def end_task(learner, t, tasks, splits, cfg):
    """Task t's end: DML's old prototypes gain the task's classes; each block's M gains its OE basis
    V; each W0 absorbs s B A, and a fresh pair is drawn. Returns each layer's (A, B) before that."""
    images = data.subset(splits.train_eval, tasks[t])  # the task's training images, test transform
    z, y = features(learner.model, images, cfg)
    learner.prototypes = torch.cat([learner.prototypes, class_prototypes(z, y, tasks[t])])
    if cfg.oe and cfg.memory == "tasks":  # V joins M (OnlineSubspace.merge)
        learner.memory = learner.subspace.merge(learner.memory)
    elif cfg.oe and cfg.memory == "gpm":  # the baselines' memory, part 2: a pass that OE avoids
        learner.memory = gpm_memory(learner, images, t, cfg)
    layers = lora_layers(learner.model)
    factors = [(layer.A.clone(), layer.B.clone()) for layer in layers]
    M = protected(learner, cfg)
    for j, layer in enumerate(layers):
        layer.merge_()
        layer.reset_(M[j // 2] if cfg.lora_a == "off-memory" else None)  # the next task's pair
    return factors


def class_prototypes(z, y, classes):
    """(len(classes), D): each class's unit mean of its images' unit features, DML's C_past."""
    z = F.normalize(z, dim=1)
    return torch.stack([F.normalize(z[y == c].mean(0), dim=0) for c in classes])


@torch.no_grad()
def evaluate(learner, splits, tasks, cfg, measure=None):
    """One pass over the seen tasks' test images, calling measure(K/V inputs, y) on each batch.
    Returns row t of the accuracies, task-agnostic (the argmax over all heads) and task-aware (ours:
    the true task's head); the accuracy over all seen test images; the current task's test z, y."""
    heads, t = learner.heads, len(learner.heads) - 1
    seen = torch.tensor([c for classes in tasks[:t + 1] for c in classes], device=cfg.device)
    z, y = features(learner.model, data.subset(splits.test, seen.tolist()), cfg, measure)
    task_of = torch.empty(int(seen.max()) + 1, dtype=torch.long, device=cfg.device)
    for i, classes in enumerate(tasks[:t + 1]):
        task_of[classes] = i
    logits = torch.cat([head(z) for head in heads], dim=1)  # (n, seen classes), in `seen`'s order
    other_task = task_of[seen][None, :] != task_of[y][:, None]  # (n, seen classes)
    agnostic = seen[logits.argmax(1)]
    aware = seen[logits.masked_fill(other_task, -math.inf).argmax(1)]
    rows = [[100.0 * float((pred == y)[task_of[y] == i].float().mean()) for i in range(t + 1)]
            for pred in (agnostic, aware)]
    now = task_of[y] == t
    return rows[0], rows[1], 100.0 * float((agnostic == y).float().mean()), z[now], y[now]


@torch.no_grad()
def features(model, images, cfg, measure=None):
    """z (n, D) and the labels y (n,) of the images, in their order; measure(K/V inputs, y) is
    called on each batch, if given."""
    zs, ys = [], []
    loader = data.make_loader(images, cfg.batch_size, False, cfg.workers, 0, cfg.device)
    for x, y in loader:
        x, y = x.to(cfg.device), y.to(cfg.device)
        with torch.autocast(x.device.type, torch.bfloat16,
                            enabled=x.is_cuda and cfg.precision == "bf16"):  # as train_step
            z, kv_inputs = model.encode(x)
        zs.append(z.float())
        ys.append(y)
        if measure is not None:
            measure(kv_inputs, y)
    return torch.cat(zs), torch.cat(ys)


def acc_maa_bwt(acc):
    """Sec. 4.1's metrics of acc, where acc[t][i] is the accuracy (%) on task i after task t, both
    counted from 0: ACC = mean_i acc[T-1][i], MAA = mean_t mean_(i <= t) acc[t][i] and BWT =
    mean_(i < T-1) (acc[T-1][i] - acc[i][i]) (None with one task)."""
    T = len(acc)
    maa = sum(sum(acc[t][: t + 1]) / (t + 1) for t in range(T)) / T
    bwt = sum(acc[T - 1][i] - acc[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else None
    return sum(acc[T - 1][:T]) / T, maa, bwt


# ==== Part 2. Ours and the baselines ==============================================================
# ---- Ours: --rectify update, GR on Adam's step ---------------------------------------------------
def rectified_adam_step_(opt, layers, delta):
    """Adam's step, rectified against each layer's memory M (ours): Adam's per-coordinate scaling
    gives a step of GR's gradients a part on span(M), and this takes it off again."""
    before = [(layer.A.detach().clone(), layer.B.detach().clone()) for layer in layers]
    opt.step()
    rectify_updates_(layers, before, [layer.M for layer in layers], delta)


@torch.no_grad()
def rectify_updates_(layers, before, memories, delta):
    """The step that Adam took from `before`, as its composite update dW = s (B dA + dB A):
    projected off M (Theorem 3.1), rectified by GR, split as LoRA-Pro splits it. LoRA-Pro runs
    Adam on the full-size gradient; ours, on the factors, adds the projection off M (with an empty
    memory, plain LoRA under Adam, its step re-split)."""
    A0 = torch.stack([a for a, _ in before])  # (layers, r, d_in)
    B0 = torch.stack([b for _, b in before])  # (layers, d_out, r)
    s = layers[0].scale
    dA = torch.stack([layer.A for layer in layers]) - A0  # Adam's proposed step
    dB = torch.stack([layer.B for layer in layers]) - B0
    M = stack_blocks(memories)
    # B^T dW_safe and dW_safe A^T, with dW_safe = dW (I - M M^T), in products r wide only
    BtW = rows_off_span(s * ((B0.mT @ B0) @ dA + (B0.mT @ dB) @ A0), M)
    Ap = rows_off_span(A0, M).mT  # (I - M M^T) A^T  (layers, d_in, r)
    WAt = s * (B0 @ (dA @ Ap) + dB @ (A0 @ Ap))
    rA, rB = least_norm_split(*rectify_factors(BtW, WAt, A0, B0, s, delta), A0, B0)
    for layer, a, b in zip(layers, A0 + rA, B0 + rB):
        layer.A.copy_(a)
        layer.B.copy_(b)


def rows_off_span(G, M):
    """G (I - M M^T): G's rows off span(M), Theorem 3.1's form for a dense G (..., d_out, d_in)."""
    return G - (G @ M) @ M.mT


def least_norm_split(dA, dB, A, B):
    """LoRA-Pro's split of a composite update (its optimal X): of the steps (dA + C A, dB - B C),
    which all have the composite B dA + dB A, the one of least ||dA||^2 + ||dB||^2. C solves the
    Sylvester equation (B^T B) C + C (A A^T) = B^T dB - dA A^T. In float64, as GR."""
    dtype = dA.dtype
    dA, dB, A, B = dA.double(), dB.double(), A.double(), B.double()
    P, Q = gram(B), gram(A.mT)  # (..., r, r)
    r, batch = P.shape[-1], P.shape[:-2]
    I = torch.eye(r, dtype=P.dtype, device=P.device)
    # Row-major vec(P C + C Q) = (P kron I + I kron Q^T) vec(C), and Q^T = Q: an r^2 x r^2
    # semidefinite system, consistent, solved with a round-off ridge (where it is singular, its
    # least-norm solution).
    K = torch.einsum("...ik,jl->...ijkl", P, I) + torch.einsum("ik,...jl->...ijkl", I, Q)
    K = ridge(K.reshape(*batch, r * r, r * r), r * torch.finfo(P.dtype).eps)
    rhs = (B.mT @ dB - dA @ A.mT).reshape(*batch, r * r, 1)
    C = spd_solve(K, rhs).reshape(P.shape)
    return (dA + C @ A).to(dtype), (dB - B @ C).to(dtype)


def compile_blocks(model):
    """Ours, for speed on CUDA: each block compiled in place, its tensors' names unchanged."""
    # A block is traced anew for each width of M, with and without gradients, before the width
    # becomes a dynamic size: more traces than dynamo's default limit of 8.
    torch._dynamo.config.cache_size_limit = 64
    for block in model.blocks:
        block.compile()


# ---- The baselines: GPM's memory (LoRA-GPM) and InfLoRA's A, as in the InfLoRA codebase ---------
@torch.no_grad()
def kv_covariance(model, images, cfg):
    """Each block's uncentred K/V-input covariance (blocks, D, D) over every token of the images."""
    C, tokens = 0.0, 0

    def add(kv_inputs, y):
        nonlocal C, tokens
        X = [x.float().flatten(0, 1) for x in kv_inputs]  # (n (1 + patches), D) per block
        C = C + torch.stack([x.T @ x for x in X])
        tokens += X[0].shape[0]
    features(model, images, cfg, add)
    return C / tokens


def gpm_memory(learner, images, t, cfg):
    """GPM's memory after task t, at the InfLoRA codebase's threshold for task t."""
    C = kv_covariance(learner.model, images, cfg)
    first, last = cfg.gpm_threshold
    threshold = first + (last - first) * t / cfg.tasks  # t from 0, as the codebase counts
    return [gpm_extend(M, C_i, threshold) for M, C_i in zip(learner.memory, C)]


def gpm_extend(M, C, threshold):
    """GPM: M (D, w) plus the fewest leading directions of (I - M M^T) C that bring the captured
    share of C's energy to the threshold; a direction's energy is its squared singular value."""
    C, M64 = C.double(), M.double()  # once per task: float64 keeps the memory orthonormal
    total = torch.linalg.svdvals(C).square().sum()
    U, s, _ = torch.linalg.svd(off_span(C, M64))
    e = s.square() / total  # (D,): each residual direction's share
    before = (1 - e.sum()) + torch.cumsum(e, 0) - e  # the share held before adding direction i
    r = min(int((before < threshold).sum()), C.shape[0] - M.shape[1])  # never past the width
    return torch.cat([M, U[:, :r].to(M.dtype)], dim=1)


def set_inflora_a(model, memory, images, cfg):
    """InfLoRA's A for a task, from its K/V inputs off each block's memory: K and V share it."""
    C = kv_covariance(model, images, cfg)  # (blocks, D, D)
    A = [inflora_a(C_i, M_i, cfg.rank) for C_i, M_i in zip(C, memory)]
    with torch.no_grad():
        for j, layer in enumerate(lora_layers(model)):
            layer.A.copy_(A[j // 2])


def inflora_a(C, M, rank):
    """InfLoRA's A (r, D), off span(M): the top-r left singular vectors of (I - M M^T) C, over
    sqrt(3) as its code scales them."""
    C, M64 = C.double(), M.double()  # float64: the trailing vectors' round-off stays off M
    U = off_span(torch.linalg.svd(off_span(C, M64)).U[:, :rank], M64)
    return (U.T / math.sqrt(3)).to(M.dtype)


# ==== Part 3. The paper's analyses and metrics ===================================================
# After each task: the null-space violation on real inputs (Fig. 2), DML's geometry (Fig. 3 and
# the appendix's density), and how well OE's V spans the task's K/V inputs.
def new_record(seed):
    """What the task loop measures of a seed, task by task: results.json's entry for it."""
    return {"seed": seed, "acc_matrix": [], "task_aware": [], "sample_acc": [], "task_seconds": [],
            "throughput": [], "on_memory": {"k": [], "v": []}, "interference": [], "geometry": [],
            "subspace": [], "memory": [], "trained_on": []}


def analyses_probe(factors, oe, current, cfg):
    """A function for evaluate to call on each batch of K/V inputs x, and the sums that it fills
    for Fig. 2 on real inputs: per K/V layer, ||x dW^T||^2 over the past tasks' tokens and over
    the current task's tokens, dW = s B A of the task's factors, and their numbers; with OE,
    oe = (V, M), and each block's X^T X over the current task's tokens. x comes from the model
    after the task (merged), not from the one that learned the past tasks."""
    sums = {"change": 0.0, "tokens": 0.0, "gram": 0.0, "oe": oe}

    def probe(kv_inputs, y):
        now = (y[:, None] == torch.tensor(current, device=y.device)).any(1)  # (n,)
        e = []
        for j, (A, B) in enumerate(factors):  # K and V of block j // 2 share its input
            u = kv_inputs[j // 2].float() @ A.T  # (n, 1 + patches, r)
            e.append(cfg.lora_scale ** 2 * ((u @ (B.T @ B)) * u).sum((1, 2)))  # per image
        e = torch.stack(e, 1)  # (n, layers)
        sums["change"] = sums["change"] + torch.stack([e[~now].sum(0), e[now].sum(0)])
        tokens = torch.stack([(~now).sum(), now.sum()])[:, None] * kv_inputs[0].shape[1]
        sums["tokens"] = sums["tokens"] + tokens
        if oe:
            X = [x[now].flatten(0, 1).float() for x in kv_inputs]  # (tokens, D) per block
            sums["gram"] = sums["gram"] + torch.stack([x.T @ x for x in X])
    return probe, sums


def record_analyses(record, learner, t, factors, memory, z, y, sums, cfg):
    """Task t's analyses into record, and their line. factors: the task's (A, B) per layer;
    memory: the M it protected; z, y: the task's test features and classes; sums: the probe's."""
    for j, name in enumerate("kv"):  # factors[j::2]: each block's K (j = 0) or V (j = 1) pair
        pairs = zip(factors[j::2], memory)
        record["on_memory"][name].append([share_on_memory(A, B, M) for (A, B), M in pairs])
    record["memory"].append([M.shape[1] for M in protected(learner, cfg)])  # the next task's M
    record["subspace"].append(sums["oe"] and subspace_error(*sums["oe"], sums["gram"]))
    lo, hi = min(record["memory"][-1]), max(record["memory"][-1])
    line = (f"seed {record['seed']} task {t + 1} analyses: M holds {lo}{f'-{hi}' * (lo < hi)} "
            f"of {learner.model.embed_dim} columns per block")
    if full := record["memory"][-1].count(learner.model.embed_dim):  # blocks with all D columns
        line += (f" ({full} of {len(record['memory'][-1])} blocks full: their K and V learn "
                 f"nothing from task {t + 2} on)")
    if record["subspace"][-1]:
        line += f"; OE capture {fmt(mean(record['subspace'][-1]['capture']), '.4f')}"
    if t == 0:  # no past tasks, no old prototypes
        record["interference"].append(None)
        record["geometry"].append(None)
        return line
    past, now = (sums["change"] / sums["tokens"]).sqrt().tolist()
    record["interference"].append({"past": past, "current": now})
    old = len(learner.prototypes) - learner.heads[-1].out_features  # the classes before task t
    record["geometry"].append(dml_geometry(z, y, learner.prototypes, old))
    on_m = mean(record["on_memory"]["k"][-1] + record["on_memory"]["v"][-1])
    return (f"{line}; past change {mean(past):.3g} (Fig. 2), current change {mean(now):.3g}; on "
            f"M {fmt(on_m, '.2e')}; danger {100 * record['geometry'][-1]['danger']:.1f}% (Fig. 3)")


@torch.no_grad()
def share_on_memory(A, B, M):
    """||dW M|| / ||dW|| (Frobenius) of a task's update dW = s B A, never forming dW; None where it
    is undefined (no memory yet, or no update, as under a full memory)."""
    den = ((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt()  # ||B A||^2 = tr(B^T B A A^T)
    if M.shape[1] == 0 or den == 0:
        return None
    return float((B @ (A @ M)).norm() / den)


@torch.no_grad()
def subspace_error(V, memory, gram):
    """How well each block's OE basis V (D, k) spans the top-k eigenspace of C, the task's K/V
    inputs' X^T X off its memory M: the sine of the largest principal angle between the two, and
    the share of the eigenspace's energy that V holds, tr(V^T C V) / (C's k largest eigenvalues'
    sum). None for a block whose memory is full."""
    out = {"sine": [], "capture": []}
    for v, M, G in zip(V.double(), memory, gram.double()):
        v = v[:, v.norm(dim=0) > 0]  # V's columns, fewer where M had less room
        M = M.double()
        C = off_span(off_span(G, M).mT, M)  # C = (I - M M^T) X^T X (I - M M^T)
        energy, U = torch.linalg.eigh(C)
        k = v.shape[1]
        cos = torch.linalg.svdvals(U[:, len(G) - k:].T @ v)
        out["sine"].append(float((1 - cos.min() ** 2).clamp_min(0).sqrt()) if k else None)
        out["capture"].append(float((v.T @ C @ v).trace() / energy[-k:].sum()) if k else None)
    return out


def dml_geometry(z, y, prototypes, old, bins=20):
    """One task's test features z (n, D), classes y: cos_old, the largest cosine to an old class's
    prototype (classes below `old`), and cos_own, to its own; the share in the danger zone
    (cos_old > 0.5); and cos_old's histogram (the appendix's density, Fig. 7b)."""
    z = F.normalize(z.float(), dim=1)
    cos_old = (z @ prototypes[:old].T).amax(1)  # (n,)
    cos_own = (z * prototypes[y]).sum(1)
    return {"danger": float((cos_old > 0.5).float().mean()),
            "hist": (torch.histc(cos_old, bins, -1, 1) / len(z)).tolist(),
            "cos_old": [round(v, 4) for v in cos_old.tolist()],
            "cos_own": [round(v, 4) for v in cos_own.tolist()]}


def mean(values):
    """The mean of the defined values (None: undefined, left out), or None."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# What a run reports of each seed, from its record: name: (its value, its format, what it is). The
# summary, results.json, table.md and the figures read this table: a metric is one entry.
METRICS = {
    "ACC": (lambda r: acc_maa_bwt(r["acc_matrix"])[0], ".2f", "Sec. 4.1's: the mean accuracy (%) "
            "on all tasks after the last, task-agnostic (the argmax over all seen tasks' heads)"),
    "MAA": (lambda r: acc_maa_bwt(r["acc_matrix"])[1], ".2f", "Sec. 4.1's: the mean over the "
            "tasks of the mean accuracy on the tasks seen"),
    "BWT": (lambda r: acc_maa_bwt(r["acc_matrix"])[2], ".2f", "Sec. 4.1's: the mean change of a "
            "task's accuracy from its end to the run's (< 0: forgetting)"),
    "task-aware ACC": (lambda r: acc_maa_bwt(r["task_aware"])[0], ".2f", "ours: ACC with the "
                       "true task's head alone"),
    "task-aware BWT": (lambda r: acc_maa_bwt(r["task_aware"])[2], ".2f", "ours: BWT with the "
                       "true task's head alone"),
    "sample ACC": (lambda r: r["sample_acc"][-1], ".2f", "what the InfLoRA codebase logs: the "
                   "accuracy over all test samples after the last task"),
    "past change": (lambda r: mean([v for i in r["interference"] if i for v in i["past"]]), ".3g",
                    "Fig. 2's null-space violation ||dW X_past||: the RMS change of the past "
                    "tasks' K/V outputs per token, mean over tasks 2..T and the K/V layers"),
    "current change": (lambda r: mean([v for i in r["interference"] if i for v in i["current"]]),
                       ".3g", "the same over the current task's test images"),
    "on M": (lambda r: mean([v for n in "kv" for vs in r["on_memory"][n] for v in vs]), ".2e",
             "ours: the share of each task's update dW on its memory M, ||dW M|| / ||dW||"),
    "danger %": (lambda r: mean([100 * g["danger"] for g in r["geometry"] if g]), ".1f", "Fig. "
                 "3: the share (%) of each task's test images in DML's danger zone, a cosine "
                 "above 0.5 to an old class's prototype"),
    "OE capture": (lambda r: mean([v for s in r["subspace"] if s for v in s["capture"]]), ".4f",
                   "the share of the energy of each task's top-k eigenspace (its test images' K/V "
                   "inputs off M) that OE's V holds at the task's end (results.json: the sine)"),
    "M width": (lambda r: mean(r["memory"][-1]), ".1f", "the columns of a block's memory M after "
                "the last task, the mean over the blocks"),
    "s / task": (lambda r: mean(r["task_seconds"]), ".1f", "a task's training time, with the "
                 "method's own passes, without the evaluation"),
}


# ---- What the console says: the run's expected time ---------------------------------------------
def estimate(speed, splits, cfg):
    """How long a seed takes at `speed` images per second: its training, and at most as long again
    per image for its passes without gradients (a task's end, the evaluations)."""
    counts = torch.bincount(torch.tensor(splits.test.targets), minlength=splits.num_classes)
    test = int(counts.view(cfg.tasks, -1).sum(1).cumsum(0).sum())  # the seen tasks' after each
    trained, passes = cfg.epochs * len(splits.train), len(splits.train) + test
    return (f"note: at {speed:.1f} img/s on {cfg.device}, a seed takes about "
            f"{trained / speed / 60:.0f} min to train ({cfg.epochs} epoch(s) of "
            f"{len(splits.train)} images), and at most {passes / speed / 60:.0f} min more for "
            f"{passes} images without gradients (the tasks' ends, and the evaluations on the "
            "whole test set, which --limit-per-class keeps)")


def fmt(value, spec=".2f"):
    """A number for a table, or '-' where it is undefined."""
    return "-" if value is None else format(value, spec)


# ==== Part 4. The program: flags, a run's folder and state, outputs, --reproduce, --benchmark ====
@dataclass
class Options(Config):
    """Config's settings and the program's own, which change no result."""
    data_dir: str = "data"  # the folder that holds (or receives) the data set
    seeds: tuple[int, ...] = (0,)  # the seeds; several give mean +- std (the paper: 5)
    method: str = None  # a --method of the tables (METHODS): its flags, before the typed ones
    # the run's folder (default: runs/<method>-<dataset>-T<tasks>-<a digest of the flags that
    # change results>); the same command continues the run in it
    out: str = None
    resume: str = None  # continue the run in this folder, with its own flags
    benchmark: bool = False  # time plain LoRA's and Janus-LoRA's training steps, then exit
    steps: int = 20  # with --benchmark: the timed rounds, after 5 warm-up steps
    reproduce: str = None  # run each row of a table or figure of the paper (REPRODUCE)
    row: str = None  # with --reproduce: run this row alone (one job of an array)
    dry_run: bool = False  # with --reproduce: print the rows' commands, run nothing


# --method NAME: its flags, and its name in the paper's tables.
METHODS = {"janus": ("", "Janus-LoRA"),
           "frozen": ("--rank 0 --no-oe --no-gr --no-dml", "the frozen backbone, heads alone "
                      "(the control of SimpleCIL, Zhou et al. 2023; ours)"),
           "janus-update": ("--rectify update", "Janus-LoRA, GR on Adam's step (ours)"),
           "janus-rolling": ("--memory rolling", "Janus-LoRA, M = V"),
           "finetune": ("--no-oe --no-gr --no-dml --lora-a kaiming", "Fine-Tuning"),
           "lora-gpm": ("--memory gpm --no-gr --no-dml --lora-a kaiming", "LoRA-GPM"),
           "lora-gpm-gr": ("--memory gpm --no-dml --lora-a kaiming", "LoRA-GPM + GR (Fig. 6)"),
           "inflora": ("--memory gpm --lora-a inflora --no-gr --no-dml", "InfLoRA")}
# The flags that change no result: the machine's and the program's own (where the data lie, which
# seeds: a run keeps each seed's numbers apart). Another value of any other makes another run.
FREE = ("device", "workers", "compile", *(f.name for f in fields(Options)
                                          if f not in fields(Config)))
# The settings that a switched-off part never reads: no part of such a run's identity.
UNDER = {"oe": ("k", "oe_step", "oe_lr", "oe_decay_steps", "memory", "gpm_threshold"),
         "gr": ("delta", "rectify"), "dml": ("margin", "tau", "lambda_dml")}
# A number flag is at least 1 (an int) or above 0 (a float), unless its bounds are named here.
LEAST = {"rank": 0, "margin": 0, "lambda_dml": 0, "workers": 0, "seeds": 0}
MOST = {"gpm_threshold": 1, "seeds": 2**32 - 1}  # a seed that every generator takes
WIDE = ("rank", "k")  # at most the backbone's width D (check)


class RunError(Exception):
    """Flags that cannot run together, or a run folder or file that cannot be used."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors in one line: --help gives the usage."""

    def error(self, message):
        self.exit(2, f"error: {message} (--help lists the flags)\n")


def flag(name):
    return "--" + name.replace("_", "-")


def parser():
    """The parser of Options' fields, each typed by its annotation, its help its comment."""
    p = Parser(prog="janus_min.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
               argument_default=argparse.SUPPRESS)  # no abbreviations: --seed is no --seeds
    helps = {**field_comments(Config), **field_comments(Options)}
    for f in fields(Options):
        kind, args = getattr(f.type, "__origin__", f.type), get_args(f.type)
        shown = " ".join(map(str, f.default)) if kind is tuple and f.default else f.default
        shown = ("off", "on")[shown] if f.type is bool else shown  # 1.0 == True: test the type
        kw = dict(help=helps[f.name] + ("" if shown is None else f" (default: {shown})"))
        if f.type is bool:  # a switch: --NAME and --no-NAME
            kw.update(action=argparse.BooleanOptionalAction)
        elif kind is Literal or f.name in ("method", "reproduce"):
            kw.update(choices=args or (METHODS if f.name == "method" else REPRODUCE))
        elif kind is tuple:  # (int, ...): one or more, repeats add up; (float, float): two
            more = args[-1] is Ellipsis
            kw.update(nargs="+" if more else len(args), type=number(args[0], f.name),
                      action="extend" if more else "store")
        else:
            kw.update(type=number(f.type, f.name) if f.type in (int, float) else f.type)
        p.add_argument(flag(f.name), **kw)
    return p


@cache  # the source does not change while the program runs
def field_comments(cls):
    """Each field's comment in the class's source: the one ending its line, or the lines above."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        code, _, comment = (part.strip() for part in line.partition("#"))
        if found := re.fullmatch(r"(\w+): .+ = .+", code):
            comments[found[1]] = comment or " ".join(above)
        above = above + [comment] if comment and not code else []
    return comments


def number(kind, name):
    """The type of a number flag: kind(text), refused in one line unless finite and in bounds."""
    least, most = LEAST.get(name, 1 if kind is int else 0), MOST.get(name, math.inf)
    closed = kind is int or name in LEAST  # at least `least`, else above it
    bound = f"{'at least' if closed else 'above'} {least}"
    bound += f" and at most {most}" * (most < math.inf)

    def convert(text):
        value = kind(text)
        if not (math.isfinite(value) and (value >= least if closed else value > least)
                and value <= most):
            raise argparse.ArgumentTypeError(f"{text}: must be {bound}")
        return value
    convert.__name__ = kind.__name__  # so that argparse names the type: "invalid int value"
    return convert


def parse(argv):
    """Every flag's value, the typed flags over their --method's preset; and the flags typed."""
    typed = vars(parser().parse_args(argv))
    preset = METHODS[typed["method"]][0].split() if "method" in typed else []
    return {**vars(parser().parse_args(preset)), **typed}, typed


def configure(argv=None):
    """argv's Options, filled in; with --resume DIR, the run's own settings under those typed."""
    values, typed = parse(argv)
    if "resume" in typed:
        if not (saved := claimed(typed["resume"])):
            raise RunError(f"--resume {typed['resume']}: no run in that folder (no config.json)")
        seeds = sorted({*saved["options"]["seeds"], *states_in(typed["resume"])})
        known(saved["options"], f"{typed['resume']} holds a run", "continue it with that version")
        values = {**saved["options"], "seeds": seeds, **typed, "out": typed["resume"]}
    cfg = Options(**values)
    defaults = {k: v for k, v in data.DATASETS[cfg.dataset].items() if getattr(cfg, k, 0) is None}
    gpm = [0.98 if cfg.dataset == "imagenet-r" else 0.95, 1.0]  # InfLoRA's configs
    cores = os.cpu_count() or 1
    cfg = replace(cfg, **defaults, seeds=list(cfg.seeds), gpm_threshold=cfg.gpm_threshold or gpm,
                  workers=min(cores, cores if cfg.workers is None else cfg.workers),
                  data_dir=os.path.expanduser(cfg.data_dir))  # as a shell would, after "="
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    check(cfg, typed)
    cuda = cfg.device.startswith("cuda")
    cfg.compile = "on" if cfg.compile == "on" or (cfg.compile == "auto" and cuda) else "off"
    if cfg.out is None:  # the same flags, the same folder: the same command continues its run
        changed = {k: v for k, v in result_values(asdict(cfg)).items() if v != getattr(Config, k)}
        digest = hashlib.sha256(json.dumps(changed).encode()).hexdigest()[:6]  # a new flag: none
        name = cfg.reproduce or describe(asdict(cfg))[0]
        cfg.out = os.path.join("runs", f"{name}-{cfg.dataset}-T{cfg.tasks}-{digest}")
    return cfg


def check(cfg, typed):
    """Refuse in one line the flags that would run only to fail late, or silently do nothing."""
    try:
        torch.empty(0, device=cfg.device)  # CUDA starts here: a device this machine lacks fails
    except (RuntimeError, AssertionError) as e:  # no such name, or no such device here
        raise RunError(f"--device {cfg.device}: {str(e).splitlines()[0]}") from None
    width = vit.PRESETS[cfg.model].keywords["embed_dim"]
    rows = REPRODUCE[cfg.reproduce][1] if cfg.reproduce else {}
    modes = [flag(mode) for mode in ("benchmark", "reproduce", "resume") if mode in typed]
    for ok, said in (
            *((getattr(cfg, n) <= width, f"{flag(n)}: at most {cfg.model}'s width, {width}")
              for n in WIDE),
            (cfg.img_size % cfg.patch_size == 0, "--img-size: a multiple of --patch-size"),
            (cfg.lora_a != "inflora" or not cfg.gr, "--lora-a inflora freezes A, which GR "
             "trains: add --no-gr"),
            (cfg.rank > 0 or not cfg.gr, "--rank 0 trains no adapter for GR: add --no-gr"),
            (len(set(cfg.seeds)) == len(cfg.seeds), "--seeds: name each seed once"),
            (len(modes) < 2, f"{' and '.join(modes)}: one at a time"),
            ({"resume", "out"} - set(typed), "--resume continues the run in its folder: leave out "
             "--out"),
            (cfg.benchmark or "steps" not in typed, "--steps goes with --benchmark"),
            (cfg.reproduce or not (cfg.row or cfg.dry_run), "--row and --dry-run go with "
             "--reproduce NAME"),
            (cfg.row in (None, *rows), f"--row {cfg.row}: not a row of --reproduce "
             f"{cfg.reproduce} ({', '.join(rows)})"),
            (cfg.dataset == "synthetic" or os.path.isdir(cfg.data_dir) or cfg.data_dir ==
             Options.data_dir, f"--data-dir {cfg.data_dir}: no such folder (the default, "
             f"{Options.data_dir}, is made for a download)"),
            (cfg.input_range != "checkpoint" or cfg.weights in vit.PRETRAINED_INPUT,
             "--input-range checkpoint needs a named --weights (for a file: half or imagenet)")):
        if not ok:
            raise RunError(said)
    data.task_classes(data.DATASETS[cfg.dataset]["num_classes"], cfg.tasks)  # T divides them


def result_values(config):
    """A config's values that change results: not FREE's values, nor what a switched-off part reads;
    a weights file by its name (the run knows its content by a digest: claim)."""
    unread = {name for switch, names in UNDER.items() if not config[switch] for name in names}
    return {k: os.path.basename(v) if k == "weights" else v for k, v in config.items()
            if k not in FREE and k not in unread}


def describe(config):
    """A config (a dict) as its nearest --method and the flags that it adds to the method's."""
    values, preset = result_values(config), partial(method_values, dataset=config["dataset"])
    typed = {k: flag(k) if v is True else f"--no-{flag(k)[2:]}" if v is False else f"{flag(k)} " +
             " ".join(map(str, v if isinstance(v, list) else [v])) for k, v in values.items()}
    added = {m: [typed[k] for k, v in values.items() if preset(m).get(k) != v] for m in METHODS}
    method = min(METHODS, key=lambda m: len(added[m]))
    return method, " ".join([f"--method {method}", *added[method]])


@cache  # METHODS and Config do not change while the program runs
def method_values(method, dataset):
    """A --method's values of the flags that change results, on a data set."""
    argv = ["--method", method, "--dataset", dataset, "--device", "cpu", "--out", ""]
    return result_values(asdict(configure(argv)))


def machine(cfg):
    """Where and in what a task runs: bf16 autocast is CUDA's only, so a CPU runs in fp32."""
    cpu = f"cpu ({torch.get_num_threads()} threads) fp32"
    cuda = cfg.device.startswith("cuda") and f"{torch.cuda.get_device_name(cfg.device)} " \
        f"{cfg.precision}"
    return f"{cuda or cpu}, torch {torch.__version__}"


# ---- A run's folder: config.json, which fixes its configuration, and a state file per seed ------
STATE = ("options", "backbone", "record", "learner", "rng")  # a seed's state, after each task


def seed_file(folder, seed):
    return os.path.join(folder, f"seed{seed}.pt")


def states_in(folder):
    """The state files of a folder, seed<N>.pt, by their seed N."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    found = {int(m[1]): m[0] for name in names if (m := re.fullmatch(r"seed(\d+)\.pt", name))}
    return {seed: os.path.join(folder, found[seed]) for seed in sorted(found)}


@contextlib.contextmanager
def locked(path, wait=False):
    """The file at path, held by flock until the process ends; held by another: BlockingIOError."""
    with open(path, "w") as lock:
        if fcntl:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        yield


def written(path, content):
    """A text or a state, written whole or not at all: serialised, written aside, then renamed."""
    if not isinstance(content, str):
        buffer = io.BytesIO()
        torch.save(content, buffer)
        content = buffer.getvalue()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
        os.replace(tmp, path)
    except OSError as e:  # named by the file that was to be written, not by its temporary one
        raise OSError(e.errno, e.strerror, path) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def claimed(folder, reproduce=None):
    """A folder's config.json (or None): a run's claim, or that of the --reproduce set asked for."""
    with contextlib.suppress(FileNotFoundError), open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
        if saved.get("reproduce") != reproduce:
            held = f"the rows of --reproduce {saved['reproduce']}, each a run in {folder}/<row>" \
                if "reproduce" in saved else "a run"
            raise RunError(f"{folder} holds {held}: run its own command, or choose another --out")
        return saved


def claim(cfg, backbone=None):
    """The folder's config.json, checked against cfg; the first run to load a backbone writes it."""
    if backbone:
        os.makedirs(cfg.out, exist_ok=True)
        with locked(os.path.join(cfg.out, "lock"), wait=True):  # two jobs that start at once
            if not claimed(cfg.out):
                written(os.path.join(cfg.out, "config.json"),
                        json.dumps({"options": asdict(cfg), "backbone": backbone}))
    if saved := claimed(cfg.out):
        same(saved, cfg, backbone, f"{cfg.out} holds a run", "choose another --out")
    return saved


def same(saved, cfg, backbone, what, fix):
    """Refuse a claim or a state (saved) unless it has cfg's values of the flags that change
    results and the backbone of that digest (None: any); a flag added since takes its default."""
    theirs = result_values({**asdict(Options()), **known(saved["options"], what, fix)})
    other = [f"{flag(k)} {theirs.get(k)} (not {v})" for k, v in result_values(asdict(cfg)).items()
             if theirs.get(k) != v]
    other += ["another backbone"] * (backbone not in (None, saved["backbone"]))
    if other:
        raise RunError(f"{what} of {', '.join(other)}: {fix}")


def known(options, what, fix):
    """options (a dict), refused where it names a setting that this version lacks."""
    if unknown := sorted(options.keys() - {f.name for f in fields(Options)}):
        raise RunError(f"{what} of another version of janus_min.py ({', '.join(unknown)}): {fix}")
    return options


def finished(state, cfg):
    return state is not None and len(state["record"]["acc_matrix"]) == cfg.tasks


def read_state(path, cfg, folder):
    """A seed's state (or None), refused unless it is one, of its file's seed, and the folder's."""
    try:
        state = torch.load(path, map_location=cfg.device, weights_only=True)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 -- torch's unpickler fails in many ways on a bad file
        state = e
    if not isinstance(state, dict) or not set(STATE) <= state.keys():
        raise RunError(f"{path} is no seed's state of janus_min.py ({type(state).__name__}): "
                       "move it away, and that seed starts again")
    if os.path.basename(path) != f"seed{state['record']['seed']}.pt":
        raise RunError(f"{path} holds seed {state['record']['seed']}: move it away")
    same(state, cfg, folder and folder["backbone"], f"{path} is a state", "move it away")
    return state


def run(cfg):
    """Each seed that no other process runs, then the outputs from every finished seed's state."""
    folder = claim(cfg)  # a folder of another configuration is refused before anything loads
    load = cache(partial(load_data_and_backbone, cfg))  # loaded when a seed first needs them
    for seed in cfg.seeds:
        if finished(read_state(seed_file(cfg.out, seed), cfg, folder), cfg):
            continue
        splits, backbone, folder = load()  # nothing is written before this has succeeded
        try:
            with locked(seed_file(cfg.out, seed) + ".lock"):
                run_one(cfg, seed, splits, backbone, folder)
        except BlockingIOError:  # one job of an array over the seeds: another runs this one
            print(f"seed {seed}: another process runs it: left to it", flush=True)
    if folder:
        with locked(os.path.join(cfg.out, "lock"), wait=True):  # the last writer sees every seed
            write_outputs(cfg, folder)
    return 0


def run_one(cfg, seed, splits, backbone, folder):
    """One seed, from the last task that its state file holds; the state is saved after each."""
    path = seed_file(cfg.out, seed)
    if finished(state := read_state(path, cfg, folder), cfg):
        return
    learner, record = start_learner(cfg, seed, backbone), new_record(seed)
    if state:
        record = restore(learner, state)
        print(f"seed {seed}: continued after task {len(record['acc_matrix'])}")

    def save(learner, record):
        record["trained_on"].append(machine(cfg))
        written(path, {"options": asdict(cfg), "backbone": folder["backbone"], "record": record,
                       "rng": torch.get_rng_state(), "learner": learner_state(learner)})
    run_seed(learner, record, data.thin(splits, cfg.limit_per_class, seed), cfg, save)


def load_data_and_backbone(cfg):
    """A run's data and backbone, its first line, and its folder's claim, now with the backbone."""
    kind = vit.PRETRAINED_INPUT[cfg.weights] if cfg.input_range == "checkpoint" else cfg.input_range
    splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size,
                               *vit.MEAN_STD.get(kind, (0.0, 1.0)))  # unit: [0, 1] as it is
    backbone = build_model(cfg)
    print(f"{cfg.dataset}, T = {cfg.tasks}, {describe(asdict(cfg))[1]}, {machine(cfg)}: "
          f"{cfg.out}", flush=True)
    return splits, backbone, claim(cfg, vit.digest(backbone))


def learner_state(learner):
    """Each field of a learner: the model by its K/V layers, the heads, OE by its attributes."""
    state = {f.name: getattr(learner, f.name) for f in fields(learner)}
    state["model"] = nn.ModuleList(lora_layers(learner.model)).state_dict()
    state["heads"] = [head.state_dict() for head in learner.heads]
    if learner.subspace is not None:
        state["subspace"] = vars(learner.subspace)
    return state


def restore(learner, state):
    """A seed's learner as after the last task of its state; returns the seed's record."""
    saved = dict(state["learner"])
    nn.ModuleList(lora_layers(learner.model)).load_state_dict(saved.pop("model"))
    for head in saved.pop("heads"):
        learner.heads.append(nn.Linear(*head["weight"].shape[::-1]).to(head["weight"].device))
        learner.heads[-1].load_state_dict(head)
    if learner.subspace is not None:
        vars(learner.subspace).update(saved.pop("subspace"))
    for name, value in saved.items():  # the fields kept as they are
        setattr(learner, name, value)
    torch.set_rng_state(state["rng"].cpu())  # last: the heads above drew from it
    return state["record"]


def load_learner(path):
    """The learner that a seed's state file holds, and its run's options, on the CPU."""
    cfg = configure(["--resume", os.path.dirname(path) or ".", "--device", "cpu"])
    backbone = build_model(cfg)
    state = read_state(path, cfg, claim(cfg, vit.digest(backbone)))  # this backbone, checked
    learner = start_learner(cfg, state["record"]["seed"], backbone)
    restore(learner, state)
    return learner, cfg


# ---- The outputs, written from the states: results.json, table.md and the paper's figures --------
def summarize(runs):
    """Each metric's mean and sample std (n - 1) over the seeds; None where undefined."""
    values = {name: [r["metrics"][name] for r in runs] for name in METRICS}
    return {name: {"mean": None if None in v else statistics.fmean(v),
                   "std": None if None in v or len(v) < 2 else statistics.stdev(v)}
            for name, v in values.items()}


def records(cfg, folder):
    """The finished seeds' records in cfg's folder, each with its metrics, each state checked."""
    states = [read_state(path, cfg, folder) for path in states_in(cfg.out).values()]
    return [dict(s["record"], metrics={k: f(s["record"]) for k, (f, _, _) in METRICS.items()})
            for s in states if finished(s, cfg)]


def write_outputs(cfg, folder):
    """results.json, table.md and the run's figures, from the finished seeds' states."""
    if not (runs := records(cfg, folder)):
        return
    config = {**asdict(cfg), **folder["options"], "seeds": [r["seed"] for r in runs]}  # the run's
    results = {"config": config, "runs": runs, "summary": summarize(runs)}
    written(os.path.join(cfg.out, "results.json"), json.dumps(results, indent=1))
    name, flags = describe(config)
    title = f"{cfg.dataset}, T={cfg.tasks}, {flags}"
    rows = {name: dict(results, flags=flags)}
    paths = [write_table(cfg.out, rows, title), *draw(cfg.out, RUN_FIGURES, rows, title)]
    print(f"wrote {os.path.join(cfg.out, 'results.json')} {' '.join(paths)}")


def write_table(out, rows, title):
    """table.md: each row's metrics over its seeds (mean ± sample std), and what each metric is."""
    lines = [f"# {title}", "", "| row | flags | seeds | " + " | ".join(METRICS) + " |",
             "|---" * (len(METRICS) + 3) + "|"]
    for name, row in rows.items():
        seeds = " ".join(str(r["seed"]) for r in row["runs"])
        cells = [name, f"`{row['flags'] or '(none)'}`", seeds]
        for metric, s in summarize(row["runs"]).items():
            spec = METRICS[metric][1]
            std = "" if s["std"] is None else f" ± {s['std']:{spec}}"
            cells.append(fmt(s["mean"], spec) + std)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each cell: the mean ± the sample std over the row's seeds (n - 1)."]
    lines += [f"- {name}: {meaning}." for name, (_, _, meaning) in METRICS.items()]
    written(os.path.join(out, "table.md"), "\n".join(lines) + "\n")
    print("\n".join(lines[2:4 + len(rows)]))
    return os.path.join(out, "table.md")


# ---- The paper's figures, from rows {name: {"flags", "config", "runs"}} (a run is one row); a
# row's colour is its place among the rows ---------------------------------------------------------
def draw(out, figures, rows, title):
    """Each figure {file: (the paper's figure, its function)} of the rows into out."""
    try:
        from matplotlib.figure import Figure  # not pyplot: no window, no global state
    except ImportError:
        print("matplotlib is not installed: no figures")
        return []
    for name, (caption, plot) in figures.items():
        fig = Figure(figsize=(13, 4.4), layout="constrained")
        fig.suptitle(f"{caption}\n{title}", fontsize=9)
        plot(fig, rows)
        legend = {label: h for ax in fig.axes for h, label in zip(*ax.get_legend_handles_labels())}
        if legend:  # beside the panels: on one, it would cover lines or bars
            fig.legend(legend.values(), legend.keys(), loc="outside right upper", fontsize=7)
        fig.savefig(os.path.join(out, name), dpi=120)
    return [os.path.join(out, name) for name in figures]


def plot_trajectories(fig, rows):
    """Fig. 5: each row's mean accuracy on the tasks seen, task-agnostic and task-aware, mean ±
    sample std over its seeds; beside it, its past change (filled) and current change (hatched)."""
    *axes, bars = fig.subplots(1, 3, width_ratios=(3, 3, 2))
    axes[1].sharey(axes[0])
    for i, (name, row) in enumerate(rows.items()):
        for ax, key in zip(axes, ("acc_matrix", "task_aware")):
            seen = torch.tensor([[sum(a) / len(a) for a in r[key]] for r in row["runs"]])
            x, m = range(1, seen.shape[1] + 1), seen.mean(0)
            ax.plot(x, m, f"{'osD^v<>ph*'[i % 10]}-C{i % 10}", mfc="none", label=name)
            if len(seen) > 1:  # the sample std needs two seeds
                ax.fill_between(x, m - seen.std(0), m + seen.std(0), color=f"C{i % 10}", alpha=0.2)
            ax.set(xlabel="after task", xticks=x, ylabel="mean accuracy on the tasks seen (%)")
        change = [summarize(row["runs"])[k]["mean"] for k in ("past change", "current change")]
        drawn = bars.bar([i - 0.2, i + 0.2], [c or 0 for c in change], 0.4, color=f"C{i % 10}",
                         hatch=["", "//"], edgecolor="k")
        bars.bar_label(drawn, [fmt(c, ".2g") for c in change], fontsize=7, rotation=90, padding=2)
    axes[0].set_title("task-agnostic (the paper's): the argmax over all heads", fontsize=9)
    axes[1].set_title("task-aware (ours): the true task's head", fontsize=9)
    top = max(h.get_height() for h in bars.patches)
    bars.set(ylabel="RMS change of the K/V outputs per token", ylim=(0, 1.4 * top or 1))
    if not top:  # every change 0 (a frozen backbone), or none (measured from task 2 on)
        said = "0: no change" if fmt(change[0]) != "-" else "measured from task 2 on"
        bars.text(0.5, 0.5, said, ha="center", transform=bars.transAxes)
    bars.set_xticks(range(len(rows)), list(rows), rotation=20)  # level, long names would meet
    bars.set_title("past change (filled; Fig. 2's violation)\nand current change (hatched)",
                   fontsize=9)


def plot_analyses(fig, rows):
    """Figs. 2 and 3 of a run, over its seeds: each block's past change of K and of V, and the last
    task's test images by their cosine to the nearest old class's prototype and to their own's."""
    runs = next(iter(rows.values()))["runs"]
    *kv, angular = fig.subplots(1, 3)
    kv[1].sharey(kv[0])
    for j, ax in enumerate(kv):  # the layers j, j + 2, ...: K (j = 0) or V (j = 1) of each block
        changes = [i["past"][j::2] for r in runs for i in r["interference"] if i]
        heights = [mean(b) for b in zip(*changes)]
        ax.bar(range(len(heights)), heights)
        ax.set(xlabel="block", xticks=range(len(heights)), ylabel="past change (RMS per token)",
               ylim=(0, max(heights or [0]) * 1.1 or 1))
        ax.set_title(f"Fig. 2, {'KV'[j]}: past change, mean over tasks 2..T", fontsize=9)
        if not any(heights):
            ax.text(0.5, 0.5, "no past task" if not changes else "0: no change", ha="center",
                    transform=ax.transAxes)
    last = [(r["seed"], r["geometry"][-1]) for r in runs if r["geometry"][-1]]
    for _, g in last:
        angular.scatter(g["cos_old"], g["cos_own"], s=6, alpha=0.5, color="C0")
    danger = mean([100 * g["danger"] for _, g in last])
    angular.axvline(0.5, color="r", ls="--")
    angular.text(0.51, 0.02, f"danger zone, cos_old > 0.5:\n{fmt(danger, '.1f')}% of the images"
                 if last else "no old class in task 1", color="r", fontsize=8,
                 transform=angular.get_xaxis_transform())
    angular.set(xlabel="cos_old: to the nearest old prototype", ylabel="cos_own: to its own",
                xlim=(min([0.4] + [min(g["cos_old"]) for _, g in last]), 1.0))
    angular.set_title(f"Fig. 3: the last task's test images, seeds "
                      f"{' '.join(str(s) for s, _ in last) or '-'}", fontsize=9)


def plot_gr_plugin(fig, rows):
    """Fig. 6: ACC, MAA and BWT of each row (before GR, then after), mean ± sample std."""
    for ax, metric in zip(fig.subplots(1, 3), ("ACC", "MAA", "BWT")):
        stats = [summarize(row["runs"])[metric] for row in rows.values()]
        bars = ax.bar(list(rows), [nan(s["mean"]) for s in stats], capsize=4,
                      yerr=[s["std"] or 0 for s in stats], color=[f"C{i}" for i, _ in
                                                                  enumerate(rows)])
        ax.bar_label(bars, [fmt(s["mean"]) for s in stats], padding=3)
        ax.set(title=metric, ylabel="points (< 0: forgetting)" if metric == "BWT" else "%")


def plot_sweep(fig, rows):
    """Figs. 4a, 4b and 8: ACC, MAA and BWT over the swept value, mean ± sample std."""
    key = next(iter(parse(next(iter(rows.values()))["flags"].split())[1]))  # the row's one flag
    x = [row["config"][key] for row in rows.values()]
    stats = [summarize(row["runs"]) for row in rows.values()]
    for ax, metrics in zip(fig.subplots(1, 2), (("ACC", "MAA"), ("BWT",))):
        for metric in metrics:
            ax.errorbar(x, [nan(s[metric]["mean"]) for s in stats], capsize=4, marker="o",
                        yerr=[s[metric]["std"] or 0 for s in stats], label=metric)
        ax.set(xlabel=flag(key), xticks=x, ylabel="points" if metric == "BWT" else "%")


def plot_efficiency(fig, rows):
    """Figs. 9-11: each row's time per task, cumulative time and throughput, over its seeds."""
    axes = fig.subplots(1, 3)
    for i, (name, row) in enumerate(rows.items()):
        seconds = torch.tensor([r["task_seconds"] for r in row["runs"]]).mean(0)  # (T,)
        speeds = torch.tensor([sum(r["throughput"], []) for r in row["runs"]]).mean(0)  # (T E,)
        for ax, y in zip(axes, (seconds, seconds.cumsum(0), speeds)):
            ax.plot(range(1, len(y) + 1), y, f"{'osD^v<>ph*'[i % 10]}-C{i % 10}", mfc="none",
                    label=name)
    for ax, title, x, y in zip(axes, ("Fig. 9: training time per task", "Fig. 10: cumulative "
                                      "training time", "Fig. 11: throughput"),
                               ("task", "task", "epoch of the run"), ("s", "s", "images / s")):
        ax.set(title=title, xlabel=x, ylabel=y, ylim=(0, None))


def nan(value):
    """A value for matplotlib: None (undefined) as NaN, which matplotlib leaves out."""
    return math.nan if value is None else value


FIG5 = {"trajectories.png": ("Fig. 5: the mean accuracy on the tasks seen, and Fig. 2's past "
                             "change", plot_trajectories)}
RUN_FIGURES = {**FIG5, "analyses.png": ("Figs. 2 and 3: the null-space violation per block, and "
                                        "DML's geometric effect", plot_analyses)}
EFFICIENCY = {"efficiency.png": ("the appendix's Figs. 9-11: the time per task, the cumulative "
                                 "time, the throughput", plot_efficiency)}


# ---- --reproduce: every row of a table or figure of the paper, in one command --------------------
# NAME: (what it reproduces, {row: its flags}, its figures)
REPRODUCE = {
    "demo": ("the quick start (ours): Janus-LoRA beside the frozen backbone and Fine-Tuning",
             {m: f"--method {m}" for m in ("frozen", "finetune", "janus")}, FIG5),
    "ablation": ("Table 1: OE, GR, DML on and off (rows 1-7)", dict(zip("1234567", [
        "--no-oe --no-gr --no-dml", "--no-oe --no-gr", "--no-gr --no-dml", "--no-oe --no-dml",
        "--no-dml", "--no-gr", ""])), FIG5),
    "methods": ("Tables 2 and 3: the methods we implement",
                {m: f"--method {m}" for m in ("frozen", "finetune", "lora-gpm", "inflora",
                                              "janus")}, {**FIG5, **EFFICIENCY}),
    "oe-vs-gpm": ("Table 5: OE against GPM in one epoch (Janus-LoRA otherwise; our reading)",
                  {"gpm": "--memory gpm --epochs 1", "oe": "--epochs 1"}, {}),
    "gr-plugin": ("Fig. 6: GR as a plug-in to LoRA-GPM",
                  {m: f"--method {m}" for m in ("lora-gpm", "lora-gpm-gr")},
                  {"gr_plugin.png": ("Fig. 6: before and after GR", plot_gr_plugin)}),
    # The sweeps: the paper's text names k = 25, 50 (its default) and 100; m = 0.3 (its default)
    # and 0.5; lambda = 0.5, 1 (its default) and 2. The values between them are ours.
    "k": ("Fig. 4a: the rank k of the OE basis", {f"k{v}": f"--k {v}" for v in (25, 50, 75, 100)},
          {"sweep.png": ("Fig. 4a: ACC, MAA and BWT over k", plot_sweep)}),
    "margin": ("Fig. 4b: the DML margin m",
               {f"m{v}": f"--margin {v}" for v in (0.1, 0.2, 0.3, 0.4, 0.5)},
               {"sweep.png": ("Fig. 4b: ACC, MAA and BWT over m", plot_sweep)}),
    "lambda": ("the appendix's Fig. 8: the DML weight lambda",
               {f"l{v}": f"--lambda-dml {v}" for v in (0.5, 1.0, 1.5, 2.0)},
               {"sweep.png": ("the appendix's Fig. 8: ACC, MAA and BWT over lambda", plot_sweep)}),
    # Table 4's SAM backbone, Segment Anything's encoder, is not implemented (README)
    "backbones": ("Table 4: Janus-LoRA on DINO's pre-training",
                  {w: f"--weights {w}" for w in ("in21k", "dino")}, {}),
}


def reproduce(cfg, argv):
    """Each row as a run in OUT/<row>/ (the jobs of an array share them), then table.md and the
    figures of the rows done, whichever jobs ran them."""
    what, rows, figures = REPRODUCE[cfg.reproduce]
    typed = parse(argv)[0]  # the flags typed, and those that a typed --method sets
    if set_by := sorted({k for flags in rows.values() for k in parse(flags.split())[1]} & {*typed}):
        raise RunError(f"{', '.join(map(flag, set_by))}: set by the rows of --reproduce "
                       f"{cfg.reproduce}: leave it out")
    argv = [a for i, a in enumerate(argv) if a not in ("--dry-run", "--row")  # a row's command:
            and not a.startswith("--row=") and argv[i - 1:i] != ["--row"]]  # the set's argv
    cfgs = {row: replace(configure(argv + flags.split()), reproduce=None,
                         out=os.path.join(cfg.out, row)) for row, flags in rows.items()}
    print(f"--reproduce {cfg.reproduce}: {what}; into {cfg.out}")
    if not (cfg.dry_run or claimed(cfg.out, cfg.reproduce)):  # the set's folder: rows, no run
        os.makedirs(cfg.out, exist_ok=True)
        written(os.path.join(cfg.out, "config.json"), json.dumps({"reproduce": cfg.reproduce}))
    for row in [cfg.row] if cfg.row else rows:
        print(row, f"({rows[row] or 'no flag'}):", command(argv + ["--row", row]), flush=True)
        if not cfg.dry_run:
            run(cfgs[row])
    ends = {} if cfg.dry_run else {row: records(c, claimed(c.out)) for row, c in cfgs.items()}
    done = {row: {"flags": rows[row], "config": asdict(cfgs[row]), "runs": r}
            for row, r in ends.items() if r}
    if done:
        missing = ", ".join(r for r in rows if r not in done)
        differ = len({tuple(r["seed"] for r in row["runs"]) for row in done.values()}) > 1
        title = (f"--reproduce {cfg.reproduce}: {what}; {cfg.dataset}, T={cfg.tasks}"
                 + " (the rows' seeds differ)" * differ + f" (not finished: {missing})" * bool(
                     missing))
        with locked(os.path.join(cfg.out, "lock"), wait=True):  # the last writer sees every row
            paths = [write_table(cfg.out, done, title), *draw(cfg.out, figures, done, title)]
        print(f"wrote {' '.join(paths)}")
    return 0


# ---- --benchmark: the time of a step -------------------------------------------------------------
BENCHMARKED = {"plain": "finetune", "janus-grad": "janus", "janus-update": "janus-update"}


def benchmark(cfg):
    """Plain LoRA's step and Janus-LoRA's (GR on the gradients, ours on Adam's step) in turn on one
    random batch: each one's median time, and its median per-round ratio to plain LoRA's."""
    sync = torch.get_device_module(cfg.device).synchronize  # CUDA's kernels run asynchronously
    classes = data.DATASETS[cfg.dataset]["num_classes"] // cfg.tasks
    backbone = build_model(replace(cfg, weights="none"))  # random weights: the same cost
    w = min(cfg.k * (cfg.tasks // 2), backbone.embed_dim - cfg.k)  # the memory's width at mid-run
    images = torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, device=cfg.device)
    y = torch.randint(0, classes, (cfg.batch_size,), device=cfg.device)
    steps, ms = {}, {name: [] for name in BENCHMARKED}
    defaults = {k: getattr(Options, k) for flags, _ in METHODS.values() for k in parse(
        flags.split())[1]}  # of the flags that a method sets, whatever --method was typed
    for name, method in BENCHMARKED.items():
        vcfg = replace(cfg, **{**defaults, **parse(METHODS[method][0].split())[1]})
        learner = mid_run_learner(vcfg, backbone, w, classes)
        steps[name] = partial(train_step, learner, adam(learner, vcfg), images, y, vcfg)
        for _ in range(5):  # warm-up: the allocator, the kernels, Adam's state
            steps[name]()
    for _ in range(cfg.steps):  # in turn: a change of the machine's speed slows all alike
        for name, step in steps.items():
            sync(cfg.device)
            start = time.perf_counter()
            step()
            sync(cfg.device)  # a step's time ends when its kernels do
            ms[name].append(1e3 * (time.perf_counter() - start))
    print(f"{cfg.model}, batch {cfg.batch_size}, {cfg.img_size} px, memory {w} columns per block, "
          f"{machine(cfg)}, compiled {cfg.compile}, {cfg.steps} rounds:\n"
          "variant        ms/step  images/s  x plain (median)")
    for name, t in ms.items():
        ratio = statistics.median(a / p for a, p in zip(t, ms["plain"]))
        median = statistics.median(t)
        print(f"{name:14s} {median:7.1f} {1e3 * cfg.batch_size / median:9.1f} {ratio:8.3f}")
    return 0


def mid_run_learner(cfg, backbone, w, classes):
    """A learner at mid-run: a random memory of w columns, V and A off it, old prototypes."""
    learner = start_learner(cfg, 0, backbone)
    blocks, D = len(backbone.blocks), backbone.embed_dim
    if cfg.oe:
        learner.memory = list(torch.linalg.qr(torch.randn(blocks, D, w)).Q.to(cfg.device))
        if learner.subspace is not None:  # GPM's memory comes with no OE basis
            learner.subspace.V = fresh_basis(learner.memory, cfg.k)
        for j, layer in enumerate(lora_layers(learner.model)):
            layer.reset_(learner.memory[j // 2] if cfg.lora_a == "off-memory" else None)
    prototypes = F.normalize(torch.randn(classes * (cfg.tasks // 2), D), dim=1)
    learner.prototypes = prototypes.to(cfg.device)
    start_task(learner, 0, [list(range(classes))], None, cfg)
    return learner


# ---- main ----------------------------------------------------------------------------------------
def sigterm(signum, frame):
    """SIGTERM, a scheduler's at a time limit or a pre-emption: it stops the run as Ctrl-C does."""
    raise KeyboardInterrupt(signum)


class Unbroken:
    """Standard output that a reader who has gone (| head) cannot break: the run goes on."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        method = getattr(self.stream, name)
        if name not in ("write", "flush"):
            return method

        def unbroken(*args):
            try:
                return method(*args)
            except BrokenPipeError:  # the Python docs' recipe: the file descriptor onto os.devnull
                os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        return unbroken


def command(argv):
    """The command that runs this program with argv, as it was started (a path, or -m)."""
    return shlex.join(sys.orig_argv[:len(sys.orig_argv) - len(sys.argv) + 1] + argv)


# A file or folder that cannot be written: what to do, by the system's reason.
CANNOT_WRITE = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some of the quota",
                errno.EFBIG: "raise the limit on a file's size (ulimit -f)"}


def main(argv=None):
    """python janus_min.py [flags]. Bad input: one line that says what to do (exit 2); Ctrl-C and
    SIGTERM: the command that continues (130, 143); any other error is a bug: its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    handler = signal.signal(signal.SIGTERM, sigterm)
    for stream in (sys.stdout, sys.stderr):  # a locale without "±": "\xb1" in its place
        getattr(stream, "reconfigure", lambda **kw: None)(errors="backslashreplace")
    stdout, sys.stdout = sys.stdout, Unbroken(sys.stdout)
    try:
        cfg = configure(argv)
        if cfg.benchmark:
            return benchmark(cfg)
        return reproduce(cfg, argv) if cfg.reproduce else run(cfg)
    except (RunError, data.DataError, vit.CheckpointError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the run's folder or files: the rest are the data's and the weights'
        fix = CANNOT_WRITE.get(e.errno)
        fix = f"{fix}, then run the same command: the run goes on after its last saved task" if \
            fix else "choose another --out, or make this one writable"
        print(f"error: cannot write {e.filename}: {e.strerror}: {fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        print(f"\ninterrupted ({signal.Signals(signum).name}): the same command continues: "
              f"{command(argv)}", file=sys.stderr)
        return 128 + signum
    finally:
        sys.stdout = stdout
        signal.signal(signal.SIGTERM, handler)
        data.end_workers()


if __name__ == "__main__":
    sys.exit(main())
