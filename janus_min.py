"""Janus-LoRA (C. Chen et al., ICML 2026), minimal: class-incremental learning with a frozen ViT and
LoRA on K and V, made stable by Online Estimation (OE) and Gradient Rectification (GR), plastic by
the Decoupled Margin Loss (DML). Part 1 reads top-down beside the paper's Sec. 3, to `main`; Part 2
is the program around it. Equations as numbered in the paper's LaTeX source; the protocol is
InfLoRA's (Liang & Li, CVPR 2024)."""
import argparse
import copy
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial

import torch
import torch.nn.functional as F
import torchvision

import data
import vit

def _opt(default, help, **argparse_kw):
    """A configuration field: its default and its --help line (meaning and source)."""
    return field(default=default, metadata=dict(help=help, **argparse_kw))

@dataclass
class Config:
    """Every flag of `python janus_min.py --help`. None: the data set's default (data.DATASETS)."""
    # data and protocol (paper Sec. 4.1 and the InfLoRA codebase, which the paper ran on)
    dataset: str = _opt("cifar100", "data set (Sec. 4.1)", choices=list(data.DATASETS))
    data_dir: str = _opt("data", "folder that holds (or receives) the data set")
    tasks: int = _opt(None, "tasks T (default: the protocol's; CIFAR-100 10)")
    epochs: int = _opt(None, "epochs per task (default: CIFAR-100 20, ImageNet-R 50, DomainNet 5)")
    batch_size: int = _opt(None, "batch size (default: 128, Sec. 4.1; synthetic 16)")
    img_size: int = _opt(None, "input resolution (default: 224, the paper's; synthetic 64)")
    limit_per_class: int = _opt(None, "keep at most this many training images per class")
    input_range: str = _opt("unit", "unit: [0, 1], as InfLoRA's code; checkpoint: as --weights's",
                            choices=["unit", "checkpoint", "half", "imagenet"])
    # the backbone and its LoRA pairs (Sec. 3.1, 4.1)
    model: str = _opt("vit_base", "backbone (the paper's: ViT-B/16)", choices=list(vit.PRESETS))
    weights: str = _opt("in21k", "in21k (paper), sam, dino (Table 4), torchvision, none, or a file")
    patch_size: int = _opt(16, "patch size (the paper's: 16; another needs --weights none)")
    rank: int = _opt(10, "LoRA rank r on K and V (Sec. 4.1)")
    lora_scale: float = _opt(1.0, "LoRA scale s, Eq. (1) (ours: the paper does not give it)")
    # the method (Sec. 3 and 4.1), and our readings where the paper is silent (README)
    method: str = _opt(None, "a method of the paper's tables, as a preset of flags put first")
    lr: float = _opt(5e-4, "Adam's learning rate (Sec. 4.1; the InfLoRA codebase)")
    schedule: str = _opt("inflora", "lr per epoch: InfLoRA's quarter cosine, or a half cosine",
                         choices=["inflora", "cosine"])
    k: int = _opt(50, "rank k of the OE basis V of each block and task (Sec. 4.1)")
    oe_lr: float = _opt(1.0, "OE's step eta at a task's start; 1: subspace iteration (ours)")
    oe_decay_steps: int = _opt(5, "OE's step halves after this many, then decays as 1/t (ours)")
    delta: float = _opt(1e-4, "GR's ridge delta, relative to the mean eigenvalue (ours)")
    margin: float = _opt(0.3, "DML's margin m (Sec. 4.1)")
    lambda_dml: float = _opt(1.0, "DML's weight lambda, Eq. (12) (Sec. 4.1)")
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
    # the run
    seeds: list = _opt((0,), "seeds; several give mean +- std (the paper: 5)", nargs="+", type=int)
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    precision: str = _opt("bf16", "CUDA's: bf16 autocast (ours) or fp32 (InfLoRA's); CPU: fp32",
                          choices=["bf16", "fp32"])
    compile: str = _opt("off", "on: compiled ViT blocks, on CUDA a step as a CUDA graph (ours)",
                        choices=["on", "off"], nargs="?", const="on")
    workers: int = _opt(None, "loader processes of the file-based data sets (default: the cores)")
    out: str = _opt(None, "output folder (default runs/<dataset>-<time>)")
    resume: str = _opt(None, "continue the run in this folder after its last finished task")
    # the other modes
    benchmark: bool = _opt(False, "time plain LoRA and Janus steps, then exit", action="store_true")
    steps: int = _opt(20, "--benchmark: timed rounds (after 5 warm-up steps)")
    reproduce: str = _opt(None, "run each row of a table or figure of the paper, then table.md")
    row: str = _opt(None, "with --reproduce: run this row alone (one job of an array)")
    dry_run: bool = _opt(False, "with --reproduce: print the rows' commands", action="store_true")

# ==== The paper's method (Sec. 3), one step as "The Integrated Janus-LoRA Update Process" =========
def train_step(learner, opt, images, y, cfg):
    """One training step: the loss, OE's step, the safe gradient, GR, Adam. The learner (Learner)
    holds the ViT with its LoRA pairs, the task's head (heads[-1]), OE's bases, each block's
    protected memory M (the finished tasks' OE bases) and DML's old prototypes. In task 1, M is
    empty and there are no old prototypes, so the projection and DML's hinge do nothing yet. opt:
    Adam (lr set per epoch) on the LoRA factors and the head. y: labels within the task. Returns
    the loss and the number right, as tensors (reading them would wait for a GPU)."""
    model, head = learner.model, learner.heads[-1]
    if cfg.oe and cfg.memory == "oe-rolling":  # the paper's words read literally: M is V as it
        for M, V in zip(learner.memory, learner.oe.basis):  # stands (not the default)
            M.copy_(V)
    # LOSS, Eq. (12): the current head's cross-entropy plus lambda times DML, Eq. (11). The LoRA
    # layers take M in this forward pass: that is where the safe gradient is prepared (below).
    # z (B, D): the class token after the final LayerNorm. kv_inputs: each block's input to K and
    # V, (B, N+1, D); K and V share it, so a block has one M. Autocast: bf16 on CUDA, else none.
    with autocast(images.device, cfg):
        z, kv_inputs = model.encode(images, learner.memory)
    z = z.float()
    logits = head(z)
    loss = F.cross_entropy(logits, y)
    if cfg.dml:
        dml = dml_loss(z, y, learner.prototypes, cfg.margin, cfg.tau, head.out_features)
        loss = loss + cfg.lambda_dml * dml
    # OE, Eqs. (8)-(10): each block's basis V takes a step on this batch's K/V inputs. Ours: V
    # joins M at the task's end, and the projection uses M, never V: projecting out the current
    # task's own subspace would remove most of this task's gradient.
    if cfg.oe and cfg.memory != "gpm":
        learner.oe.update(kv_inputs, learner.memory if cfg.memory == "oe" else None)
    del kv_inputs  # released before the backward pass peaks
    # SAFE GRADIENT, Theorem 3.1, Eq. (3): G_safe = G (I - M M^T) for G = dL/dW of each K/V layer.
    # vit.LoRALinear.forward held A's part in span(M) constant, so backward returns the chain
    # rule of G_safe (the paper's Eq. (4), transposed there and without s): s B^T G_safe for A and
    # s G_safe A^T for B.
    opt.zero_grad(set_to_none=True)
    loss.backward()
    layers = [layer for _, _, layer in model.lora_layers()]
    # GR, Eqs. (5)-(7): the factor gradients whose composite s (B dA + dB A) best matches G_safe.
    # The paper's GR rectifies a step -eta G; being linear, it can take G itself.
    if cfg.gr and cfg.rectify == "grad":
        rectify_gradients_(layers, cfg.delta)
    # ADAM takes them, as the paper says. Its per-coordinate scaling moves the step out of the
    # safe set; ours, --rectify update, lets GR act on the step Adam proposes instead.
    if cfg.gr and cfg.rectify == "update":
        rectified_adam_step_(opt, layers, learner.memory, cfg.delta)
    else:
        opt.step()
    return loss.detach(), (logits.argmax(1) == y).sum()

# ---- The Decoupled Margin Loss, Eq. (11) ---------------------------------------------------------
def dml_loss(z, y, old_prototypes, margin=0.3, tau=0.07, num_classes=None):
    """Eq. (11). z (B, D) features, y (B,) labels of the current task (of num_classes), old
    prototypes (P, D) unit rows. The current prototypes: the batch's unit class means, through
    which the gradient flows too (ours: the paper does not say)."""
    z = F.normalize(z.float(), dim=1)
    onehot = F.one_hot(y, num_classes or int(y.max()) + 1).float()  # (B, C)
    protos = F.normalize(onehot.T @ z, dim=1)  # (C, D); a class absent from the batch: 0
    absent = onehot.sum(0) == 0  # (C,): out of the softmax, which runs over the batch's classes
    logits = (z @ protos.T / tau).masked_fill(absent, -math.inf)
    intra = F.cross_entropy(logits, y)  # -log softmax of z.p_y / tau
    if old_prototypes.shape[0] == 0:
        return intra
    return intra + F.relu(z @ old_prototypes.T - margin).mean()  # hinge: mean over batch x old

# ---- OE: Online Estimation, Eqs. (8)-(10) --------------------------------------------------------
class OnlineSubspace:
    """OE's basis V (D, k) of the current task's K/V inputs, orthonormal and off the memory M; for
    all blocks at once with blocks=L: V (L, D, k). The memory itself is the learner's."""

    def __init__(self, dim, k, lr=1.0, decay_steps=5, device=None, blocks=None):
        self.dim, self.k, self.blocks = dim, k, blocks
        self.lr, self.decay_steps = lr, decay_steps
        self.basis = self.fresh_basis(None, device)
        self.steps = torch.zeros((), device=device)  # this task's steps so far: the step decays

    def fresh_basis(self, memory, device=None):
        """A random orthonormal V off the memory (None: empty); a full memory leaves no room."""
        M = _stacked(memory)
        k = self.k if M is None else min(self.k, self.dim - M.shape[-1])
        # drawn on the CPU: a run's random numbers must not depend on the device
        V = torch.randn(*[self.blocks] * bool(self.blocks), self.dim, k)
        return torch.linalg.qr(_off(V.to(device if M is None else M.device), M)).Q

    @torch.no_grad()
    def update(self, X, memory=None):
        """One step on Eq. (8), (1/2) ||X_p - X_p V V^T||^2; ours: X_p = X (I - M M^T), X all the
        batch's tokens, (B, N+1, D) per block (or (n, D) for one block); memory: M (D, m) each."""
        V, M = self.basis, _stacked(memory)
        if V.shape[-1] == 0:  # a full memory: nothing left to learn
            return
        XtXV, S = [], []
        for x, v in zip(X if self.blocks else [X], V if self.blocks else [V]):
            x = x.reshape(-1, self.dim)  # (n, D), in its own dtype: bf16 under autocast
            xv = x @ v.to(x.dtype)  # (n, k); equals X_p V, as V is orthogonal to M
            XtXV.append((x.T @ xv).float())
            S.append(_gram(xv))  # (k, k): the energy each direction captures
        CV = _off(torch.stack(XtXV).reshape(V.shape), M)  # X_p^T X_p V
        S = _ridge(torch.stack(S).reshape(*V.shape[:-2], *S[0].shape), 1e-6)  # invertible at X = 0
        grad = -(CV - V @ (V.mT @ CV))  # the gradient of Eq. (8) at an orthonormal V
        grad = _spd_solve(S, grad.mT.double()).mT.to(V.dtype)  # ours: grad S^-1, scale-free
        lr = torch.full_like(self.steps, self.lr * self.decay_steps)  # ours: eta decays as 1/t;
        lr = lr / (self.decay_steps + self.steps)  # at 1, a step of subspace iteration, C V S^-1
        V_tilde = V - lr * grad  # Eq. (9), its step preconditioned by S^-1 (ours)
        V = _qr_q(V_tilde)  # Eq. (10): V <- Q of V_tilde = QR; ours: R's diagonal > 0 (no flips)
        self.basis.copy_(_off(V, M))  # off M again: no round-off leaks into span(M)
        self.steps += 1

    @torch.no_grad()
    def merge(self, memory):
        """A task's end (ours): M <- orth([M, V]) per block; returns it, with a fresh V off it."""
        M = torch.linalg.qr(torch.cat([_stacked(memory), self.basis], dim=-1)).Q
        self.basis = self.fresh_basis(M)
        self.steps.zero_()
        return list(M) if self.blocks else M

# ---- GR: Gradient Rectification, Eqs. (5)-(7) ----------------------------------------------------
def rectify_gradients_(layers, delta):
    """Replace the LoRA pairs' factor gradients by GR's, all layers in one batch."""
    A = torch.stack([layer.A.detach() for layer in layers])  # (L, r, d_in)
    B = torch.stack([layer.B.detach() for layer in layers])  # (L, d_out, r)
    s = layers[0].scale
    # autograd left Eq. (4)'s chain rule applied to G_safe, s B^T G_safe and s G_safe A^T;
    # GR's Eqs. (6)-(7) take them without s
    BtG = torch.stack([layer.A.grad for layer in layers]) / s  # B^T G_safe (L, r, d_in)
    GAt = torch.stack([layer.B.grad for layer in layers]) / s  # G_safe A^T (L, d_out, r)
    dA, dB = rectify_factors(BtG, GAt, A, B, s, delta)
    for layer, a, b in zip(layers, dA, dB):
        layer.A.grad.copy_(a)
        layer.B.grad.copy_(b)

def rectify_factors(BtG, GAt, A, B, scale, delta=1e-4):
    """GR from B^T G_safe (..., r, d_in) and G_safe A^T (..., d_out, r) alone, never G_safe."""
    dtype = BtG.dtype
    BtG, GAt, A, B = BtG.double(), GAt.double(), A.double(), B.double()
    dA = _spd_solve(_ridge(_gram(B), delta), BtG) / scale  # Eq. (6); delta relative (ours)
    RAt = GAt - scale * B @ (dA @ A.mT)  # R A^T, with the residual R = G_safe - s B dA
    dB = _spd_solve(_ridge(_gram(A.mT), delta), RAt.mT).mT / scale  # Eq. (7)
    return dA.to(dtype), dB.to(dtype)

# ---- Small linear algebra that OE and GR share ---------------------------------------------------
def _off(V, M):
    """(I - M M^T) V: V's columns without their part in span(M); M None: V itself."""
    return V if M is None else V - M @ (M.mT @ V)

def _off_rows(G, M):
    """G (I - M M^T): G's rows off span(M), Theorem 3.1's form for a dense G (..., d_out, d_in)."""
    return G if M.shape[-1] == 0 else G - (G @ M) @ M.mT

def _stacked(memory):
    """Memories per block (D, m_i) as one (L, D, m), zero columns padding GPM's narrower ones."""
    if not isinstance(memory, list):
        return memory
    m = max(M.shape[1] for M in memory)
    return torch.stack([F.pad(M, (0, m - M.shape[1])) for M in memory])

def _gram(X):
    """X^T X (..., k, k) of X (..., n, k) in float64: float32's round-off can fail Cholesky."""
    X = X.double()
    return X.mT @ X

def _ridge(S, delta):
    """S + delta * mean(eig S) * I for Gram matrices S (..., r, r)."""
    lam = delta * S.diagonal(dim1=-2, dim2=-1).mean(-1) + torch.finfo(S.dtype).tiny  # S = 0: finite
    return S + lam[..., None, None] * torch.eye(S.shape[-1], dtype=S.dtype, device=S.device)

def _qr_q(V):
    """Eq. (10)'s Q of V = QR (..., n, k) with R's diagonal > 0: R^T is the Cholesky factor of
    V^T V (>= I, as OE's step is orthogonal to V), in float64; far faster than Householder QR."""
    R = torch.linalg.cholesky_ex(_gram(V)).L.mT
    return torch.linalg.solve_triangular(R, V.double(), upper=True, left=False).to(V.dtype)

def _spd_solve(S, rhs):
    """S^-1 rhs for positive definite S (..., n, n) by Cholesky: no check waits on the host."""
    L = torch.linalg.cholesky_ex(S).L
    y = torch.linalg.solve_triangular(L, rhs, upper=False)
    return torch.linalg.solve_triangular(L.mT, y, upper=True)

# ==== Ours: --rectify update, GR on the step Adam proposes (README) ===============================
def rectified_adam_step_(opt, layers, memory, delta):
    """Adam proposes a step, which GR then rectifies."""
    before = [(layer.A.detach().clone(), layer.B.detach().clone()) for layer in layers]
    opt.step()
    rectify_updates_(layers, before, [memory[j // 2] for j in range(len(layers))], delta)

@torch.no_grad()
def rectify_updates_(layers, before, memories, delta):
    """The step Adam took from `before`, each layer's (A, B), as dW = s (B dA + dB A): projected by
    Theorem 3.1, rectified by GR, and split between A and B with the least norm."""
    A0 = torch.stack([a for a, _ in before])  # (L, r, d_in)
    B0 = torch.stack([b for _, b in before])  # (L, d_out, r)
    s = layers[0].scale
    dA = torch.stack([layer.A for layer in layers]) - A0  # Adam's proposed step
    dB = torch.stack([layer.B for layer in layers]) - B0
    M = _stacked(memories)
    # B^T dW_safe and dW_safe A^T, with r-wide products only
    BtW = _off_rows(s * ((B0.mT @ B0) @ dA + (B0.mT @ dB) @ A0), M)
    Ap = _off_rows(A0, M).mT  # (I - M M^T) A^T  (L, d_in, r)
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
    P, Q = _gram(B), _gram(A.mT)  # (..., r, r)
    r, batch = P.shape[-1], P.shape[:-2]
    I = torch.eye(r, dtype=P.dtype, device=P.device)
    # row-major vec(P C + C Q) = (P kron I + I kron Q) vec(C): an r^2 x r^2 positive semidefinite
    # system, consistent, solved with a round-off ridge (its least-norm solution where singular)
    K = torch.einsum("...ik,jl->...ijkl", P, I) + torch.einsum("ik,...jl->...ijkl", I, Q)
    K = _ridge(K.reshape(*batch, r * r, r * r), r * torch.finfo(P.dtype).eps)
    rhs = (B.mT @ dB - dA @ A.mT).reshape(*batch, r * r, 1)
    C = _spd_solve(K, rhs).reshape(P.shape)
    return (dA + C @ A).to(dtype), (dB - B @ C).to(dtype)

# ==== The baselines: GPM's memory (LoRA-GPM) and InfLoRA's A, as the InfLoRA codebase ============
@torch.no_grad()
def kv_covariance(model, images, cfg, memory=None):
    """Each block's uncentred K/V-input covariance (L, D, D) over every token of the images."""
    C, n = 0.0, 0
    for _, kv_inputs, _ in batches(model, images, cfg, memory):
        X = [x.float().flatten(0, 1) for x in kv_inputs]  # (B * N, D) per block
        C = C + torch.stack([x.T @ x for x in X])
        n += X[0].shape[0]
    return C / n

def gpm_extend(M, C, threshold):
    """GPM: M (D, m) plus the fewest leading directions of (I - M M^T) C that bring the captured
    share of C's energy to the threshold; a direction's energy is its squared singular value."""
    C, M64 = C.double(), M.double()  # once a task: float64 keeps the memory orthonormal
    total = torch.linalg.svdvals(C).square().sum()
    U, s, _ = torch.linalg.svd(C - M64 @ (M64.T @ C))
    e = s.square() / total  # (D,) each residual direction's share
    before = (1 - e.sum()) + torch.cumsum(e, 0) - e  # the share held before adding direction i
    r = min(int((before < threshold).sum()), C.shape[0] - M.shape[1])  # never past the width
    return torch.cat([M, U[:, :r].to(M.dtype)], dim=1)

def inflora_a(C, M, rank):
    """InfLoRA's A (r, D), off span(M): top-r left singular vectors of (I - M M^T) C, / sqrt(3)."""
    C, M64 = C.double(), M.double()  # float64: the trailing vectors' round-off stays off M
    U = _off(torch.linalg.svd(C - M64 @ (M64.T @ C)).U[:, :rank], M64)
    return (U.T / math.sqrt(3)).to(M.dtype)

# ==== The task loop (InfLoRA's protocol: a head per task, no exemplars, no task id at test) =======
@dataclass
class Learner:
    """One seed's run: what a task leaves to the next, and what was measured so far."""
    seed: int
    model: torch.nn.Module  # the ViT; each K/V layer's LoRA pair, merged at each task's end
    oe: OnlineSubspace  # OE's basis V of each block for the current task, (L, D, k)
    memory: list  # the protected memory M of each block, (D, m); the LoRA forward projects with it
    heads: torch.nn.ModuleList  # one linear head per task so far
    prototypes: torch.Tensor  # (old classes, D), unit rows: DML's C_past
    acc: list = field(default_factory=list)  # task-agnostic accuracy rows (the paper's)
    aware: list = field(default_factory=list)  # task-aware rows (ours)
    sample_acc: list = field(default_factory=list)  # per row, over all seen test samples
    task_seconds: list = field(default_factory=list)  # training and the method's own passes
    throughput: list = field(default_factory=list)  # per task: images/s of each epoch
    analyses: dict = field(default_factory=dict)  # the paper's analyses (Part 2 records them)

def start_learner(cfg, seed, base_model):
    """A fresh Learner for `seed`: the backbone copied (never changed), fresh LoRA pairs and OE."""
    torch.manual_seed(seed)  # the only generator a run draws from (the loaders seed their own)
    model = copy.deepcopy(base_model).to(cfg.device)
    for _, _, layer in model.lora_layers():
        layer.reset_lora_()  # the first task's A comes from this seed too
    if cfg.compile == "on":  # in place: the parameter names, and so the checkpoints, stay the same
        torch._dynamo.config.recompile_limit = 64  # a block meets new shapes as the memory grows
        for block in model.blocks:
            block.compile()
    L, D = len(model.blocks), model.embed_dim
    oe = OnlineSubspace(D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, cfg.device, blocks=L)
    empty = [torch.zeros(D, 0, device=cfg.device)] * L  # task 1 has nothing to protect
    return Learner(seed, model, oe, empty, torch.nn.ModuleList(), torch.zeros(0, D).to(cfg.device))

def start_task(learner, t, tasks, splits, cfg):
    """Task t's start: a fresh head; with --lora-a inflora, InfLoRA designs each block's A from
    the task's K/V inputs (test transform) off the memory, and freezes it."""
    model = learner.model
    learner.heads.append(torch.nn.Linear(model.embed_dim, len(tasks[t])).to(cfg.device))
    learner.oe.steps.zero_()  # each task's OE starts with large steps
    if cfg.oe and cfg.memory == "oe-rolling":  # V, as it stands, is M (train_step keeps it so)
        learner.memory = list(learner.oe.basis.clone())
    for _, _, layer in model.lora_layers():
        layer.A.requires_grad_(cfg.lora_a == "trained")  # InfLoRA trains B only
    if cfg.lora_a == "inflora":
        C = kv_covariance(model, data.subset(splits.train_eval, tasks[t]), cfg)  # (L, D, D)
        A = [inflora_a(C_i, M, cfg.rank) for C_i, M in zip(C, learner.memory)]  # K, V share an A
        with torch.no_grad():
            for i, _, layer in model.lora_layers():
                layer.A.copy_(A[i])

def make_step(learner, cfg):
    """Adam (betas 0.9, 0.999, as InfLoRA) on the trainable LoRA factors and the current head, and
    step(images, y), a train_step with them; on CUDA with --compile on, a StepGraph."""
    params = [p for p in learner.model.lora_parameters() if p.requires_grad]
    params += learner.heads[-1].parameters()
    graphed = cfg.compile == "on" and cfg.device.startswith("cuda")
    lr = torch.tensor(cfg.lr, device=cfg.device) if graphed else cfg.lr  # a graph reads a tensor
    opt = torch.optim.Adam(params, lr=lr, capturable=graphed)
    return opt, partial(StepGraph(train_step) if graphed else train_step, learner, opt, cfg=cfg)

def train_task(learner, t, tasks, splits, cfg):
    """Task t's training: cfg.epochs epochs of train_step; a line per epoch, and one every 30 s."""
    local = torch.full((splits.num_classes,), -1, device=cfg.device)  # class id -> head's index
    local[tasks[t]] = torch.arange(len(tasks[t]), device=cfg.device)
    seed = learner.seed * 1000 + t  # the loader's own generator: its order, crops and flips
    loader = data.make_loader(data.subset(splits.train, tasks[t]), cfg.batch_size, True,
                              cfg.workers, seed, cfg.device)
    opt, step = make_step(learner, cfg)
    learner.throughput.append([])
    for epoch in range(cfg.epochs):
        lr = cfg.lr * lr_factor(epoch, cfg.epochs, cfg.schedule)
        for group in opt.param_groups:  # a CUDA graph's lr is a tensor: changed in place
            group["lr"] = group["lr"].fill_(lr) if torch.is_tensor(group["lr"]) else lr
        start = shown = time.time()
        loss_sum, correct, seen = 0.0, 0, 0
        for i, (images, y) in enumerate(loader, 1):
            images, y = images.to(cfg.device, non_blocking=True), local[y.to(cfg.device)]
            loss, right = step(images, y)
            loss_sum = loss_sum + loss * len(y)  # tensors: read once an epoch
            correct = correct + right
            seen += len(y)
            if time.time() - shown > 30:
                shown = time.time()
                print(f"task {t + 1} epoch {epoch + 1}: {i}/{len(loader)} steps, loss "
                      f"{float(loss_sum) / seen:.4f}", flush=True)
        mean_loss, speed = float(loss_sum) / seen, seen / (time.time() - start)
        if not math.isfinite(mean_loss):  # a diverged run must not go on to write results
            raise FloatingPointError(f"task {t + 1} epoch {epoch + 1}: the loss is {mean_loss}; "
                                     "lower --lr and start a new run")
        learner.throughput[-1].append(speed)
        print(f"task {t + 1}/{cfg.tasks} epoch {epoch + 1}/{cfg.epochs}  loss {mean_loss:.4f}  "
              f"train acc {100.0 * float(correct) / seen:5.2f}%  {speed:7.1f} img/s", flush=True)

def lr_factor(epoch, epochs, schedule):
    """The lr of a task's epoch, as a factor of --lr: InfLoRA's CosineSchedule as its code steps
    it, cos(99 pi e / (200 (K - 1))) for e = epoch - 1 after an epoch at 1; or a half cosine."""
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * epoch / epochs))
    if epoch == 0 or epochs == 1:  # the codebase divides by zero at K = 1; one epoch at lr
        return 1.0
    return math.cos(99 * math.pi * (epoch - 1) / (200 * (epochs - 1)))

@torch.no_grad()
def end_task(learner, t, tasks, splits, cfg):
    """Task t's end: DML's prototypes of its classes, the memory's update, the LoRA merge. Returns
    the task's factors (A, B) per layer, from before the merge (for the analyses)."""
    images = data.subset(splits.train_eval, tasks[t])  # the test transform
    memory = learner.memory  # these passes run the forward as training ran it, round-off too
    z, y = features(learner.model, images, cfg, memory)
    learner.prototypes = torch.cat([learner.prototypes, class_prototypes(z, y, tasks[t])])
    if cfg.oe and cfg.memory == "oe":  # this task's OE basis joins the memory
        learner.memory = learner.oe.merge(learner.memory)
    elif cfg.oe and cfg.memory == "oe-rolling":  # the basis goes on to the next task as it is
        learner.memory = list(learner.oe.basis.clone())
    elif cfg.oe:  # GPM's pass over the task's images, timed with the task: OE exists to avoid it
        C = kv_covariance(learner.model, images, cfg, memory)
        first, last = cfg.gpm_threshold  # InfLoRA's schedule: t / T of the way, t from 0
        threshold = first + (last - first) * t / cfg.tasks
        learner.memory = [gpm_extend(M, C_i, threshold) for M, C_i in zip(learner.memory, C)]
    layers = learner.model.lora_layers()
    factors = [(layer.A.detach().clone(), layer.B.detach().clone()) for _, _, layer in layers]
    for i, _, layer in layers:
        layer.merge_(learner.memory[i])  # ours: W += s B A, then a fresh pair with A off M
    return factors

@torch.no_grad()
def class_prototypes(z, y, classes):
    """(len(classes), D): each class's normalised mean of normalised features (DML's C_past)."""
    z = F.normalize(z, dim=1)
    return torch.stack([F.normalize(z[y == c].mean(0), dim=0) for c in classes])

@torch.no_grad()
def evaluate(model, heads, splits, tasks, cfg):
    """Row t of the accuracy matrices: per seen task, task-agnostic (the paper's: an argmax over all
    heads) and task-aware (ours: the true task's head); and over the seen test samples (InfLoRA)."""
    seen = torch.tensor([c for classes in tasks[:len(heads)] for c in classes], device=cfg.device)
    z, y = features(model, data.subset(splits.test, seen.tolist()), cfg)
    task_of = torch.empty(int(seen.max()) + 1, dtype=torch.long, device=cfg.device)
    for i, classes in enumerate(tasks[:len(heads)]):
        task_of[classes] = i
    logits = torch.cat([h(z) for h in heads], dim=1)  # (n, seen classes), in the order of `seen`
    other_task = task_of[seen][None, :] != task_of[y][:, None]  # (n, seen classes)
    agnostic = seen[logits.argmax(1)]
    aware = seen[logits.masked_fill(other_task, -math.inf).argmax(1)]
    rows = [[100.0 * float((pred == y)[task_of[y] == i].float().mean()) for i in range(len(heads))]
            for pred in (agnostic, aware)]
    return rows[0], rows[1], 100.0 * float((agnostic == y).float().mean())

@torch.no_grad()
def features(model, images, cfg, memory=None):
    """z (n, D) and labels y (n,) of the images, in order (test transform)."""
    return [torch.cat(t) for t in zip(*[(z, y) for z, _, y in batches(model, images, cfg, memory)])]

def batches(model, images, cfg, memory=None):
    """(z, K/V inputs, y) of each batch of the images, in order, under the run's autocast."""
    for x, y in data.make_loader(images, cfg.batch_size, False, cfg.workers, 0, cfg.device):
        with autocast(torch.device(cfg.device), cfg):
            z, kv_inputs = model.encode(x.to(cfg.device), memory)
        yield z.float(), kv_inputs, y.to(cfg.device)

def autocast(device, cfg):
    """bf16 autocast on CUDA unless --precision fp32 (the InfLoRA codebase's); none on the CPU."""
    use = device.type == "cuda" and cfg.precision == "bf16"
    return torch.autocast(device.type, torch.bfloat16, enabled=use)

def run_seed(learner, splits, cfg, after_task):
    """One seed: every task not finished yet, in turn; after_task(learner, t, factors, memory)
    records the analyses and saves the learner (Part 2)."""
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    for t in range(len(learner.acc), cfg.tasks):
        start = time.time()  # a task's time: training and the method's own passes, not the tests
        start_task(learner, t, tasks, splits, cfg)
        train_task(learner, t, tasks, splits, cfg)
        memory = learner.memory  # what this task's updates were to stay off
        factors = end_task(learner, t, tasks, splits, cfg)
        learner.task_seconds.append(time.time() - start)
        acc, aware, sample = evaluate(learner.model, learner.heads, splits, tasks, cfg)
        learner.acc.append(acc)
        learner.aware.append(aware)
        learner.sample_acc.append(sample)
        print(f"task {t + 1} accuracy per task: {' '.join(f'{a:.2f}' for a in acc)}  | mean "
              f"{sum(acc) / len(acc):.2f}  | over samples {sample:.2f}  | task-aware mean "
              f"{sum(aware) / len(aware):.2f}  | {learner.task_seconds[-1]:.1f} s", flush=True)
        after_task(learner, t, factors, memory)
    return learner

def main(argv=None):
    """python janus_min.py [flags]: every seed's tasks, then results.json and the plots."""
    run = None
    try:
        cfg, argv = configure(argv)  # Part 2 from here on: the flags, checked
        if cfg.benchmark:
            return benchmark(cfg)
        if cfg.reproduce:
            return reproduce(cfg, argv)
        run = Run(cfg, argv)  # the run folder, the data, the backbone, what a resume continues
        for seed in run.seeds_left():
            learner = start_learner(cfg, seed, run.model)
            run.restore(learner)  # a seed interrupted before goes on after its last finished task
            run_seed(learner, run.splits, cfg, run.after_task)
            run.finish(learner)  # its entry in results.json
        run.finish()  # the summary, and the plots
    except USER_ERRORS as e:  # bad input, a diverged loss, a file: one line that says what to do
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: " + (f"continue with: python janus_min.py --resume {q(run.out)}"
                                   if run else "nothing was saved"), file=sys.stderr)
        return 130
    return 0

# ==== PART 2. The program around the method: flags, the run folder, results, the analyses, plots,
# --benchmark, --reproduce. Nothing above needs it to be understood. ==============================
METHODS = {"janus": "", "janus-rolling": "--memory oe-rolling",  # --method NAME: its flags
           "finetune": "--no-oe --no-gr --no-dml", "lora-gpm": "--memory gpm --no-gr --no-dml",
           "lora-gpm-gr": "--memory gpm --no-dml",
           "inflora": "--memory gpm --lora-a inflora --no-gr --no-dml"}
GPM_THRESHOLDS = {"imagenet-r": (0.98, 1.0)}  # InfLoRA's configs; the others 0.95, 1.0
RESUME_FREE = ("resume", "device", "workers", "compile", "seeds")  # may change on --resume
EXAMPLES = """examples:
  python janus_min.py --dataset synthetic --model vit_tiny --weights none   # a first run
  python janus_min.py --dataset cifar100 --data-dir data --seeds 0 1 2 3 4 --out runs/cifar
  python janus_min.py --resume runs/cifar                                  # after an interruption
  python janus_min.py --reproduce ablation --dataset imagenet-r --dry-run"""

class ConfigError(Exception):
    """Flags that cannot run together, or a run folder that cannot be used."""

# what main turns into one line: bad input, a diverged loss, a file that cannot be read or written
USER_ERRORS = (ConfigError, vit.CheckpointError, data.DataError, FloatingPointError, OSError)
q = shlex.quote  # a path as one shell word: a suggested command pastes as it is

def _require(ok, fix):
    if not ok:
        raise ConfigError(fix)

def _flag(name):
    return "--" + name.replace("_", "-")

def typed_flags(argv):
    """{field: value} of the flags typed in argv (argparse's own errors for bad ones)."""
    p = argparse.ArgumentParser(prog="janus_min.py", description=__doc__.split(". Part 1")[0],
                                epilog=EXAMPLES, formatter_class=argparse.RawTextHelpFormatter,
                                argument_default=argparse.SUPPRESS)  # only what was typed
    choices = {"method": list(METHODS), "reproduce": list(REPRODUCE)}
    for f in fields(Config):
        kw = dict(f.metadata, **({"choices": choices[f.name]} if f.name in choices else {}))
        if f.type is bool and f.default:  # the ablation's switches: on unless --no-NAME
            p.add_argument("--no-" + f.name, dest=f.name, action="store_false", help=kw["help"])
            continue
        if f.type is not bool:
            kw.setdefault("type", {int: int, float: float}.get(f.type, str))
            shown = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            kw["help"] += "" if f.default is None else f" (default: {shown})"
        p.add_argument(_flag(f.name), **kw)
    return vars(p.parse_args(argv))

def parse_args(argv):
    """The Config of argv, its --method preset's flags put first (the flags typed override them)."""
    typed = typed_flags(argv)
    return Config(**{**typed_flags(METHODS.get(typed.get("method"), "").split()), **typed})

def to_argv(values):
    """The flags that give these Config values."""
    argv = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(_flag(name) if value else "--no-" + name)
        else:
            argv += [_flag(name), *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return argv

def configure(argv=None):
    """The command line's checked Config and its flags (--resume: the run's, then those typed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    typed = typed_flags(argv)
    if "resume" in typed:
        path = os.path.join(typed["resume"], "config.json")
        fixed = " ".join(_flag(name) for name in typed if name not in RESUME_FREE)
        _require(not fixed, f"--resume continues a run with its own flags: drop {fixed} (only "
                 "--device, --workers, --compile and more --seeds may change)")
        _require(os.path.isfile(path), f"--resume: no run to continue, {q(path)} is missing; "
                 "start one with --out")
        saved = read_json(path)["argv"]
        old = parse_args(saved).seeds
        _require(set(typed.get("seeds", old)) >= set(old), f"--resume: the run has the seeds "
                 f"{' '.join(map(str, old))}; give all of them (and more to add seeds) or none")
        argv = saved + to_argv({k: v for k, v in typed.items() if k != "resume"})
    cfg = check_config(parse_args(argv))
    cfg.resume = typed.get("resume")
    moot = {"memory k oe_lr oe_decay_steps gpm_threshold": not cfg.oe,  # no effect: a note
            "k oe_lr oe_decay_steps": cfg.memory == "gpm", "gpm_threshold": cfg.memory != "gpm",
            "delta rectify": not cfg.gr, "margin lambda_dml tau": not cfg.dml,
            "precision": cfg.device == "cpu"}
    moot = {n for names, off in moot.items() if off for n in names.split()} & set(typed_flags(argv))
    if moot:
        print(f"note: {' '.join(map(_flag, sorted(moot)))}: no effect with these settings, ignored")
    return cfg, argv

def check_config(cfg):
    """Fill in the data set's defaults and the device; refuse impossible values in one line."""
    for key in ("tasks", "epochs", "batch_size", "img_size"):
        if getattr(cfg, key) is None:
            setattr(cfg, key, data.DATASETS[cfg.dataset][key])
    cfg.gpm_threshold = list(cfg.gpm_threshold or GPM_THRESHOLDS.get(cfg.dataset, (0.95, 1.0)))
    cfg.seeds = list(cfg.seeds)
    cfg.workers = len(os.sched_getaffinity(0)) if cfg.workers is None else cfg.workers  # cores
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg.precision = "fp32" if cfg.device == "cpu" else cfg.precision  # autocast: CUDA's only
    width, gpus = vit.PRESETS[cfg.model].keywords["embed_dim"], torch.cuda.device_count()
    rows = REPRODUCE.get(cfg.reproduce, ("", {}))[1]
    for ok, fix in [
        (all(v > 0 for v in (cfg.lr, cfg.tau, cfg.lora_scale, cfg.delta, cfg.oe_lr)),  # NaN too
         "--lr, --tau, --lora-scale, --delta, --oe-lr must be positive"),
        (all(v >= 0 for v in (cfg.margin, cfg.lambda_dml, cfg.workers)),
         "--margin, --lambda-dml, --workers must not be negative"),
        (min(cfg.epochs, cfg.batch_size, cfg.img_size, cfg.patch_size, cfg.oe_decay_steps,
             cfg.steps, cfg.limit_per_class or 1) >= 1 and cfg.limit_per_class != 0,
         "--epochs, --batch-size, --img-size, --patch-size, --oe-decay-steps, --steps, "
         "--limit-per-class must be at least 1"),
        (1 <= min(cfg.rank, cfg.k) <= max(cfg.rank, cfg.k) <= width,
         f"--rank and --k must lie in 1..{width}, the width of {cfg.model}"),
        (cfg.patch_size < 1 or cfg.img_size % cfg.patch_size == 0,
         "--img-size must be a multiple of --patch-size"),
        (0 < cfg.gpm_threshold[0] <= cfg.gpm_threshold[1] <= 1,
         "--gpm-threshold takes two numbers 0 < first <= last <= 1"),
        (cfg.lora_a == "trained" or not cfg.gr, "--lora-a inflora freezes A, which GR trains: "
         "add --no-gr"),
        (cfg.input_range != "checkpoint" or cfg.weights in vit.PRETRAINED_INPUT,
         "--input-range checkpoint needs a named --weights; for a file, pass half or imagenet"),
        (len(set(cfg.seeds)) == len(cfg.seeds) and all(0 <= s < 2**32 for s in cfg.seeds),
         "--seeds: each seed once, in 0 .. 2^32 - 1"),
        (re.fullmatch(r"cpu|cuda(:\d+)?", cfg.device) and
         (cfg.device == "cpu" or int(cfg.device[5:] or 0) < gpus),
         f"--device {cfg.device}: torch sees {gpus} GPU(s); use cpu, or cuda:N below that"),
        (cfg.row is None or cfg.row in rows,
         f"--row goes with --reproduce NAME and names one of its rows ({', '.join(rows)})"),
        (cfg.reproduce or not cfg.dry_run, "--dry-run goes with --reproduce NAME"),
        (not (cfg.reproduce and cfg.method), "--reproduce sets its rows' methods: drop --method"),
    ]:
        _require(ok, fix)
    data.task_classes(data.DATASETS[cfg.dataset]["num_classes"], cfg.tasks)  # T divides classes
    return cfg

# ---- The run folder: config.json, checkpoint.pt, results.json ------------------------------------
class Run:
    """A run's folder (config.json at its start, checkpoint.pt after each task, results.json after
    each seed), its data and its backbone; a folder that holds another run is refused."""

    def __init__(self, cfg, argv):
        self.cfg, stamp = cfg, time.strftime("%Y%m%d-%H%M%S")
        self.out = cfg.out = cfg.resume or cfg.out or os.path.join("runs", f"{cfg.dataset}-{stamp}")
        _require(cfg.resume or not os.path.exists(os.path.join(self.out, "config.json")),
                 f"{q(self.out)} holds a run: continue it with --resume {q(self.out)}, or choose "
                 "another --out")
        self.splits, self.model = load_data_and_model(cfg)
        path = os.path.join(self.out, "checkpoint.pt")
        self.saved = (torch.load(path, map_location=cfg.device, weights_only=True)
                      if os.path.exists(path) else {"runs": [], "current": None})
        os.makedirs(self.out, exist_ok=True)
        write_json(os.path.join(self.out, "config.json"), {"argv": argv, "config": asdict(cfg)})
        self.results = {"config": asdict(cfg), "environment": environment(cfg),
                        "runs": self.saved["runs"]}
        print(f"{cfg.dataset}: {len(self.splits.train)} training images, {cfg.tasks} tasks; "
              f"{describe(asdict(cfg))}; {cfg.device} {cfg.precision}; out {q(self.out)}")

    def seeds_left(self):
        return [s for s in self.cfg.seeds if s not in {r["seed"] for r in self.results["runs"]}]

    def restore(self, learner):
        """A seed that an interruption stopped: the learner as after_task saved it."""
        state = dict(self.saved["current"] or {})
        if state.get("seed") != learner.seed:
            return
        learner.model.load_state_dict(state.pop("model"), strict=False)  # K and V, tasks merged in
        learner.oe.basis, learner.oe.steps = state.pop("oe")
        for head in state.pop("heads"):
            learner.heads.append(torch.nn.Linear(*head["weight"].shape[::-1]).to(self.cfg.device))
            learner.heads[-1].load_state_dict(head)
        torch.set_rng_state(state.pop("rng").cpu())  # last: the heads above drew from it
        for name, value in state.items():  # the seed, the memory, the prototypes, the measures
            setattr(learner, name, value)
        print(f"seed {learner.seed}: resumed after task {len(learner.acc)}", flush=True)

    def after_task(self, learner, t, factors, memory):
        """After task t: the paper's analyses; checkpoint.pt with the learner and the generator."""
        record_analyses(learner, t, factors, memory, self.splits, self.cfg)
        state = self.saved["current"] = {f.name: getattr(learner, f.name) for f in fields(Learner)}
        state.update(model={n: x for n, x in learner.model.state_dict().items()
                            if ".attn.k." in n or ".attn.v." in n},  # the rest: pretrained
                     oe=[learner.oe.basis, learner.oe.steps], rng=torch.get_rng_state(),
                     heads=[head.state_dict() for head in learner.heads])
        self.save()

    def save(self):
        path = os.path.join(self.out, "checkpoint.pt")
        torch.save(self.saved, path + ".tmp")
        os.replace(path + ".tmp", path)  # atomic: the last complete checkpoint survives anything

    def finish(self, learner=None):
        """A seed done: its entry in results.json; None: the run's end, summary printed, plots."""
        if learner:
            self.results["runs"].append(results_entry(learner, self.cfg.tasks))
            self.save()
        self.results["summary"] = summarize(self.results["runs"])
        write_json(os.path.join(self.out, "results.json"), self.results)
        if not learner:
            print_summary(self.results)
            plot(self.results, self.out)
            print(f"wrote {q(os.path.join(self.out, 'results.json'))}")

def read_json(path):
    with open(path) as f:
        return json.load(f)

def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)

def build_model(cfg):
    """The backbone with its LoRA layers, loaded from cfg.weights, in eval mode for good."""
    torch.manual_seed(0)  # with --weights none, a random backbone plays the checkpoint: one for all
    model = vit.PRESETS[cfg.model](img_size=cfg.img_size, patch_size=cfg.patch_size,
                                   lora_rank=cfg.rank, lora_scale=cfg.lora_scale)
    vit.load_pretrained(model, cfg.weights)
    return model.eval()  # the ViT has no dropout, and training never switches modes

def load_data_and_model(cfg):
    """(splits in the input range asked for, backbone); if both are missing, one line says so."""
    kind = cfg.input_range if cfg.input_range != "checkpoint" else vit.PRETRAINED_INPUT[cfg.weights]
    mean, std = vit.MEAN_STD.get(kind, (0.0, 1.0))  # unit: ToTensor's [0, 1] as it is
    loaded, errors = [], []
    for load in (partial(data.load_dataset, cfg.dataset, cfg.data_dir, cfg.img_size, mean, std,
                         limit_per_class=cfg.limit_per_class), partial(build_model, cfg)):
        try:
            loaded.append(load())
        except (data.DataError, vit.CheckpointError) as e:
            errors.append(str(e))
    _require(not errors, " And: ".join(errors))
    return loaded

def environment(cfg):
    """Where results.json's numbers come from."""
    device = (torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda")
              else f"cpu ({torch.get_num_threads()} threads)")
    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "device": device}

# ---- Results: results.json and the summary -------------------------------------------------------
def metrics(acc):
    """ACC, MAA, BWT (Sec. 4.1) of acc[t][i], the accuracy (%) on task i after task t (i <= t is
    read); BWT is undefined (None) with one task."""
    T = len(acc)
    maa = sum(sum(acc[t][: t + 1]) / (t + 1) for t in range(T)) / T
    bwt = sum(acc[T - 1][i] - acc[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else None
    return {"ACC": sum(acc[T - 1][:T]) / T, "MAA": maa, "BWT": bwt}

def results_entry(learner, T):
    """A seed's entry of results.json; rows padded with None to T columns."""
    def padded(rows):
        return [row + [None] * (T - len(row)) for row in rows]
    return {"seed": learner.seed, "acc_matrix": padded(learner.acc), **metrics(learner.acc),
            "task_aware": {"acc_matrix": padded(learner.aware), **metrics(learner.aware)},
            "sample_acc": learner.sample_acc, "task_seconds": learner.task_seconds,
            **learner.analyses, "throughput": learner.throughput}

def summarize(runs):
    """Mean and std over seeds of ACC, MAA, BWT, ACC over samples, and the task-aware three."""
    def stats(values):  # undefined (None) if any run's is, as BWT with one task
        if any(v is None for v in values):
            return {"mean": None, "std": None}
        return {"mean": statistics.fmean(values), "std": statistics.pstdev(values)}
    out = {key: stats([r[key] for r in runs]) for key in ("ACC", "MAA", "BWT")}
    out["sample_ACC"] = stats([r["sample_acc"][-1] for r in runs])  # over the final test samples
    out["task_aware"] = {key: stats([r["task_aware"][key] for r in runs])
                         for key in ("ACC", "MAA", "BWT")}
    return out

def _fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)

def _mean(values):
    """The mean of the defined values (None: undefined, left out), or None."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None

def print_summary(results):
    last, s = results["runs"][-1], results["summary"]
    print(f"accuracy (%) on each task (columns) after each task (rows), seed {last['seed']}:")
    print("after task | " + " ".join(f"task {i + 1:<2d}" for i in range(len(last["acc_matrix"]))))
    for t, row in enumerate(last["acc_matrix"]):
        print(f"{t + 1:10d} | " + " ".join(f"{_fmt(a, '.1f'):>7s}" for a in row))
    print("  ".join(f"{k} {_fmt(s[k]['mean'])} +- {_fmt(s[k]['std'])}" for k in
                    ("ACC", "MAA", "BWT", "sample_ACC")) + f"  over {len(results['runs'])} "
          f"seed(s); task-aware ACC {s['task_aware']['ACC']['mean']:.2f}")
    print("ACC: the mean accuracy on the tasks after the last; MAA: its mean over the run; BWT: "
          "the mean change of a task's accuracy from its end to the run's (< 0: forgetting)")

def describe(c):
    """The method's switches in words, from a config dict."""
    return f"{c['method'] or 'custom'}: OE {c['oe']} ({c['memory']}) GR {c['gr']} " \
        f"({c['rectify']}) DML {c['dml']}"

# ---- The paper's analyses after each task: the null-space violation against the memory and on
# real activations (Fig. 2), DML's geometry (Fig. 3 and the appendix's density) --------------------
def record_analyses(learner, t, factors, memory, splits, cfg):
    """Task t's analyses into learner.analyses; factors: its (A, B) per layer; memory: its M."""
    a = learner.analyses
    if not a:
        a.update(violation={"k": [], "v": []}, interference=[], geometry=[])
    for name in ("k", "v"):
        a["violation"][name].append([violation(A, B, memory[i]) for (A, B), (i, n, _)
                                     in zip(factors, learner.model.lora_layers()) if n == name])
    if t == 0:  # no past tasks, no old prototypes
        a["interference"].append(None)
        a["geometry"].append(None)
        return
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    seen = data.subset(splits.test, [c for classes in tasks[:t + 1] for c in classes])
    energy, z, y = probe(learner.model, factors, seen, tasks[t], cfg)
    past, now = energy.sqrt().tolist()
    a["interference"].append({"past": past, "current": now})
    a["geometry"].append(dml_geometry(z, y, learner.prototypes, tasks[t][0]))
    print(f"task {t + 1} analyses: violation {_fmt(_mean(a['violation']['k'][-1]), '.2e')} (K), "
          f"{_fmt(_mean(a['violation']['v'][-1]), '.2e')} (V); past inputs' output change "
          f"{_mean(past):.3g}, the current's {_mean(now):.3g}; DML danger share "
          f"{a['geometry'][-1]['danger']:.3f}", flush=True)

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
    tokens and over the current task's, (2, layers); and the current task's z and y."""
    energy, tokens, zs, ys = 0.0, 0.0, [], []
    for z, kv_inputs, y in batches(model, images, cfg):
        now = (y[:, None] == torch.tensor(current, device=y.device)).any(1)  # (B,)
        e = []
        for j, (A, B) in enumerate(factors):  # K and V of block j // 2 share its input
            u = kv_inputs[j // 2].float() @ A.T  # (B, N, r)
            e.append(cfg.lora_scale ** 2 * ((u @ (B.T @ B)) * u).sum((1, 2)))  # per image
        e = torch.stack(e, 1)  # (B, layers)
        energy = energy + torch.stack([e[~now].sum(0), e[now].sum(0)])
        tokens = tokens + torch.stack([(~now).sum(), now.sum()])[:, None] * kv_inputs[0].shape[1]
        zs.append(z[now])
        ys.append(y[now])
    return energy / tokens, torch.cat(zs), torch.cat(ys)

def dml_geometry(z, y, prototypes, old, bins=20):
    """One task's test features z (n, D), classes y: cos_old, the largest cosine to an old class's
    prototype (< old), cos_own, to its own; the shares the paper reads, cos_old's histogram."""
    z = F.normalize(z.float(), dim=1)
    cos_old = (z @ prototypes[:old].T).amax(1)  # (n,)
    cos_own = (z * prototypes[y]).sum(1)
    return {"danger": float((cos_old > 0.5).float().mean()),
            "safe": float((cos_old < 0.2).float().mean()),
            "closer_to_old": float((cos_old > cos_own).float().mean()),
            "hist": (torch.histc(cos_old, bins, -1, 1) / len(z)).tolist(),
            "cos_old": [round(v, 4) for v in cos_old.tolist()],
            "cos_own": [round(v, 4) for v in cos_own.tolist()]}

# ---- Plots (matplotlib, when installed) ----------------------------------------------------------
def figure(title, width=11):
    """A matplotlib figure that lays itself out, or None where matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure  # not pyplot: no window, no global state
    except ImportError:
        return None
    fig = Figure(figsize=(width, 4.4), layout="constrained")
    fig.suptitle(title, fontsize=9)
    return fig

def save(fig, path):
    for ax in fig.axes:  # a legend where there is something to name
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)

def plot(results, out):
    """trajectory.png (Fig. 5) of all seeds; violation.png (Fig. 2), angular.png (Fig. 3) of one."""
    c, runs = results["config"], results["runs"]
    title = f"{c['dataset']}, T={c['tasks']}, {describe(c)}"
    fig = figure(title, 6.5)
    if fig is None:
        return print("matplotlib is not installed: no plots (results.json has the numbers)")
    ax = fig.subplots()
    for label, matrices in (("task-agnostic (the paper's)", [r["acc_matrix"] for r in runs]),
                            ("task-aware (ours)", [r["task_aware"]["acc_matrix"] for r in runs])):
        curves = torch.tensor([[sum(row[:t + 1]) / (t + 1) for t, row in enumerate(matrix)]
                               for matrix in matrices])  # (seeds, T)
        x = list(range(1, curves.shape[1] + 1))
        ax.plot(x, curves.mean(0), "o-", label=f"{label}, mean of {len(curves)} seed(s)")
        ax.fill_between(x, curves.min(0).values, curves.max(0).values, alpha=0.2,
                        label="its min-max over seeds")
    ax.set(xlabel="task", ylabel="mean accuracy on the seen tasks (%)", xticks=x)
    save(fig, os.path.join(out, "trajectory.png"))
    title += f", seed {runs[0]['seed']}"
    save(plot_violation(figure(f"{title}: small bars keep the old outputs"), runs[0]),
         os.path.join(out, "violation.png"))
    if any(runs[0]["geometry"]):
        save(plot_angular(figure(title), runs[0]), os.path.join(out, "angular.png"))

def plot_violation(fig, run):
    """Fig. 2 per block, mean over tasks 2..T: the update's share on the memory, and its effect on
    the past tasks' test inputs beside the current task's own (what an unprotected update does)."""
    inter = [i for i in run["interference"] if i]
    panels = [("Against the memory M", "share of the update on M: ||dW M|| / ||dW||",
               run["violation"], None),
              ("On the past tasks' test inputs", "RMS change of their outputs: ||X dW^T||/sqrt(n)",
               {n: [i["past"][j::2] for i in inter] for j, n in enumerate("kv")},
               {n: [i["current"][j::2] for i in inter] for j, n in enumerate("kv")})]
    for ax, (name, ylabel, measure, reference) in zip(fig.subplots(1, 2), panels):
        for j, n in enumerate("kv"):
            means = [_mean(col) for col in zip(*measure[n])]  # per block; task 1's: None
            x = [b + 0.8 + 0.4 * j for b in range(len(means))]
            if any(m is not None for m in means):
                ax.bar(x, [m or 0 for m in means], 0.4, label=n.upper())
            if reference and means:
                ax.plot(x, [_mean(col) for col in zip(*reference[n])], "k_", ms=9,
                        label=f"{n.upper()} on the current task's inputs (reference)")
        ax.set(xlabel="block", ylabel=ylabel, title=f"{name} (mean over tasks 2..T)")
    return fig

def plot_angular(fig, run):
    """Fig. 3 and the appendix's density: the last task's test samples, cos_old against cos_own,
    and each task's density of cos_old (DML pushes it below the margin)."""
    left, right = fig.subplots(1, 2)
    tasks = [(t + 1, g) for t, g in enumerate(run["geometry"]) if g]
    t, g = tasks[-1]
    lo, hi = min(g["cos_old"] + g["cos_own"]) - 0.05, max(g["cos_old"] + g["cos_own"]) + 0.05
    left.scatter(g["cos_old"], g["cos_own"], s=6, alpha=0.5)
    left.plot([lo, hi], [lo, hi], "k--", lw=0.8,
              label=f"below: closer to old, {g['closer_to_old']:.3f}")
    left.axvline(0.5, color="red", ls="--", label=f"danger zone, {g['danger']:.3f}")
    left.set(xlabel="cos_old: largest cosine to an old prototype", xlim=(lo, hi), ylim=(lo, hi),
             ylabel="cos_own: cosine to its own prototype", title=f"task {t}'s test samples")
    width = 2 / len(g["hist"])  # dml_geometry's bins over [-1, 1]
    for t, g in tasks:
        right.plot([-1 + width * (i + 0.5) for i in range(len(g["hist"]))], g["hist"], "o-",
                   ms=3, label=f"task {t}")
    right.set(xlabel="cos_old", ylabel="share of the task's test samples", title="cos_old per task")
    fig.supxlabel("prototype: a class's mean unit feature; danger zone (the paper's Fig. 3): "
                  "cos_old > 0.5, a sample close to an old class", fontsize=8)
    return fig

# ---- Speed (ours): --compile's CUDA graph, and --benchmark ---------------------------------------
class StepGraph:
    """After `warmup` ordinary steps, train_step recorded as one CUDA graph, replayed for each batch
    of that shape. A replay repeats the kernels on the same addresses, so a step changes all in
    place (OE's basis and steps, the rolling memory, Adam's state and lr), never waiting on the
    host (_spd_solve, OE's lr as a tensor)."""

    def __init__(self, step, warmup=3):
        self.step, self.warmup, self.graph = step, warmup, None

    def __call__(self, learner, opt, images, y, cfg):
        if self.graph is None and self.warmup == 0:  # recorded, not run: the replay below runs it
            self.images, self.y, self.graph = images.clone(), y.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.step(learner, opt, self.images, self.y, cfg)
        if self.graph is not None and images.shape == self.images.shape:
            self.images.copy_(images)
            self.y.copy_(y)
            self.graph.replay()
            return self.out
        self.warmup -= 1
        side = torch.cuda.Stream()  # warm-up, or another shape: on a side stream, as recording
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.step(learner, opt, images, y, cfg)
        torch.cuda.current_stream().wait_stream(side)
        return out

def mid_run_learner(cfg, base, m, classes):
    """A learner mid-run: a random memory of m columns a block, V and A off it, old prototypes."""
    learner = start_learner(cfg, 0, base)
    L, D = len(base.blocks), base.embed_dim
    if cfg.oe:
        learner.memory = list(torch.linalg.qr(torch.randn(L, D, m)).Q.to(cfg.device))
        learner.oe.basis = learner.oe.fresh_basis(learner.memory)
        for i, _, layer in learner.model.lora_layers():
            layer.reset_lora_(learner.memory[i])
    learner.prototypes = F.normalize(torch.randn(classes * (cfg.tasks // 2), D), dim=1)
    learner.prototypes = learner.prototypes.to(cfg.device)
    start_task(learner, 0, [list(range(classes))], None, cfg)  # its head; oe-rolling: M is V
    return learner

def benchmark(cfg):
    """Plain LoRA, janus-grad and janus-update on one random batch, a step of each in turn, so
    that drift hits all alike; the median of the per-round ratios to plain."""
    device, cuda = cfg.device, cfg.device.startswith("cuda")
    classes = data.DATASETS[cfg.dataset]["num_classes"] // cfg.tasks
    base = build_model(replace(cfg, weights="none"))  # random weights: the same cost
    m = min(cfg.k * (cfg.tasks // 2), base.embed_dim - cfg.k)  # the memory at mid-run
    images = torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, device=device)
    y = torch.randint(0, classes, (cfg.batch_size,), device=device)
    variants = {"plain": dict(oe=False, gr=False, dml=False), "janus-grad": dict(rectify="grad"),
                "janus-update": dict(rectify="update")}
    steps, peak_mb, ms = {}, {}, {name: [] for name in variants}
    for name, change in variants.items():  # built and warmed up one by one: each one's memory
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        vcfg = replace(cfg, **change)
        steps[name] = make_step(mid_run_learner(vcfg, base, m, classes), vcfg)[1]
        for _ in range(5):  # warm-up: allocator, kernels, Adam's state, a CUDA graph's recording
            steps[name](images, y)
        peak_mb[name] = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    sync = partial(torch.cuda.synchronize, device) if cuda else (lambda: None)  # CUDA: async
    for _ in range(cfg.steps):
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step(images, y)
            sync()
            ms[name].append(1e3 * (time.perf_counter() - start))
    report = {name: dict(ms_per_step=statistics.median(t), peak_mb=peak_mb[name],
                         images_per_s=1e3 * cfg.batch_size / statistics.median(t),
                         x_plain=statistics.median(a / p for a, p in zip(t, ms["plain"])))
              for name, t in ms.items()}
    print(f"{cfg.model}, batch {cfg.batch_size}, {cfg.img_size} px, memory {m} columns a block, "
          f"{cfg.device} {cfg.precision}, compile {cfg.compile}, {cfg.steps} rounds:\n"
          "variant        ms/step  images/s  peak MiB  x plain (median)")
    for name, r in report.items():
        print(f"{name:14s} {r['ms_per_step']:7.1f} {r['images_per_s']:9.1f} "
              f"{_fmt(r['peak_mb'], '9.0f'):>9s} {r['x_plain']:8.3f}")
    out = cfg.out or os.path.join("runs", f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "benchmark.json"),
               {"config": asdict(cfg), "environment": environment(cfg), "variants": report})
    print(f"wrote {q(os.path.join(out, 'benchmark.json'))}")
    return 0

# ---- --reproduce: every row of a table or figure of the paper, one command, resumable ------------
# NAME: (what it reproduces, {row: its flags}), the sweeps' values as read in the paper (README)
REPRODUCE = {
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

def reproduce(cfg, argv):
    """Each row into OUT/<row>/ with the flags typed and the row's: a finished row is skipped, an
    interrupted one resumed; then table.md of the rows finished and time.png."""
    what, rows = REPRODUCE[cfg.reproduce]
    out = cfg.out or os.path.join("runs", f"{cfg.reproduce}-{cfg.dataset}-T{cfg.tasks}")
    mode = ("reproduce", "row", "dry_run", "out")
    common = to_argv({k: v for k, v in typed_flags(argv).items() if k not in mode})
    print(f"--reproduce {cfg.reproduce}: {what}; {len(rows)} rows on {cfg.dataset}, T={cfg.tasks}, "
          f"into {q(out)}")
    for row in [cfg.row] if cfg.row else rows:
        folder = os.path.join(out, row)
        if set(cfg.seeds) <= {r["seed"] for r in row_runs(folder)}:
            print(f"{row}: finished, skipped")
            continue
        started = os.path.exists(os.path.join(folder, "config.json"))
        flags = ["--resume", folder] if started else common + rows[row].split() + ["--out", folder]
        print(f"{row}: python janus_min.py {shlex.join(flags)}", flush=True)
        code = 0 if cfg.dry_run else main(flags)
        if code:
            return code
    return 0 if cfg.dry_run else write_table(cfg, out, rows)

def row_runs(folder):
    """The finished seeds' runs of a row, from its results.json; none if it has none."""
    path = os.path.join(folder, "results.json")
    return read_json(path)["runs"] if os.path.exists(path) else []

def write_table(cfg, out, rows):
    """table.md: each finished row's metrics (mean ± std over seeds), analyses and time."""
    lines = [f"# --reproduce {cfg.reproduce}: {REPRODUCE[cfg.reproduce][0]}",
             f"{cfg.dataset}, T = {cfg.tasks}; mean ± std over seeds; the paper's: README.",
             "", "| row | flags | seeds | ACC | MAA | BWT | ACC over samples | task-aware ACC | "
             "violation | danger share | s / task |", "|" + "---|" * 11]
    finished = {row: row_runs(os.path.join(out, row)) for row in rows}
    finished = {row: runs for row, runs in finished.items() if runs}  # --row: others may not be
    for row, runs in finished.items():
        s = summarize(runs)
        violations = [v for r in runs for n in "kv" for task in r["violation"][n] for v in task]
        cells = [f"{_fmt(s[k]['mean'])} ± {_fmt(s[k]['std'])}" for k in
                 ("ACC", "MAA", "BWT", "sample_ACC")] + [_fmt(s["task_aware"]["ACC"]["mean"]),
                 _fmt(_mean(violations), ".2e"),
                 _fmt(_mean([g["danger"] for r in runs for g in r["geometry"] if g]), ".3f"),
                 _fmt(_mean([x for r in runs for x in r["task_seconds"]]), ".1f")]
        lines.append(f"| {row} | `{rows[row] or '(none)'}` | {len(runs)} | " +
                     " | ".join(cells) + " |")
    text = "\n".join(lines)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(f"{text}\nwrote {q(os.path.join(out, 'table.md'))}")
    plot_time(finished, out)
    return 0

def plot_time(finished, out):
    """time.png (the appendix's efficiency figures): per-task and cumulative time of each row."""
    fig = figure("training time of each row: the method's passes included, tests not")
    if fig is None:
        return
    left, right = fig.subplots(1, 2)
    for row, runs in finished.items():
        seconds = torch.tensor([r["task_seconds"] for r in runs]).mean(0)  # mean over seeds
        x = list(range(1, len(seconds) + 1))
        left.plot(x, seconds, "o-", label=row)
        right.plot(x, seconds.cumsum(0), "o-", label=row)
    left.set(xlabel="task", ylabel="seconds (mean over seeds)", title="time per task", xticks=x)
    right.set(xlabel="task", ylabel="seconds", title="cumulative time", xticks=x)
    save(fig, os.path.join(out, "time.png"))

if __name__ == "__main__":
    sys.exit(main())
