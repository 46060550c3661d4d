"""Janus-LoRA (ICML 2026), minimal: the method, the class-incremental task loop, the command line.

A frozen ViT-B/16 learns one LoRA pair on K and V per task, merged into the weights at the task's
end. The paper's method (Sec. 3) comes first, in the order of its update step; our additions follow
in a section of their own. Equations are numbered as in the paper's LaTeX source; the README maps
the paper to this code and lists our readings where the paper is silent.
References: C. Chen et al., "JANUS-LoRA: A Balanced Low-Rank Adaptation for Continual Learning",
ICML 2026; InfLoRA (Liang & Li, CVPR 2024) for the protocol; LoRA-Pro (Wang et al., ICLR 2025).
"""
import argparse
import copy
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F

import data
import vit


# ==================================================================================================
# The paper's method (Sec. 3)
# ==================================================================================================
# ---- Theorem 1: the safe gradient ----------------------------------------------------------------
def safe_gradient(G, M):
    """G (d_out, d_in), M (d_in, m) orthonormal -> G (I - M M^T), Eq. (3); an empty M returns G."""
    if M.shape[1] == 0:
        return G
    return G - (G @ M) @ M.T  # without forming the d_in x d_in projector


# ---- Gradient Rectification, Eqs. (5)-(7) --------------------------------------------------------
def _ridge(S, delta):
    """S + delta * mean(eig S) * I: a ridge relative to the Gram matrix S (README, "GR ridge")."""
    lam = delta * S.diagonal().mean() + torch.finfo(S.dtype).tiny  # tiny: finite at S = 0 (B = 0)
    return S + lam * torch.eye(S.shape[0], dtype=S.dtype, device=S.device)


def rectify_factors(BtG, GAt, A, B, scale, delta=1e-4):
    """GR from B^T G_safe (r, d_in) and G_safe A^T (d_out, r) alone -> (dA, dB)."""
    dA = torch.linalg.solve(_ridge(B.T @ B, delta), BtG) / scale  # Eq. (6)
    RAt = GAt - scale * B @ (dA @ A.T)  # R A^T, with the residual R = G_safe - s B dA
    dB = torch.linalg.solve(_ridge(A @ A.T, delta), RAt.T).T / scale  # Eq. (7); A A^T symmetric
    return dA, dB


def rectify(G_safe, A, B, scale, delta=1e-4):
    """Eqs. (6)-(7) for a dense G_safe (d_out, d_in). Reference form: not on the training path."""
    return rectify_factors(B.T @ G_safe, G_safe @ A.T, A, B, scale, delta)


def rectify_gradients_(layers, delta):
    """Replace each LoRA pair's gradients by GR's (the paper: Adam then takes them)."""
    for layer in layers:
        A, B, s = layer.A, layer.B, layer.scale
        # autograd left gA = s B^T G_safe and gB = s G_safe A^T (Theorem 1, in the forward)
        dA, dB = rectify_factors(A.grad / s, B.grad / s, A.detach(), B.detach(), s, delta)
        A.grad.copy_(dA)
        B.grad.copy_(dB)


# ---- Online Estimation, Eqs. (8)-(10) ------------------------------------------------------------
def _columns_off(V, M):
    """(I - M M^T) V: the columns of V without their part in span(M)."""
    return V - M @ (M.T @ V)


class OnlineSubspace:
    """One block's OE basis V (dim, k) of the current task and protected memory M (dim, m) of the
    finished ones. V stays orthogonal to M and joins it at the task's end."""

    def __init__(self, dim, k, lr=1.0, decay_steps=5, device=None):
        self.dim, self.k, self.lr, self.decay_steps = dim, k, lr, decay_steps
        self.memory = torch.zeros(dim, 0, device=device)
        self.basis = self._fresh_basis()
        self.steps = 0

    def _fresh_basis(self):
        k = min(self.k, self.dim - self.memory.shape[1])  # a full memory leaves no room
        # drawn on the CPU: a run's random numbers must not depend on the device
        V = _columns_off(torch.randn(self.dim, k).to(self.memory.device), self.memory)
        return torch.linalg.qr(V).Q

    @torch.no_grad()
    def update(self, X):
        """One step on Eq. (8), (1/2)||X_p - X_p V V^T||^2 with X_p = X (I - M M^T); X (n, dim)."""
        V, M = self.basis, self.memory
        if V.shape[1] == 0:
            return
        X = X.float()
        XV = X @ V  # (n, k); equals X_p V, as V is orthogonal to M
        CV = _columns_off(X.T @ XV, M)  # X_p^T X_p V  (dim, k)
        grad = -(CV - V @ (V.T @ CV))  # the Euclidean gradient of Eq. (8) at an orthonormal V
        S = _ridge(XV.T @ XV, 1e-6)  # (k, k) energy per direction; ridge: an idle one stays finite
        lr = self.lr * self.decay_steps / (self.decay_steps + self.steps)  # harmonic decay (ours)
        # Eq. (9), preconditioned by S^-1 (ours): scale-free, and lr = 1 is one subspace iteration
        V_tilde = V - lr * torch.linalg.solve(S, grad.T).T
        Q, R = torch.linalg.qr(V_tilde)  # Eq. (10)
        signs = torch.diagonal(R).sign()
        V = Q * torch.where(signs == 0, 1.0, signs)  # R's diagonal made positive: V does not flip
        self.basis = _columns_off(V, M)  # round-off must not leak V into span(M)
        self.steps += 1

    @torch.no_grad()
    def merge(self):
        """End of a task: M <- orth([M, V]), and a fresh V off the new memory."""
        self.memory = torch.linalg.qr(torch.cat([self.memory, self.basis], dim=1)).Q
        self.basis = self._fresh_basis()
        self.steps = 0

    def state_dict(self):
        return {"memory": self.memory, "basis": self.basis, "steps": self.steps}

    def load_state_dict(self, state):
        self.memory, self.basis, self.steps = state["memory"], state["basis"], state["steps"]


# ---- Decoupled Margin Loss, Eq. (11) -------------------------------------------------------------
def dml_loss(z, y, old_prototypes, margin=0.3, tau=0.07):
    """Eq. (11). z (B, D) features, y (B,) labels of the current task, old_prototypes (P, D) unit
    rows. The current prototypes are the batch's normalised class means (README, "DML")."""
    z = F.normalize(z.float(), dim=1)
    classes, y_idx = torch.unique(y, return_inverse=True)  # the current classes in the batch
    protos = torch.zeros(len(classes), z.shape[1], device=z.device).index_add(0, y_idx, z)
    protos = F.normalize(protos, dim=1)  # (C_b, D)
    intra = F.cross_entropy(z @ protos.T / tau, y_idx)  # softmax over C_t of z.p_c / tau
    if old_prototypes.shape[0] == 0:
        return intra
    return intra + F.relu(z @ old_prototypes.T - margin).mean()  # hinge: mean over batch x old


# ---- Metrics (Sec. 4.1) and the null-space violation (Fig. 2) ------------------------------------
def metrics(acc):
    """ACC, MAA, BWT of acc[t][i], the accuracy (%) on task i after task t (i <= t is read)."""
    T = len(acc)
    maa = sum(sum(acc[t][: t + 1]) / (t + 1) for t in range(T)) / T
    bwt = sum(acc[T - 1][i] - acc[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else 0.0
    return {"ACC": sum(acc[T - 1][:T]) / T, "MAA": maa, "BWT": bwt}


@torch.no_grad()
def violation(layer):
    """||dW M||_F / ||dW||_F of the layer's task update dW = s B A, from r x r products only."""
    A, B, M = layer.A, layer.B, layer.memory
    if M.shape[1] == 0:
        return 0.0
    num = (B @ (A @ M)).norm()
    den = ((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt()  # ||B A||_F^2 = tr(B^T B A A^T)
    return float(num / den) if den > 0 else 0.0


# ---- The integrated update (Sec. 3, "The Integrated Janus-LoRA Update Process") ------------------
def train_step(model, head, opt, images, y, cfg, subspaces, prototypes):
    """One training step, in the paper's order. y: labels local to the task. -> (loss, correct)."""
    layers = [layer for _, _, layer in model.lora_layers()]
    # (1) the total loss, Eq. (12): the current head's cross-entropy plus lambda * DML, Eq. (11)
    with torch.autocast(images.device.type, torch.bfloat16, enabled=images.device.type == "cuda"):
        z, kv_inputs = model.encode(images) if cfg.oe else (model(images), None)
    z = z.float()
    logits = head(z)
    loss = F.cross_entropy(logits, y)
    if cfg.dml:
        loss = loss + cfg.lambda_dml * dml_loss(z, y, prototypes, cfg.margin, cfg.tau)
    # OE, Eqs. (8)-(10), on this batch's K/V inputs: it learns the task's basis V, which joins the
    # memory M at the task's end; the projection in (3) uses M only, never V (README).
    if cfg.oe:
        for sub, X in zip(subspaces, kv_inputs):
            sub.update(X.detach().flatten(0, 1))  # (B, N, D) -> (B*N, D): every token a sample
        del kv_inputs  # released before the backward pass peaks
    # (2) backward: the raw gradient, and at once (3) the safe gradient, Theorem 1, Eq. (3):
    # vit.LoRALinear.forward holds A's part in span(M) constant, so autograd returns
    # gA = s B^T G (I - M M^T) and gB = s G (I - M M^T) A^T, the chain rule of G_safe.
    opt.zero_grad(set_to_none=True)
    loss.backward()
    # (4) GR, Eqs. (6)-(7): factor gradients whose composite s (B dA + dB A) best matches G_safe
    if cfg.gr and cfg.rectify == "grad":
        rectify_gradients_(layers, cfg.delta)
    # (5) the optimizer step
    if cfg.gr and cfg.rectify == "update":  # ours: GR acts on the step Adam proposes instead of (4)
        rectified_adam_step_(opt, layers, cfg.delta)
    else:
        opt.step()
    return loss.detach(), (logits.argmax(1) == y).sum()  # tensors: no host sync per step


# ==================================================================================================
# Our additions: --rectify update (README, "--rectify grad and update")
# ==================================================================================================
def least_norm_split(dA, dB, A, B):
    """Of the steps with the composite B dA + dB A, the one of least ||dA||^2 + ||dB||^2.
    They differ by (C A, -B C); the best C solves (B^T B) C + C (A A^T) = B^T dB - dA A^T."""
    lam, U = torch.linalg.eigh(B.T @ B)  # (r,), (r, r)
    sig, W = torch.linalg.eigh(A @ A.T)
    den = lam[:, None] + sig[None, :]  # (r, r) >= 0: the Sylvester operator in those eigenbases
    rhs = U.T @ (B.T @ dB - dA @ A.T) @ W
    ok = den > den.max() * den.shape[0] * torch.finfo(den.dtype).eps  # singular where B = A = 0
    C = U @ torch.where(ok, rhs / torch.where(ok, den, 1), 0) @ W.T
    return dA + C @ A, dB - B @ C


@torch.no_grad()
def rectify_updates_(layers, before, delta):
    """Rectify the step Adam took from `before` (each layer's (A, B)): the composite step
    s (B dA + dB A) is projected by Theorem 1, rectified, and split with the least norm."""
    for layer, (A0, B0) in zip(layers, before):
        M, s = layer.memory, layer.scale
        dA, dB = layer.A - A0, layer.B - B0  # Adam's proposed step
        # B^T dW_safe and dW_safe A^T of dW = s (B dA + dB A), with r-wide products only
        BtW = safe_gradient(s * ((B0.T @ B0) @ dA + (B0.T @ dB) @ A0), M)
        Ap = safe_gradient(A0, M).T  # (I - M M^T) A^T  (d_in, r)
        WAt = s * (B0 @ (dA @ Ap) + dB @ (A0 @ Ap))
        rA, rB = least_norm_split(*rectify_factors(BtW, WAt, A0, B0, s, delta), A0, B0)
        layer.A.copy_(A0 + rA)
        layer.B.copy_(B0 + rB)


def rectified_adam_step_(opt, layers, delta):
    """Step (5) under --rectify update: Adam proposes a step, GR rectifies it."""
    before = [(layer.A.detach().clone(), layer.B.detach().clone()) for layer in layers]
    opt.step()
    rectify_updates_(layers, before, delta)


# ==================================================================================================
# Configuration: one dataclass; each field is a flag, its help the meaning and source
# ==================================================================================================
def _opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Config:
    dataset: str = _opt("cifar100", "data set (paper Sec. 4.1)", choices=sorted(data.DATASETS))
    data_dir: str = _opt("data", "folder that holds (or receives) the data set")
    tasks: int = _opt(None, "tasks T (default: the protocol's, e.g. 10 for CIFAR-100; Sec. 4.1)")
    epochs: int = _opt(None, "epochs per task (default: CIFAR-100 20, ImageNet-R 50, DomainNet 5)")
    batch_size: int = _opt(None, "batch size (default: 128, paper Sec. 4.1; synthetic 16)")
    lr: float = _opt(5e-4, "Adam learning rate, cosine-annealed per task (InfLoRA codebase)")
    model: str = _opt("vit_base", "backbone (paper: ViT-B/16)", choices=list(vit.PRESETS))
    weights: str = _opt("in21k", "in21k (paper), sam, dino (Table 4), torchvision, none, or a file")
    img_size: int = _opt(None, "input resolution (default: 224, the paper's; synthetic 64)")
    patch_size: int = _opt(16, "patch size (paper: 16); free only with --weights none")
    rank: int = _opt(10, "LoRA rank r on K and V (paper Sec. 4.1)")
    lora_scale: float = _opt(1.0, "LoRA scale s (ours; the paper does not give it)")
    k: int = _opt(50, "rank of the OE basis V per block and task (paper Sec. 4.1)")
    oe_lr: float = _opt(1.0, "OE step at a task's start; 1: a step of subspace iteration (ours)")
    oe_decay_steps: int = _opt(5, "OE step halves after this many steps, then decays as 1/t (ours)")
    delta: float = _opt(1e-4, "GR ridge, relative to the mean eigenvalue of B^T B or A A^T (ours)")
    margin: float = _opt(0.3, "DML margin m (paper Sec. 4.1)")
    lambda_dml: float = _opt(1.0, "DML weight lambda (paper Eq. (12), Sec. 4.1)")
    tau: float = _opt(0.07, "DML temperature tau (paper Sec. 4.1, after CLIP)")
    oe: bool = _opt(True, "Online Estimation and the safe gradient (paper Table 1, the ablation)")
    gr: bool = _opt(True, "Gradient Rectification (paper Table 1, the ablation)")
    dml: bool = _opt(True, "Decoupled Margin Loss (paper Table 1, the ablation)")
    rectify: str = _opt("grad", "grad: GR's gradients go to Adam (paper); update: GR on Adam's "
                        "step, split with the least norm (ours)", choices=["grad", "update"])
    input_range: str = _opt("unit", "unit: [0, 1] as the InfLoRA codebase (paper); checkpoint: as "
                            "a named --weights was trained; half: [-1, 1]; imagenet: its mean, std",
                            choices=["unit", "checkpoint", "half", "imagenet"])
    seeds: list = _opt((0,), "seeds; several give mean +- std (paper: 5)", nargs="+", type=int)
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    # the cores this process may use (os.sched_getaffinity: not on every system)
    workers: int = _opt(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count() or 1, "loader workers of the file-based data sets "
                        "(default: the cores available)")
    limit_per_class: int = _opt(None, "keep at most this many training images per class")
    out: str = _opt(None, "output folder (default runs/<dataset>-<time>)")
    resume: str = _opt(None, "continue the run in this folder from its last finished task")
    benchmark: bool = _opt(False, "time plain LoRA and Janus steps, then exit", action="store_true")
    steps: int = _opt(20, "--benchmark: timed steps per variant (after 3 warm-up steps)")


class ConfigError(Exception):
    """An impossible combination of flags."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message}; see python janus_min.py --help\n")


def parse_args(argv=None):
    p = _Parser(description="Janus-LoRA (ICML 2026): class-incremental learning with a frozen ViT "
                            "and LoRA, made stable by OE + GR and plastic by DML.")
    for f in fields(Config):
        flag, meta = "--" + f.name.replace("_", "-"), dict(f.metadata)
        if f.type is bool and f.default is False:
            p.add_argument(flag, **meta)
        elif f.type is bool:
            p.add_argument("--no-" + flag[2:], dest=f.name, action="store_false",
                           help="turn off " + meta["help"] + " (on by default)")
        else:
            meta.setdefault("type", {"int": int, "float": float}.get(f.type.__name__, str))
            if f.default is not None and "default" not in meta["help"]:  # None: the help says
                shown = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
                meta["help"] += f" (default: {shown})"
            p.add_argument(flag, default=f.default, **meta)
    return Config(**vars(p.parse_args(argv)))


def _require(ok, message):
    if not ok:
        raise ConfigError(message)


def check_config(cfg):
    """Fill the data set's defaults; refuse impossible values with a line that says what to do."""
    info, width = data.DATASETS[cfg.dataset], vit.PRESETS[cfg.model].keywords["embed_dim"]
    for key in ("tasks", "epochs", "batch_size", "img_size"):
        if getattr(cfg, key) is None:
            setattr(cfg, key, info[key])
    cfg.seeds = list(cfg.seeds)  # one form (a typed --seeds is a list) for --resume's comparison
    floats = [f.name for f in fields(Config) if f.type is float]
    _require(all(math.isfinite(getattr(cfg, n)) for n in floats),
             "--" + ", --".join(n.replace("_", "-") for n in floats) + " must be finite numbers")
    _require(all(0 <= s < 2**63 for s in cfg.seeds), "--seeds must lie in 0 .. 2^63 - 1")
    _require(cfg.img_size >= 1 and cfg.patch_size >= 1, "--img-size and --patch-size must be >= 1")
    _require(cfg.out is None or not os.path.exists(cfg.out) or os.path.isdir(cfg.out),
             f"--out {cfg.out} is a file, not a folder; choose another --out")
    _require(cfg.tasks >= 1 and info["num_classes"] % cfg.tasks == 0, f"--tasks {cfg.tasks} does "
             f"not divide the {info['num_classes']} classes of {cfg.dataset}")
    _require(cfg.epochs >= 1, "--epochs must be at least 1")
    _require(cfg.batch_size >= 1, "--batch-size must be at least 1")
    _require(cfg.rank >= 1, "--rank must be at least 1")
    _require(1 <= cfg.k <= width, f"--k must lie in 1..{width} (the block width of {cfg.model})")
    _require(min(cfg.lr, cfg.margin, cfg.lambda_dml) >= 0,
             "--lr, --margin and --lambda-dml must not be negative")
    _require(cfg.tau > 0, "--tau must be positive")
    _require(cfg.lora_scale > 0, "--lora-scale must be positive")
    _require(cfg.weights == "none" or cfg.patch_size == 16,
             "--patch-size other than 16 needs --weights none (the checkpoints are ViT-*/16)")
    _require(cfg.img_size % cfg.patch_size == 0, "--img-size must be a multiple of --patch-size")
    _require(cfg.input_range != "checkpoint" or cfg.weights in vit.PRETRAINED_INPUT,
             "--input-range checkpoint needs a named --weights; a file does not say how it was "
             "normalised: pass --input-range half (Google npz) or imagenet (DINO, torchvision)")
    _require(cfg.limit_per_class is None or cfg.limit_per_class >= 1,
             "--limit-per-class must be at least 1")
    _require(cfg.workers >= 0, "--workers must not be negative")
    _require(min(cfg.delta, cfg.oe_lr, cfg.oe_decay_steps, cfg.steps) > 0,
             "--delta, --oe-lr, --oe-decay-steps and --steps must be positive")
    _require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device),
             f"--device {cfg.device}: use auto, cpu, cuda or cuda:N")
    if cfg.oe and cfg.k * (cfg.tasks - 1) >= width:  # allowed, but the reader should know
        full = -(-width // cfg.k)
        print(f"note: k x (T - 1) = {cfg.k * (cfg.tasks - 1)} reaches the block width {width}: the "
              f"memory is full after task {full} and K/V learn nothing from task {full + 1} on")
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count()
    _require(not cfg.device.startswith("cuda") or int(cfg.device.partition(":")[2] or 0) < gpus,
             f"--device {cfg.device} asked for, but torch sees {gpus} GPU(s); use --device cpu or "
             "an index below that")
    return cfg


# ==================================================================================================
# The class-incremental task loop: a Learner is trained task by task (train_task, end_task)
# ==================================================================================================
def build_model(cfg):
    torch.manual_seed(0)  # with --weights none, a random backbone plays the checkpoint: one for all
    model = vit.PRESETS[cfg.model](img_size=cfg.img_size, patch_size=cfg.patch_size,
                                   lora_rank=cfg.rank, lora_scale=cfg.lora_scale)
    vit.load_pretrained(model, cfg.weights)
    return model.eval()  # for good: the ViT has no dropout, and training never switches modes


@torch.no_grad()
def features(model, loader, device):
    zs, ys = [], []
    for images, y in loader:
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            zs.append(model(images.to(device, non_blocking=True)).float())
        ys.append(y.to(device))
    return torch.cat(zs), torch.cat(ys)


@torch.no_grad()
def class_prototypes(z, y, classes):
    """(len(classes), D): each class's normalised mean of normalised features (DML's C_past)."""
    z = F.normalize(z, dim=1)
    return torch.stack([F.normalize(z[y == c].mean(0), dim=0) for c in classes])


@torch.no_grad()
def evaluate(model, heads, splits, tasks, cfg, device):
    """Row t of the accuracy matrices, per seen task: task-agnostic (the paper: all seen heads, one
    argmax, no task id) and task-aware (ours: argmax over the true task's head only)."""
    seen = torch.tensor([c for classes in tasks[:len(heads)] for c in classes], device=device)
    test = data.subset(splits.test, seen.tolist())
    loader = data.make_loader(test, cfg.batch_size, False, cfg.workers, 0, device)
    z, y = features(model, loader, device)
    task_of = torch.empty(int(seen.max()) + 1, dtype=torch.long, device=device)
    for i, classes in enumerate(tasks[:len(heads)]):
        task_of[classes] = i
    logits = torch.cat([h(z) for h in heads], dim=1)  # (n, seen classes), in the order of `seen`
    other_task = task_of[seen][None, :] != task_of[y][:, None]  # (n, seen classes)
    rows = []
    for pred in (seen[logits.argmax(1)], seen[logits.masked_fill(other_task, -math.inf).argmax(1)]):
        rows.append([100.0 * float((pred == y)[task_of[y] == i].float().mean())
                     for i in range(len(heads))])
    return rows


@dataclass
class Learner:
    """One seed's run: what a task leaves to the next, and the rows measured so far."""
    seed: int
    model: torch.nn.Module
    subspaces: list  # an OnlineSubspace per block: OE's basis V and memory M
    heads: torch.nn.ModuleList  # one linear head per finished task
    prototypes: torch.Tensor  # (old classes, D), unit rows: DML's C_past
    acc: list = field(default_factory=list)  # task-agnostic accuracy rows (the paper's)
    aware: list = field(default_factory=list)  # task-aware rows (ours)
    task_seconds: list = field(default_factory=list)
    violation: dict = field(default_factory=lambda: {"k": [], "v": []})  # per task, per block

    def snapshot(self, tasks):
        """The checkpoint's "current": all the next task needs, and the run's generator."""
        kv = {n: t for n, t in self.model.state_dict().items() if re.search(r"\.attn\.[kv]\.", n)}
        return {"seed": self.seed, "kv": kv, "subspaces": [s.state_dict() for s in self.subspaces],
                "heads": self.heads.state_dict(), "prototypes": self.prototypes, "acc": self.acc,
                "aware": self.aware, "task_seconds": self.task_seconds,
                "violation": self.violation, "tasks": tasks, "rng": torch.get_rng_state()}

    def restore(self, state, tasks):
        device = self.prototypes.device
        for sub, s in zip(self.subspaces, state["subspaces"]):
            sub.load_state_dict({k: v.to(device) if torch.is_tensor(v) else v
                                 for k, v in s.items()})
        for i, _, layer in self.model.lora_layers():
            layer.memory = self.subspaces[i].memory  # it grows over a run: set it before loading
        self.model.load_state_dict(state["kv"], strict=False)  # K and V; the rest is pretrained
        D = self.model.embed_dim
        self.heads.extend(torch.nn.Linear(D, len(c)) for c in tasks[:len(state["acc"])])
        self.heads.load_state_dict(state["heads"])
        self.heads.to(device)
        self.prototypes = state["prototypes"].to(device)
        self.acc, self.aware = state["acc"], state["aware"]
        self.task_seconds, self.violation = state["task_seconds"], state["violation"]
        torch.set_rng_state(state["rng"])

    def results(self, T):
        """The seed's entry of results.json; rows padded with None to T columns."""
        pad = lambda rows: [row + [None] * (T - len(row)) for row in rows]
        return {"seed": self.seed, "acc_matrix": pad(self.acc), **metrics(self.acc),
                "task_aware": {"acc_matrix": pad(self.aware), **metrics(self.aware)},
                "task_seconds": self.task_seconds, "violation": self.violation}


def start_learner(cfg, seed, base_model, tasks, resume=None):
    """A fresh Learner for `seed` (the backbone copied, never changed), or the one in `resume`."""
    torch.manual_seed(seed)  # the only generator a run draws from (the loaders seed their own)
    device = torch.device(cfg.device)
    model = copy.deepcopy(base_model).to(device)
    for _, _, layer in model.lora_layers():
        layer.reset_lora_()  # the first task's A comes from this seed too
    D = model.embed_dim
    subspaces = [OnlineSubspace(D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, device)
                 for _ in model.blocks]
    learner = Learner(seed, model, subspaces, torch.nn.ModuleList(), torch.zeros(0, D).to(device))
    if resume is not None:
        learner.restore(resume, tasks)
    return learner


class Clock:
    """The run's ETA from the epochs this process has done so far."""

    def __init__(self, epochs_left):
        self.start, self.done, self.left = time.time(), 0, epochs_left

    def tick(self):
        self.done += 1
        return (time.time() - self.start) / self.done * (self.left - self.done)


def train_task(learner, t, classes, splits, cfg, clock, log=print):
    """Task t's training: a fresh head and Adam, then cfg.epochs epochs of train_step."""
    device, model = learner.prototypes.device, learner.model
    head = torch.nn.Linear(model.embed_dim, len(classes)).to(device)
    learner.heads.append(head)
    local = torch.full((splits.num_classes,), -1, dtype=torch.long, device=device)
    local[classes] = torch.arange(len(classes), device=device)  # global class id -> index in head
    loader = data.make_loader(data.subset(splits.train, classes), cfg.batch_size, True, cfg.workers,
                              learner.seed * 1000 + t, device)
    opt = torch.optim.Adam(model.lora_parameters() + list(head.parameters()), lr=cfg.lr,
                           betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    for epoch in range(cfg.epochs):
        e0, loss_sum, correct, seen = time.time(), 0.0, 0, 0
        for images, y in loader:
            images, y = images.to(device, non_blocking=True), local[y.to(device)]
            loss, right = train_step(model, head, opt, images, y, cfg, learner.subspaces,
                                     learner.prototypes)
            loss_sum, correct, seen = loss_sum + loss * len(y), correct + right, seen + len(y)
        sched.step()
        if not torch.isfinite(loss_sum):  # a diverged run must not go on to write results
            raise FloatingPointError(
                f"task {t + 1} epoch {epoch + 1}: the loss is {float(loss_sum)}; lower --lr and "
                "start again (checkpoint.pt, if there is one, holds the tasks finished before)")
        eta = clock.tick()
        log(f"task {t + 1}/{cfg.tasks} epoch {epoch + 1}/{cfg.epochs}  loss "
            f"{float(loss_sum) / seen:.4f}  train acc {100.0 * float(correct) / seen:5.2f}%  "
            f"{seen / (time.time() - e0):7.1f} img/s  ETA {eta / 60:.1f} min")


@torch.no_grad()
def end_task(learner, t, tasks, splits, cfg):
    """Task t's end: its violation, class prototypes, the OE merge, the LoRA merge, evaluation."""
    model, device = learner.model, learner.prototypes.device
    for name in ("k", "v"):
        learner.violation[name].append([violation(layer) for _, n, layer in model.lora_layers()
                                        if n == name])
    loader = data.make_loader(data.subset(splits.train_eval, tasks[t]), cfg.batch_size, False,
                              cfg.workers, 0, device)
    new = class_prototypes(*features(model, loader, device), tasks[t])
    learner.prototypes = torch.cat([learner.prototypes, new])
    if cfg.oe:
        for sub in learner.subspaces:
            sub.merge()
    for i, _, layer in model.lora_layers():
        layer.memory = learner.subspaces[i].memory  # K and V of block i share their input
        layer.merge_()  # W += s B A, then a fresh pair with A off the new memory
    for rows, row in zip((learner.acc, learner.aware),
                         evaluate(model, learner.heads, splits, tasks, cfg, device)):
        rows.append(row)


def run_seed(cfg, seed, base_model, splits, save, resume=None, log=print):
    """All tasks of one seed; save(snapshot) after each task; returns the seed's results."""
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    learner = start_learner(cfg, seed, base_model, tasks, resume)
    first = len(learner.acc)
    if resume is not None:
        log(f"seed {seed}: resumed after task {first}")
    clock = Clock((cfg.tasks - first) * cfg.epochs)
    for t in range(first, cfg.tasks):
        t0 = time.time()
        train_task(learner, t, tasks[t], splits, cfg, clock, log)
        end_task(learner, t, tasks, splits, cfg)
        learner.task_seconds.append(time.time() - t0)
        acc, aware = learner.acc[-1], learner.aware[-1]
        log(f"task {t + 1} accuracy per task: " + " ".join(f"{a:.2f}" for a in acc) +
            f"  | mean {sum(acc) / len(acc):.2f}  | task-aware mean {sum(aware) / len(aware):.2f}"
            f"  | {learner.task_seconds[-1]:.1f} s")
        if t > 0 and cfg.oe:  # task 1 has no memory to violate
            viol = {n: " ".join(f"{v:.3f}" for v in learner.violation[n][-1]) for n in "kv"}
            log(f"task {t + 1} violation ||dW M||/||dW|| per block  K: {viol['k']}  V: {viol['v']}")
        save(learner.snapshot(tasks))
    return learner.results(cfg.tasks)


# ==================================================================================================
# Results, checkpoints, plots, the benchmark, the command line
# ==================================================================================================
def summarize(runs):
    """Mean and std over seeds of ACC, MAA, BWT, and of the same three for task-aware accuracy."""
    stats = lambda v: {"mean": statistics.fmean(v), "std": statistics.pstdev(v)}
    out = {key: stats([r[key] for r in runs]) for key in ("ACC", "MAA", "BWT")}
    out["task_aware"] = {key: stats([r["task_aware"][key] for r in runs])
                         for key in ("ACC", "MAA", "BWT")}
    return out


def write_json(path, obj):
    tmp = path + ".tmp"  # write, then rename: an interruption never leaves half a file
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def plot(results, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no trajectory.png / violation.png (results.json has "
              "the numbers)")
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))  # paper Fig. 5: mean accuracy over the seen tasks
    for r in results["runs"]:
        for m, style, what in ((r["acc_matrix"], "o-", ""),
                               (r["task_aware"]["acc_matrix"], "s--", ", task-aware")):
            ax.plot(range(1, len(m) + 1), [sum(row[:t + 1]) / (t + 1) for t, row in enumerate(m)],
                    style, label=f"seed {r['seed']}{what}")
    ax.set(xlabel="task", ylabel="average accuracy on seen tasks (%)",
           title=results["config"]["dataset"],
           xticks=range(1, len(results["runs"][0]["acc_matrix"]) + 1))
    ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(out, "trajectory.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(6, 3.5))  # paper Fig. 2: per-layer violation, tasks 2..T
    viol = results["runs"][0]["violation"]
    for off, name in ((-0.2, "k"), (0.2, "v")):
        rows = viol[name][1:] or viol[name]
        mean = [sum(col) / len(col) for col in zip(*rows)]
        ax.bar([i + off for i in range(len(mean))], mean, width=0.4, label=name.upper())
    ax.set(xlabel="block", ylabel="||dW M|| / ||dW||",
           title="null-space violation (seed %d)" % results["runs"][0]["seed"])
    ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the legend above the bars
    ax.legend(ncol=2, loc="upper right"), fig.tight_layout()
    fig.savefig(os.path.join(out, "violation.png"), dpi=120)


def _bench_variant(cfg, base, change, m, C):
    """One --benchmark variant in a mid-run state: a random memory of m columns per block."""
    vcfg, model, D = Config(**{**asdict(cfg), **change}), copy.deepcopy(base), base.embed_dim
    model.to(cfg.device)
    subs = [OnlineSubspace(D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, cfg.device)
            for _ in model.blocks]
    for i, _, layer in model.lora_layers() if vcfg.oe else []:
        if subs[i].memory.shape[1] == 0:  # one memory per block, shared by its K and V
            subs[i].memory = torch.linalg.qr(torch.randn(D, m, device=cfg.device)).Q
            subs[i].basis = subs[i]._fresh_basis()
        layer.memory = subs[i].memory
        layer.reset_lora_()
    old = F.normalize(torch.randn(C * (cfg.tasks // 2), D, device=cfg.device), dim=1)
    head = torch.nn.Linear(D, C).to(cfg.device)
    opt = torch.optim.Adam(model.lora_parameters() + list(head.parameters()), lr=cfg.lr)
    return lambda images, y: train_step(model, head, opt, images, y, vcfg, subs, old)


def _time_loader(cfg):
    """Images/s of the data loader alone, beside the step times: a loader stall shows."""
    try:
        splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size, 0.0, 1.0,
                                   download=False)
    except data.DataError as e:
        print(f"data loader not timed: {e}")
        return None
    device = torch.device(cfg.device)
    loader = data.make_loader(splits.train, cfg.batch_size, True, cfg.workers, 0, device)
    batches, t0 = iter(loader), time.perf_counter()
    speed = sum(len(next(batches)[1]) for _ in range(min(cfg.steps, len(loader))))
    if device.type == "cuda":  # the device pipeline's kernels run asynchronously: wait for them
        torch.cuda.synchronize(device)
    speed /= time.perf_counter() - t0
    kind = (f"batched on {device}" if isinstance(loader, data.DeviceLoader)
            else f"{cfg.workers} workers")
    print(f"data loader alone ({cfg.dataset}, {kind}): {speed:.1f} images/s")
    return speed


def benchmark(cfg):
    """--benchmark: plain LoRA, janus-grad and janus-update, one step of each in turn on the same
    inputs, so that drift hits all alike; the median of the per-round ratios to plain."""
    device, C = torch.device(cfg.device), data.DATASETS[cfg.dataset]["num_classes"] // cfg.tasks
    base = build_model(Config(**{**asdict(cfg), "weights": "none"}))  # the cost is the same
    cuda, m = device.type == "cuda", min(cfg.k * (cfg.tasks // 2), base.embed_dim - cfg.k)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    images = torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, device=device)
    y = torch.randint(0, C, (cfg.batch_size,), device=device)
    changes = {"plain": dict(oe=False, gr=False, dml=False), "janus-grad": dict(rectify="grad"),
               "janus-update": dict(rectify="update")}
    steps, peaks = {}, {}
    for name, change in changes.items():  # built and warmed up one by one: each one's own memory
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        steps[name] = _bench_variant(cfg, base, change, m, C)
        for _ in range(3):  # warm-up: allocator, kernels, Adam's state
            steps[name](images, y)
        peaks[name] = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if cuda else None
    ms = {name: [] for name in steps}
    for _ in range(cfg.steps):  # interleaved rounds
        for name, step in steps.items():
            sync()
            t0 = time.perf_counter()
            step(images, y)
            sync()
            ms[name].append(1e3 * (time.perf_counter() - t0))
    median = lambda v: sorted(v)[len(v) // 2]
    report = {"device": torch.cuda.get_device_name(device) if cuda else
              f"cpu ({torch.get_num_threads()} threads)", "model": cfg.model,
              "batch_size": cfg.batch_size, "img_size": cfg.img_size, "memory_columns": m,
              "rounds": cfg.steps, "variants": {}}
    print(f"{report['device']}, {cfg.model}, batch {cfg.batch_size}, {cfg.img_size} px, memory "
          f"{m} columns/block, {cfg.steps} interleaved rounds\n{'variant':14s} {'ms/step':>9s} "
          f"{'images/s':>9s} {'peak MiB':>9s} {'x plain (median, IQR)':>24s}")
    for name, t in ms.items():
        ratios = sorted(a / b for a, b in zip(t, ms["plain"]))  # per round: drift cancels
        iqr = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]
        report["variants"][name] = {"ms_per_step": median(t), "images_per_s": 1e3 * cfg.batch_size
                                    / median(t), "peak_mem_mb": peaks[name],
                                    "x_plain": median(ratios), "x_plain_iqr": iqr}
        peak = "n/a" if peaks[name] is None else f"{peaks[name]:.0f}"
        print(f"{name:14s} {median(t):9.1f} {1e3 * cfg.batch_size / median(t):9.1f} {peak:>9s} "
              f"{median(ratios):12.3f} ({iqr[0]:.3f}-{iqr[1]:.3f})")
    report["loader_images_per_s"] = _time_loader(cfg)
    out = cfg.out or os.path.join("runs", f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "benchmark.json"), report)
    print(f"wrote {os.path.join(out, 'benchmark.json')}")
    return 0


RESUME_FREE = ("out", "resume", "device", "workers")  # flags that may differ on --resume
CHECKPOINT_FORMAT = 2  # raised whenever checkpoint.pt's content changes: old files are refused


def load_checkpoint(cfg):
    """The state saved in --resume DIR, after checking that it belongs to the same configuration."""
    path = os.path.join(cfg.resume, "checkpoint.pt")
    _require(os.path.isfile(path), f"--resume {cfg.resume}: no checkpoint.pt there; start a new "
             "run with --out instead")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data
    except Exception as e:  # unreadable for whatever reason: the user's to replace
        raise ConfigError(f"--resume {cfg.resume}: checkpoint.pt cannot be read "
                          f"({type(e).__name__}); remove the folder and start again") from None
    _require(isinstance(ckpt, dict) and ckpt.get("format") == CHECKPOINT_FORMAT,
             f"--resume {cfg.resume}: checkpoint.pt was written by another version of janus_min.py "
             "(or is not ours); finish that run with the version that wrote it, or start again")
    old, new = ckpt["config"], asdict(cfg)
    diff = [k for k in new if k not in RESUME_FREE and old.get(k) != new[k]]
    changed = ", ".join(f"{k}={old.get(k)!r}, not {new[k]!r}" for k in diff)
    _require(not diff, f"--resume {cfg.resume}: the run there used a different configuration "
             f"({changed}); pass the same flags")
    return ckpt


def save_checkpoint(out, cfg, runs, current):
    """checkpoint.pt, written then renamed: Ctrl-C during the save leaves the last one intact."""
    tmp = os.path.join(out, "checkpoint.pt.tmp")
    torch.save({"format": CHECKPOINT_FORMAT, "config": asdict(cfg), "runs": runs,
                "current": current}, tmp)
    os.replace(tmp, os.path.join(out, "checkpoint.pt"))


def prepare(cfg):
    """Everything that can fail on bad input, before the output folder is touched."""
    ckpt = load_checkpoint(cfg) if cfg.resume else None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = cfg.resume or cfg.out or os.path.join("runs", f"{cfg.dataset}-{stamp}")
    _require(ckpt is not None or not any(os.path.exists(os.path.join(out, f))
                                         for f in ("checkpoint.pt", "results.json")),
             f"{out} already holds a run; continue it with --resume {out} or choose another --out")
    scale = cfg.input_range
    if scale == "checkpoint":
        scale = vit.PRETRAINED_INPUT[cfg.weights]
    mean_std = vit.MEAN_STD.get(scale, (0.0, 1.0))  # unit: ToTensor's [0, 1] as it is
    splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size, *mean_std, seed=0,
                               limit_per_class=cfg.limit_per_class)
    return ckpt, out, splits, build_model(cfg)  # the backbone: loaded once, copied per seed


def print_summary(results):
    last, summary = results["runs"][-1], results["summary"]
    print("accuracy matrix (row t: after task t; %):")
    for row in last["acc_matrix"]:
        print("  " + " ".join("  -  " if a is None else f"{a:5.1f}" for a in row))
    print("  ".join(f"{k} {summary[k]['mean']:.2f} +- {summary[k]['std']:.2f}"
                    for k in ("ACC", "MAA", "BWT"))
          + f"  over {len(results['runs'])} seed(s);  task-aware: "
          + "  ".join(f"{k} {v['mean']:.2f}" for k, v in summary["task_aware"].items()))
    print(f"time per task (s): {' '.join(f'{x:.1f}' for x in last['task_seconds'])}; total "
          f"{sum(last['task_seconds']):.1f} s")


def main(argv=None):
    cfg = parse_args(argv)
    try:
        cfg = check_config(cfg)
        if cfg.benchmark:
            return benchmark(cfg)
        ckpt, out, splits, base_model = prepare(cfg)
    except (ConfigError, vit.CheckpointError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    print(f"{cfg.dataset}: {len(splits.train)} training / {len(splits.test)} test images, "
          f"{splits.num_classes} classes, {cfg.tasks} tasks; OE {cfg.oe} GR {cfg.gr} "
          f"({cfg.rectify}) DML {cfg.dml}; device {cfg.device}; out {out}")
    results = {"config": asdict(cfg), "runs": ckpt["runs"] if ckpt else []}
    try:
        for seed in cfg.seeds:
            if any(r["seed"] == seed for r in results["runs"]):
                continue  # finished before an interruption
            current = ckpt and ckpt["current"]
            resume = current if current and current["seed"] == seed else None
            save = functools.partial(save_checkpoint, out, cfg, results["runs"])  # by reference
            results["runs"].append(run_seed(cfg, seed, base_model, splits, save, resume))
            save_checkpoint(out, cfg, results["runs"], None)
            results["summary"] = summarize(results["runs"])  # after every seed: keep the others
            write_json(os.path.join(out, "results.json"), results)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {out}/checkpoint.pt holds the last finished task; continue with "
              f"--resume {out}")
        return 130
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "summary" not in results:  # --resume of a run whose seeds had all finished
        results["summary"] = summarize(results["runs"])
        write_json(os.path.join(out, "results.json"), results)
    print_summary(results)
    plot(results, out)
    print(f"wrote {os.path.join(out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
