"""Janus-LoRA (ICML 2026), minimal: the method, the class-incremental task loop, the command line.

A frozen ViT-B/16 learns one LoRA pair on K and V per task, merged into the weights at the task's
end. The paper's method (Sec. 3) comes first, in the order of its update step; our additions follow
in a section of their own. Equations are numbered as in the paper's LaTeX source; the README maps
the paper to this code and lists our readings where the paper is silent.
References: C. Chen et al., "JANUS-LoRA: A Balanced Low-Rank Adaptation for Continual Learning",
ICML 2026; InfLoRA (Liang & Li, CVPR 2024) for the protocol; LoRA-Pro (Wang et al., ICLR 2025).
"""
import argparse
import collections
import copy
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields


# ==================================================================================================
# Configuration: one dataclass; each field is a flag, its help the meaning and source. No torch
# here: --help answers before torch loads.
# ==================================================================================================
DATASET_NAMES = ("cifar100", "imagenet-r", "domainnet", "imagenet100", "fashion-mnist", "synthetic")
MODEL_NAMES = ("vit_base", "vit_small", "vit_tiny")  # data.DATASETS, vit.PRESETS (a test checks)


def _opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


# The methods of the paper's comparisons as flag sets: --method NAME puts them before the others.
METHODS = {"janus": [], "janus-rolling": ["--memory", "oe-rolling"],
           "finetune": ["--no-oe", "--no-gr", "--no-dml"],
           "lora-gpm": ["--memory", "gpm", "--no-gr", "--no-dml"],
           "lora-gpm-gr": ["--memory", "gpm", "--no-dml"],
           "inflora": ["--memory", "gpm", "--lora-a", "inflora", "--no-gr", "--no-dml"]}
GPM_THRESHOLDS = {"imagenet-r": (0.98, 1.0)}  # InfLoRA's configs (lamb, lame); others 0.95, 1.0
# --reproduce NAME: (what it reproduces, {row: its flags}); sweep values as read from the paper
REPRODUCE = {
    "ablation": ("Table 1: OE, GR, DML on and off (rows 1-7)", {
        "1": ["--no-oe", "--no-gr", "--no-dml"], "2": ["--no-oe", "--no-gr"],
        "3": ["--no-gr", "--no-dml"], "4": ["--no-oe", "--no-dml"], "5": ["--no-dml"],
        "6": ["--no-gr"], "7": []}),
    "methods": ("Tables 2 and 3: the methods we implement", {
        m: ["--method", m] for m in ("finetune", "lora-gpm", "inflora", "janus")}),
    "oe-vs-gpm": ("Table 5: OE against GPM in one epoch (Janus-LoRA otherwise; our reading)", {
        "gpm": ["--memory", "gpm", "--epochs", "1"], "oe": ["--epochs", "1"]}),
    "gr-plugin": ("Fig. 6: GR as a plug-in to LoRA-GPM", {
        "lora-gpm": ["--method", "lora-gpm"], "lora-gpm-gr": ["--method", "lora-gpm-gr"]}),
    "k": ("Fig. 4a: the rank k of the OE basis", {f"k{k}": ["--k", str(k)]
                                                  for k in (25, 50, 75, 100)}),
    "margin": ("Fig. 4b: the DML margin m", {f"m{m}": ["--margin", str(m)]
                                               for m in (0.1, 0.2, 0.3, 0.4, 0.5)}),
    "lambda": ("the appendix's figure: the DML weight lambda", {
        f"l{v}": ["--lambda-dml", str(v)] for v in (0.5, 1.0, 1.5, 2.0)}),
    "backbones": ("Table 4: Janus-LoRA on other pre-trainings", {
        w: ["--weights", w] for w in ("in21k", "sam", "dino")}),
}


@dataclass
class Config:
    dataset: str = _opt("cifar100", "data set (paper Sec. 4.1)", choices=DATASET_NAMES)
    data_dir: str = _opt("data", "folder that holds (or receives) the data set")
    tasks: int = _opt(None, "tasks T (default: the protocol's, e.g. 10 for CIFAR-100; Sec. 4.1)")
    epochs: int = _opt(None, "epochs per task (default: CIFAR-100 20, ImageNet-R 50, DomainNet 5)")
    batch_size: int = _opt(None, "batch size (default: 128, paper Sec. 4.1; synthetic 16)")
    lr: float = _opt(5e-4, "Adam learning rate (paper Sec. 4.1; InfLoRA codebase)")
    schedule: str = _opt("inflora", "lr per epoch of a task: inflora, the codebase's quarter "
                         "cosine; cosine, a half cosine to 0", choices=["inflora", "cosine"])
    precision: str = _opt("bf16", "on CUDA: bf16 autocast (ours) or fp32 (the InfLoRA codebase)",
                          choices=["bf16", "fp32"])
    model: str = _opt("vit_base", "backbone (paper: ViT-B/16)", choices=MODEL_NAMES)
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
    memory: str = _opt("oe", "the protected memory: oe, each task's OE basis joins it (ours); "
                       "oe-rolling, one OE basis per block is it (the paper's words); gpm, GPM's "
                       "pass after each task (Table 5)", choices=["oe", "oe-rolling", "gpm"])
    gpm_threshold: list = _opt(None, "GPM's energy threshold, lamb lame: task t of T gets lamb + "
                               "(lame - lamb) t / T, t from 0 (InfLoRA's; default 0.95 1.0, "
                               "ImageNet-R 0.98 1.0)", nargs=2, type=float)
    lora_a: str = _opt("trained", "each task's A: trained (paper), or designed from the task's "
                       "K/V inputs off the memory and frozen (InfLoRA)",
                       choices=["trained", "inflora"])
    method: str = _opt(None, "a method of the paper's tables as a preset of flags, put first: "
                       "later flags override its values (not its --no-... switches; README, "
                       "'Methods')", choices=sorted(METHODS))
    input_range: str = _opt("unit", "unit: [0, 1] as the InfLoRA codebase (paper); checkpoint: as "
                            "a named --weights was trained; half: [-1, 1]; imagenet: its mean, std",
                            choices=["unit", "checkpoint", "half", "imagenet"])
    seeds: list = _opt((0,), "seeds; several give mean +- std (paper: 5)", nargs="+", type=int)
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    compile: bool = _opt(False, "torch.compile each ViT block (off until it measures faster)",
                         action="store_true")
    # the cores this process may use (os.sched_getaffinity: not on every system)
    workers: int = _opt(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count() or 1, "loader workers of the file-based data sets "
                        "(default: the cores available)")
    limit_per_class: int = _opt(None, "keep at most this many training images per class")
    out: str = _opt(None, "output folder (default runs/<dataset>-<time>)")
    resume: str = _opt(None, "continue the run in this folder from its last finished task")
    benchmark: bool = _opt(False, "time plain LoRA and Janus steps, then exit", action="store_true")
    steps: int = _opt(20, "--benchmark: timed steps per variant (after 3 warm-up steps)")
    reproduce: str = _opt(None, "run every row of a table or figure of the paper into OUT/<row>/, "
                          "then write OUT/table.md (README, 'Reproducing')",
                          choices=list(REPRODUCE))
    row: str = _opt(None, "with --reproduce: run this row alone (one job of an array)")
    dry_run: bool = _opt(False, "with --reproduce: list the rows and their commands only",
                         action="store_true")


# --help's groups, in order: every field in one
GROUPS = {"data": "dataset data_dir tasks epochs batch_size limit_per_class img_size input_range",
          "model": "model weights patch_size rank lora_scale",
          "method (the paper's, and our readings)": "method lr schedule k oe_lr oe_decay_steps "
                                                    "delta margin lambda_dml tau rectify memory "
                                                    "gpm_threshold lora_a",
          "ablation (paper Table 1)": "oe gr dml",
          "run": "seeds device precision compile workers resume",
          "output and other modes": "out benchmark steps reproduce row dry_run"}
EXAMPLES = """examples:
  python janus_min.py --dataset cifar100 --data-dir data --seeds 0 1 2 3 4 --out runs/cifar
  python janus_min.py --reproduce ablation --dataset fashion-mnist --data-dir DIR \\
      --model vit_tiny --weights none --img-size 28 --patch-size 7 --limit-per-class 500 \\
      --epochs 2 --out runs/ablation"""


class ConfigError(Exception):
    """An impossible combination of flags."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message}; see python janus_min.py --help\n")


def _parser(given_only):
    p = _Parser(usage="python janus_min.py [flags]", epilog=EXAMPLES,
                description="Janus-LoRA (ICML 2026): class-incremental learning with a frozen ViT "
                            "and LoRA,\nmade stable by OE + GR and plastic by DML. Flags by group; "
                            "README.md has the details.",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                argument_default=argparse.SUPPRESS if given_only else None)
    groups = {title: p.add_argument_group(title) for title in GROUPS}
    group = {name: groups[title] for title, names in GROUPS.items() for name in names.split()}
    for f in fields(Config):
        flag, meta, g = "--" + f.name.replace("_", "-"), dict(f.metadata), group[f.name]
        if f.type is bool and f.default is False:
            g.add_argument(flag, **meta)
        elif f.type is bool:
            g.add_argument("--no-" + flag[2:], dest=f.name, action="store_false",
                           help="turn off " + meta["help"] + " (on by default)")
        else:
            meta.setdefault("type", {"int": int, "float": float}.get(f.type.__name__, str))
            if f.default is not None and "default" not in meta["help"]:  # None: the help says
                shown = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
                meta["help"] += f" (default: {shown})"
            g.add_argument(flag, **meta, **({} if given_only else {"default": f.default}))
    return p


def parse_args(argv=None, given_only=False):
    """The Config of argv, a --method preset before the other flags; given_only: a dict of the
    flags typed, and nothing else (what --resume compares)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if given_only:
        return vars(_parser(True).parse_args(argv))
    pre = _Parser(add_help=False)
    pre.add_argument("--method", choices=sorted(METHODS))
    method = pre.parse_known_args(argv)[0].method
    argv = METHODS.get(method, []) + argv  # the preset first: flags given explicitly override it
    return Config(**vars(_parser(False).parse_args(argv)))


if __name__ == "__main__":
    parse_args()  # answers --help and refuses bad flags before torch loads (2-3 s)

import torch  # noqa: E402 -- after the configuration, for the line above
import torch.nn.functional as F  # noqa: E402

import data  # noqa: E402
import vit  # noqa: E402


# ---- The configuration, checked (with the data sets' protocol and the device) --------------------
def _require(ok, message):
    if not ok:
        raise ConfigError(message)


def check_config(cfg):
    """Fill the data set's defaults; refuse impossible values with a line that says what to do."""
    info, width = data.DATASETS[cfg.dataset], vit.PRESETS[cfg.model].keywords["embed_dim"]
    for key in ("tasks", "epochs", "batch_size", "img_size"):
        if getattr(cfg, key) is None:
            setattr(cfg, key, info[key])
    cfg.gpm_threshold = list(cfg.gpm_threshold or GPM_THRESHOLDS.get(cfg.dataset, (0.95, 1.0)))
    cfg.seeds = list(cfg.seeds)  # one form (a typed --seeds is a list) for --resume's comparison
    floats = [f.name for f in fields(Config) if f.type is float]
    _require(all(math.isfinite(getattr(cfg, n)) for n in floats),
             "--" + ", --".join(n.replace("_", "-") for n in floats) + " must be finite numbers")
    _require(all(0 <= s < 2**32 for s in cfg.seeds), "--seeds must lie in 0 .. 2^32 - 1")
    _require(len(set(cfg.seeds)) == len(cfg.seeds), "--seeds: each seed once")
    _require(cfg.img_size >= 1 and cfg.patch_size >= 1, "--img-size and --patch-size must be >= 1")
    _require(cfg.tasks >= 1 and info["num_classes"] % cfg.tasks == 0, f"--tasks {cfg.tasks} does "
             f"not divide the {info['num_classes']} classes of {cfg.dataset}")
    _require(cfg.epochs >= 1, "--epochs must be at least 1")
    _require(cfg.batch_size >= 1, "--batch-size must be at least 1")
    _require(1 <= cfg.rank <= width, f"--rank must lie in 1..{width} (the width of {cfg.model})")
    _require(1 <= cfg.k <= width, f"--k must lie in 1..{width} (the block width of {cfg.model})")
    _require(cfg.lr > 0, "--lr must be positive")
    _require(min(cfg.margin, cfg.lambda_dml) >= 0, "--margin and --lambda-dml must not be negative")
    _require(cfg.tau > 0, "--tau must be positive")
    _require(cfg.lora_scale > 0, "--lora-scale must be positive")
    _require(cfg.weights == "none" or cfg.patch_size == 16 or cfg.benchmark,  # it: random ones
             "--patch-size other than 16 needs --weights none (the checkpoints are ViT-*/16)")
    _require(cfg.img_size % cfg.patch_size == 0, "--img-size must be a multiple of --patch-size")
    _require(cfg.input_range != "checkpoint" or cfg.weights in vit.PRETRAINED_INPUT,
             "--input-range checkpoint needs a named --weights; a file does not say how it was "
             "normalised: pass --input-range half (Google npz) or imagenet (DINO, torchvision)")
    _require(cfg.limit_per_class is None or cfg.limit_per_class >= 1,
             "--limit-per-class must be at least 1")
    _require(cfg.workers >= 0, "--workers must not be negative")
    _require(0 < cfg.gpm_threshold[0] <= cfg.gpm_threshold[1] <= 1,
             "--gpm-threshold takes two numbers 0 < first <= last <= 1")
    _require(cfg.lora_a == "trained" or not cfg.gr,
             "--lora-a inflora freezes A, and GR needs a trainable A: add --no-gr")
    _require(not cfg.reproduce or not (cfg.method or cfg.resume),
             "--reproduce chooses its rows' methods and resumes them: drop --method and --resume")
    rows = REPRODUCE.get(cfg.reproduce, ("", {}))[1]
    _require(cfg.row is None or cfg.row in rows, f"--row {cfg.row}: --reproduce {cfg.reproduce} "
             f"has the rows {', '.join(rows) or 'of a table: add --reproduce NAME'}")
    _require(min(cfg.delta, cfg.oe_lr, cfg.oe_decay_steps, cfg.steps) > 0,
             "--delta, --oe-lr, --oe-decay-steps and --steps must be positive")
    _require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device),
             f"--device {cfg.device}: use auto, cpu, cuda or cuda:N")
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count()
    _require(not cfg.device.startswith("cuda") or int(cfg.device.partition(":")[2] or 0) < gpus,
             f"--device {cfg.device} asked for, but torch sees {gpus} GPU(s); use --device cpu or "
             "an index below that")
    return cfg


# ==================================================================================================
# The paper's method (Sec. 3)
# ==================================================================================================
# ---- Theorem 1: the safe gradient ----------------------------------------------------------------
def safe_gradient(G, M):
    """G (..., d_out, d_in), M (..., d_in, m) orthonormal -> G (I - M M^T), Eq. (3)."""
    if M.shape[-1] == 0:
        return G
    return G - (G @ M) @ M.mT  # without forming the d_in x d_in projector


# ---- Gradient Rectification, Eqs. (5)-(7) --------------------------------------------------------
def _ridge(S, delta):
    """S + delta * mean(eig S) * I for Gram matrices S (..., r, r) (README, "GR ridge")."""
    lam = delta * S.diagonal(dim1=-2, dim2=-1).mean(-1) + torch.finfo(S.dtype).tiny  # S = 0: finite
    return S + lam[..., None, None] * torch.eye(S.shape[-1], dtype=S.dtype, device=S.device)


def _gram(X):
    """X^T X (..., k, k) of X (..., n, k), in float64: float32's round-off can leave a Gram matrix
    indefinite under its ridge, and Cholesky then fails (NaN on CUDA; a fp32 ViT-B run hit it)."""
    X = X.double()
    return X.mT @ X


def _spd_solve(S, rhs):
    """S^-1 rhs for symmetric positive definite S (..., n, n), by Cholesky and two triangular
    solves: unlike linalg.solve, nothing checks the result on the host (no CUDA sync)."""
    L = torch.linalg.cholesky_ex(S).L
    return torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L, rhs, upper=False),
                                         upper=True)


def rectify_factors(BtG, GAt, A, B, scale, delta=1e-4):
    """GR from B^T G_safe (..., r, d_in) and G_safe A^T (..., d_out, r) alone -> (dA, dB), in
    BtG's dtype; the r x r systems in float64 (see _gram), which costs nothing at rank r."""
    dtype, (BtG, GAt, A, B) = BtG.dtype, (t.double() for t in (BtG, GAt, A, B))
    dA = _spd_solve(_ridge(_gram(B), delta), BtG) / scale  # Eq. (6)
    RAt = GAt - scale * B @ (dA @ A.mT)  # R A^T, with the residual R = G_safe - s B dA
    dB = _spd_solve(_ridge(_gram(A.mT), delta), RAt.mT).mT / scale  # Eq. (7)
    return dA.to(dtype), dB.to(dtype)


def rectify(G_safe, A, B, scale, delta=1e-4):
    """Eqs. (6)-(7) for a dense G_safe (d_out, d_in). Reference form: not on the training path."""
    return rectify_factors(B.mT @ G_safe, G_safe @ A.mT, A, B, scale, delta)


def rectify_gradients_(layers, delta):
    """Replace the LoRA pairs' gradients by GR's, all layers in one batch (the paper: Adam then
    takes them)."""
    A, B = (torch.stack([getattr(layer, n).detach() for layer in layers]) for n in "AB")
    gA, gB = (torch.stack([getattr(layer, n).grad for layer in layers]) for n in "AB")
    s = layers[0].scale
    # autograd left gA = s B^T G_safe and gB = s G_safe A^T (Theorem 1, in the forward)
    dA, dB = rectify_factors(gA / s, gB / s, A, B, s, delta)
    for layer, a, b in zip(layers, dA, dB):
        layer.A.grad.copy_(a)
        layer.B.grad.copy_(b)


# ---- Online Estimation, Eqs. (8)-(10) ------------------------------------------------------------
def _columns_off(V, M):
    """(I - M M^T) V: the columns of V without their part in span(M)."""
    return V - M @ (M.mT @ V)


class OnlineSubspace:
    """OE's basis V (dim, k) of the current task and the protected memory M (dim, m) of the
    finished ones, for one block, or for all at once (blocks=L: V (L, dim, k), M (L, dim, m)).
    V stays orthogonal to M and joins it at the task's end."""

    def __init__(self, dim, k, lr=1.0, decay_steps=5, device=None, blocks=None):
        self.dim, self.k, self.lr, self.decay_steps = dim, k, lr, decay_steps
        self.batch = () if blocks is None else (blocks,)
        self.memory = torch.zeros(*self.batch, dim, 0, device=device)
        self.basis = self._fresh_basis()
        self.steps = 0

    def _fresh_basis(self):
        k = min(self.k, self.dim - self.memory.shape[-1])  # a full memory leaves no room
        # drawn on the CPU: a run's random numbers must not depend on the device
        V = torch.randn(*self.batch, self.dim, k).to(self.memory.device)
        return torch.linalg.qr(_columns_off(V, self.memory)).Q

    @torch.no_grad()
    def update(self, X):
        """One step on Eq. (8), (1/2)||X_p - X_p V V^T||^2 with X_p = X (I - M M^T); X (n, dim),
        or when batched a list of one (n, dim) per block."""
        V, M = self.basis, self.memory
        if V.shape[-1] == 0:
            return
        XtXV, S = [], []
        for x, v in zip(X if self.batch else [X], V.reshape(-1, self.dim, V.shape[-1])):
            x = x.float()  # one block at a time: a float32 copy of all blocks would be large
            xv = x @ v  # (n, k); equals X_p V, as V is orthogonal to M
            XtXV.append(x.T @ xv)
            S.append(_gram(xv))  # (k, k): the energy each direction captures
        CV = _columns_off(torch.stack(XtXV).reshape(V.shape), M)  # X_p^T X_p V
        grad = -(CV - V @ (V.mT @ CV))  # the Euclidean gradient of Eq. (8) at an orthonormal V
        S = _ridge(torch.stack(S).reshape(*V.shape[:-2], *S[0].shape), 1e-6)  # idle: finite
        lr = self.lr * self.decay_steps / (self.decay_steps + self.steps)  # harmonic decay (ours)
        # Eq. (9), preconditioned by S^-1 (ours): scale-free, and lr = 1 is one subspace iteration;
        # float64, as S's ridge can lie below float32's round-off where one direction dominates
        V_tilde = V - lr * _spd_solve(S, grad.mT.double()).mT.to(V.dtype)
        Q, R = torch.linalg.qr(V_tilde)  # Eq. (10)
        signs = R.diagonal(dim1=-2, dim2=-1).sign()
        V = Q * torch.where(signs == 0, 1.0, signs)[..., None, :]  # R's diagonal > 0: no flips
        self.basis = _columns_off(V, M)  # round-off must not leak V into span(M)
        self.steps += 1

    @torch.no_grad()
    def merge(self):
        """End of a task: M <- orth([M, V]), and a fresh V off the new memory."""
        self.memory = torch.linalg.qr(torch.cat([self.memory, self.basis], dim=-1)).Q
        self.basis = self._fresh_basis()
        self.steps = 0

    def state_dict(self):
        return {"memory": self.memory, "basis": self.basis, "steps": self.steps}

    def load_state_dict(self, state):
        self.memory, self.basis, self.steps = state["memory"], state["basis"], state["steps"]


# ---- Decoupled Margin Loss, Eq. (11) -------------------------------------------------------------
def dml_loss(z, y, old_prototypes, margin=0.3, tau=0.07, num_classes=None):
    """Eq. (11). z (B, D) features, y (B,) labels of the current task (of num_classes), old
    prototypes (P, D) unit rows. The current prototypes are the batch's normalised class means."""
    z = F.normalize(z.float(), dim=1)
    onehot = F.one_hot(y, num_classes or int(y.max()) + 1).float()  # (B, C); pass C: no sync
    protos = F.normalize(onehot.T @ z, dim=1)  # (C, D); a class absent from the batch: 0
    logits = (z @ protos.T / tau).masked_fill(onehot.sum(0) == 0, -math.inf)  # over C_t only
    intra = F.cross_entropy(logits, y)  # softmax over the batch's classes of z.p_c / tau
    if old_prototypes.shape[0] == 0:
        return intra
    return intra + F.relu(z @ old_prototypes.T - margin).mean()  # hinge: mean over batch x old


# ---- Metrics (Sec. 4.1) and the null-space violation (Fig. 2) ------------------------------------
def metrics(acc):
    """ACC, MAA, BWT of acc[t][i], the accuracy (%) on task i after task t (i <= t is read); BWT
    is undefined (None) with one task."""
    T = len(acc)
    maa = sum(sum(acc[t][: t + 1]) / (t + 1) for t in range(T)) / T
    bwt = sum(acc[T - 1][i] - acc[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else None
    return {"ACC": sum(acc[T - 1][:T]) / T, "MAA": maa, "BWT": bwt}


@torch.no_grad()
def violation(layer):
    """||dW M||_F / ||dW||_F of the layer's task update dW = s B A, never forming dW; None where
    it is undefined (no memory yet, or no update, as under a full memory)."""
    A, B, M = layer.A, layer.B, layer.memory
    den = ((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt()  # ||B A||_F^2 = tr(B^T B A A^T)
    if M.shape[1] == 0 or den == 0:
        return None
    return float((B @ (A @ M)).norm() / den)


# ---- The integrated update (Sec. 3, "The Integrated Janus-LoRA Update Process") ------------------
def train_step(model, head, opt, images, y, cfg, subspace, prototypes):
    """One training step, in the paper's order. y: labels local to the task. -> (loss, correct)."""
    layers, online = [layer for _, _, layer in model.lora_layers()], cfg.oe and cfg.memory != "gpm"
    if online and cfg.memory == "oe-rolling":  # the paper's words read literally: V is the memory
        set_memories(model, subspace.basis)  # as it stands: both projections of the step use it
    # (1) the total loss, Eq. (12): the current head's cross-entropy plus lambda * DML, Eq. (11)
    with autocast(images.device, cfg):
        z, kv_inputs = model.encode(images) if online else (model(images), None)
    z = z.float()
    logits = head(z)
    loss = F.cross_entropy(logits, y)
    if cfg.dml:
        loss = loss + cfg.lambda_dml * dml_loss(z, y, prototypes, cfg.margin, cfg.tau,
                                                head.out_features)
    # OE, Eqs. (8)-(10), on this batch's K/V inputs: it learns the task's basis V, which joins the
    # memory M at the task's end; the projection in (3) uses M only, never V (README).
    if online:
        subspace.update([X.detach().flatten(0, 1) for X in kv_inputs])  # (B*N, D) per block
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


def autocast(device, cfg):
    """bf16 autocast on CUDA unless --precision fp32 (the InfLoRA codebase's); none on the CPU."""
    use = device.type == "cuda" and cfg.precision == "bf16"
    return torch.autocast(device.type, torch.bfloat16, enabled=use)


def set_memories(model, memories):
    """Each LoRA layer projects with its block's memory (K and V of a block share their input)."""
    for i, _, layer in model.lora_layers():
        layer.memory = memories[i]


# ==================================================================================================
# Our additions: --rectify update (README, "--rectify grad and update")
# ==================================================================================================
def least_norm_split(dA, dB, A, B):
    """Of the steps (dA + C A, dB - B C), which keep the composite B dA + dB A, the one of least
    ||dA||^2 + ||dB||^2: C solves (B^T B) C + C (A A^T) = B^T dB - dA A^T. With A and B of full
    rank r these are all the steps with that composite (README). In float64, as GR."""
    dtype, (dA, dB, A, B) = dA.dtype, (t.double() for t in (dA, dB, A, B))
    P, Q = _gram(B), _gram(A.mT)  # (..., r, r)
    r, I = P.shape[-1], torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    # row-major vec(P C + C Q) = (P kron I + I kron Q) vec(C): an r^2 x r^2 positive semidefinite
    # system, consistent, solved with a round-off ridge (its least-norm solution where singular)
    K = torch.einsum("...ik,jl->...ijkl", P, I) + torch.einsum("ik,...jl->...ijkl", I, Q)
    rhs = (B.mT @ dB - dA @ A.mT).reshape(*P.shape[:-2], r * r, 1)
    C = _spd_solve(_ridge(K.reshape(*P.shape[:-2], r * r, r * r), r * torch.finfo(P.dtype).eps),
                   rhs).reshape(P.shape)
    return (dA + C @ A).to(dtype), (dB - B @ C).to(dtype)


def _stacked_memories(layers):
    """The layers' memories as one (L, d_in, m) tensor; zero columns pad the narrower ones, which
    changes no projection."""
    m = max(layer.memory.shape[1] for layer in layers)
    return torch.stack([F.pad(layer.memory, (0, m - layer.memory.shape[1])) for layer in layers])


@torch.no_grad()
def rectify_updates_(layers, before, delta):
    """Rectify the step Adam took from `before` (each layer's (A, B)): the composite step
    s (B dA + dB A) is projected by Theorem 1, rectified, and split with the least norm."""
    A0, B0 = (torch.stack(t) for t in zip(*before))  # (L, r, d_in), (L, d_out, r)
    s = layers[0].scale
    dA = torch.stack([layer.A for layer in layers]) - A0  # Adam's proposed step
    dB = torch.stack([layer.B for layer in layers]) - B0
    M = _stacked_memories(layers)
    # B^T dW_safe and dW_safe A^T of dW = s (B dA + dB A), with r-wide products only
    BtW = safe_gradient(s * ((B0.mT @ B0) @ dA + (B0.mT @ dB) @ A0), M)
    Ap = safe_gradient(A0, M).mT  # (I - M M^T) A^T  (L, d_in, r)
    WAt = s * (B0 @ (dA @ Ap) + dB @ (A0 @ Ap))
    rA, rB = least_norm_split(*rectify_factors(BtW, WAt, A0, B0, s, delta), A0, B0)
    for layer, a, b in zip(layers, A0 + rA, B0 + rB):
        layer.A.copy_(a)
        layer.B.copy_(b)


def rectified_adam_step_(opt, layers, delta):
    """Step (5) under --rectify update: Adam proposes a step, GR rectifies it."""
    before = [(layer.A.detach().clone(), layer.B.detach().clone()) for layer in layers]
    opt.step()
    rectify_updates_(layers, before, delta)


# ==================================================================================================
# The paper's comparisons: GPM (LoRA-GPM, Table 5) and InfLoRA (Tables 2, 3), computed as the
# InfLoRA codebase does, but where the README's "Methods" says otherwise
# ==================================================================================================
@torch.no_grad()
def kv_covariance(model, loader, cfg):
    """Each block's uncentred K/V-input covariance (L, D, D) over every token of the loader."""
    C, n, device = 0.0, 0, torch.device(cfg.device)
    for images, _ in loader:
        with autocast(device, cfg):
            kv = model.encode(images.to(device, non_blocking=True))[1]  # (B, N, D) per block
        X = [x.float().flatten(0, 1) for x in kv]
        C, n = C + torch.stack([x.T @ x for x in X]), n + X[0].shape[0]
    return C / n


def gpm_extend(M, C, threshold):
    """GPM (Saha et al., ICLR 2021): M (D, m) plus the fewest leading directions of (I - M M^T) C
    that bring the captured share of C's energy to the threshold. As the InfLoRA codebase: the
    energy of a direction is its squared singular value of the covariance C (D, D)."""
    C, M64 = C.double(), M.double()  # once a task: float64 keeps the memory orthonormal
    total = torch.linalg.svdvals(C).square().sum()
    U, s, _ = torch.linalg.svd(C - M64 @ (M64.T @ C))
    e = s.square() / total  # (D,) each residual direction's share
    before = (1 - e.sum()) + torch.cumsum(e, 0) - e  # the share held before adding direction i
    r = min(int((before < threshold).sum()), C.shape[0] - M.shape[1])  # never past the width
    return torch.cat([M, U[:, :r].to(M.dtype)], dim=1)


def gpm_threshold(cfg, t):
    """InfLoRA's schedule of the GPM threshold: lamb at the first task (t = 0), rising by
    (lame - lamb) / T a task; lame itself is never reached."""
    lamb, lame = cfg.gpm_threshold
    return lamb + (lame - lamb) * t / cfg.tasks


def inflora_a(C, M, rank):
    """InfLoRA's A (r, D): the top-r left singular vectors of (I - M M^T) C, over sqrt(3) as in its
    code (Liang & Li, CVPR 2024); it lies off span(M) and stays frozen."""
    C, M64 = C.double(), M.double()  # float64: the trailing vectors' round-off stays off M
    U = _columns_off(torch.linalg.svd(C - M64 @ (M64.T @ C)).U[:, :rank], M64)
    return (U.T / math.sqrt(3)).to(M.dtype)


# ==================================================================================================
# The paper's analyses, measured in every run: the null-space violation on real activations
# (Fig. 2), DML's geometry (Fig. 3 and the appendix's density), the time per task and epoch
# ==================================================================================================
class Probe:
    """Task t's analyses from the evaluation's own pass over the seen tasks' test images: each K/V
    layer's interference ||X dW_t^T||_F^2 on the past tasks' inputs and the current task's, and
    the current task's features. factors: per layer, the task's (A, B) before the merge."""

    def __init__(self, factors, scale, current, device):
        self.factors, self.scale, self.current = factors, scale, current  # current: (classes,)
        self.energy = torch.zeros(2, len(factors), device=device)  # (past, current) x layers
        self.tokens = torch.zeros(2, device=device)
        self.z, self.y = [], []

    def add(self, z, kv_inputs, y):
        now = self.current[y]  # (B,) bool: a sample of the current task
        for j, (A, B) in enumerate(self.factors):  # K and V of block j // 2 share its input
            u = kv_inputs[j // 2].float() @ A.T  # (B, N, r)
            e = self.scale ** 2 * ((u @ (B.T @ B)) * u).sum((1, 2))  # ||X dW^T||^2 per image
            self.energy[:, j] += torch.stack([e[~now].sum(), e[now].sum()])
        self.tokens += torch.stack([(~now).sum(), now.sum()]) * kv_inputs[0].shape[1]
        self.z.append(z[now])
        self.y.append(y[now])

    def interference(self):
        """Per layer: the RMS of x dW^T over past tokens, over current ones, and their ratio."""
        past, now = (self.energy / self.tokens[:, None]).sqrt().tolist()
        return {"past": past, "current": now, "ratio": [p / c if c > 0 else None
                                                         for p, c in zip(past, now)]}


def dml_geometry(z, y, prototypes, old, bins=20):
    """For one task's test features z (n, D) of classes y: cos_old, the largest cosine to an old
    class's prototype (classes < old), and cos_own, to its own class's (prototypes: one per class,
    in class order); the shares the paper reads, and the histogram of cos_old over [-1, 1]."""
    z = F.normalize(z.float(), dim=1)
    cos_old = (z @ prototypes[:old].T).amax(1)  # (n,)
    cos_own = (z * prototypes[y]).sum(1)
    share = lambda mask: float(mask.float().mean())
    return {"danger": share(cos_old > 0.5), "safe": share(cos_old < 0.2),
            "closer_to_old": share(cos_old > cos_own),
            "hist": (torch.histc(cos_old, bins, -1, 1) / len(z)).tolist(),
            "cos_old": [round(v, 4) for v in cos_old.tolist()],
            "cos_own": [round(v, 4) for v in cos_own.tolist()]}


# ==================================================================================================
# The class-incremental task loop: a Learner is trained task by task (train_task, end_task)
# ==================================================================================================
def build_model(cfg):
    torch.manual_seed(0)  # with --weights none, a random backbone plays the checkpoint: one for all
    model = vit.PRESETS[cfg.model](img_size=cfg.img_size, patch_size=cfg.patch_size,
                                   lora_rank=cfg.rank, lora_scale=cfg.lora_scale)
    vit.load_pretrained(model, cfg.weights)
    return model.eval()  # for good: the ViT has no dropout, and training never switches modes


def lr_factor(epoch, epochs, schedule):
    """The lr of a task's epoch, as a factor of --lr: InfLoRA's CosineSchedule as its code steps
    it, cos(99 pi e / (200 (K - 1))) for e = epoch - 1 after an epoch at 1; or a half cosine."""
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * epoch / epochs))
    if epoch == 0 or epochs == 1:  # the codebase divides by zero at K = 1; one epoch at lr
        return 1.0
    return math.cos(99 * math.pi * (epoch - 1) / (200 * (epochs - 1)))


@torch.no_grad()
def features(model, loader, cfg, probe=None):
    """(z (n, D), y (n,)) of the loader's images; a probe also sees each batch's K/V inputs."""
    zs, ys, device = [], [], torch.device(cfg.device)
    for images, y in loader:
        images, y = images.to(device, non_blocking=True), y.to(device)
        with autocast(device, cfg):
            z, kv_inputs = model.encode(images) if probe else (model(images), None)
        zs.append(z.float())
        ys.append(y)
        if probe:
            probe.add(zs[-1], kv_inputs, y)
    return torch.cat(zs), torch.cat(ys)


@torch.no_grad()
def class_prototypes(z, y, classes):
    """(len(classes), D): each class's normalised mean of normalised features (DML's C_past)."""
    z = F.normalize(z, dim=1)
    return torch.stack([F.normalize(z[y == c].mean(0), dim=0) for c in classes])


@torch.no_grad()
def evaluate(model, heads, splits, tasks, cfg, probe=None):
    """Row t of the accuracy matrices, per seen task: task-agnostic (the paper: all seen heads, one
    argmax, no task id) and task-aware (ours: the true task's head only); and the accuracy over
    all test samples of the seen classes (sample-weighted, as InfLoRA's logs)."""
    seen = torch.tensor([c for classes in tasks[:len(heads)] for c in classes], device=cfg.device)
    test = data.subset(splits.test, seen.tolist())
    loader = data.make_loader(test, cfg.batch_size, False, cfg.workers, 0, cfg.device)
    z, y = features(model, loader, cfg, probe)
    task_of = torch.empty(int(seen.max()) + 1, dtype=torch.long, device=cfg.device)
    for i, classes in enumerate(tasks[:len(heads)]):
        task_of[classes] = i
    logits = torch.cat([h(z) for h in heads], dim=1)  # (n, seen classes), in the order of `seen`
    other_task = task_of[seen][None, :] != task_of[y][:, None]  # (n, seen classes)
    rows = []
    for pred in (seen[logits.argmax(1)], seen[logits.masked_fill(other_task, -math.inf).argmax(1)]):
        rows.append([100.0 * float((pred == y)[task_of[y] == i].float().mean())
                     for i in range(len(heads))])
    return rows[0], rows[1], 100.0 * float((seen[logits.argmax(1)] == y).float().mean())


@dataclass
class Learner:
    """One seed's run: what a task leaves to the next, and what was measured so far."""
    seed: int
    model: torch.nn.Module
    subspace: OnlineSubspace  # OE's bases V (blocks, D, k) and, with --memory oe, their memory
    memory: list  # the protected memory M of each block, (D, m): what the projection uses
    heads: torch.nn.ModuleList  # one linear head per finished task
    prototypes: torch.Tensor  # (old classes, D), unit rows: DML's C_past
    acc: list = field(default_factory=list)  # task-agnostic accuracy rows (the paper's)
    aware: list = field(default_factory=list)  # task-aware rows (ours)
    sample_acc: list = field(default_factory=list)  # per row, over all seen test samples
    task_seconds: list = field(default_factory=list)
    violation: dict = field(default_factory=lambda: {"k": [], "v": []})  # per task, per block
    interference: list = field(default_factory=list)  # per task: Probe.interference(), or None
    geometry: list = field(default_factory=list)  # per task: dml_geometry(...), or None
    throughput: list = field(default_factory=list)  # per task: images/s of each epoch
    warnings: list = field(default_factory=list)  # what makes the numbers invalid (divergence)

    MEASURED = ("acc", "aware", "sample_acc", "task_seconds", "violation", "interference",
                "geometry", "throughput", "warnings")

    def snapshot(self, tasks):
        """The checkpoint's "current": all the next task needs, and the run's generator."""
        kv = {n: t for n, t in self.model.state_dict().items() if re.search(r"\.attn\.[kv]\.", n)}
        return {"seed": self.seed, "kv": kv, "subspace": self.subspace.state_dict(),
                "memory": self.memory, "heads": self.heads.state_dict(),
                "prototypes": self.prototypes,
                "tasks": tasks, "rng": torch.get_rng_state(),
                **{key: getattr(self, key) for key in self.MEASURED}}

    def restore(self, state, tasks):
        device = self.prototypes.device
        to = lambda v: v.to(device) if torch.is_tensor(v) else v
        self.subspace.load_state_dict({k: to(v) for k, v in state["subspace"].items()})
        self.memory = [to(m) for m in state["memory"]]
        self.model.load_state_dict(state["kv"], strict=False)  # K and V; the rest is pretrained
        set_memories(self.model, self.memory)
        D = self.model.embed_dim
        self.heads.extend(torch.nn.Linear(D, len(c)) for c in tasks[:len(state["acc"])])
        self.heads.load_state_dict(state["heads"])
        self.heads.to(device)
        self.prototypes = to(state["prototypes"])
        for key in self.MEASURED:
            setattr(self, key, state[key])
        torch.set_rng_state(state["rng"])

    def results(self, T):
        """The seed's entry of results.json; rows padded with None to T columns."""
        pad = lambda rows: [row + [None] * (T - len(row)) for row in rows]
        return {"seed": self.seed, "acc_matrix": pad(self.acc), **metrics(self.acc),
                "task_aware": {"acc_matrix": pad(self.aware), **metrics(self.aware)},
                **{key: getattr(self, key) for key in self.MEASURED if key not in ("acc", "aware")}}


def start_learner(cfg, seed, base_model, tasks, resume=None):
    """A fresh Learner for `seed` (the backbone copied, never changed), or the one in `resume`."""
    torch.manual_seed(seed)  # the only generator a run draws from (the loaders seed their own)
    device = torch.device(cfg.device)
    model = copy.deepcopy(base_model).to(device)
    for _, _, layer in model.lora_layers():
        layer.reset_lora_()  # the first task's A comes from this seed too
    for block in model.blocks if cfg.compile else []:
        block.compile()  # in place: the parameter names, and so the checkpoints, stay the same
    L, D = len(model.blocks), model.embed_dim
    subspace = OnlineSubspace(D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, device, blocks=L)
    learner = Learner(seed, model, subspace, [torch.zeros(D, 0, device=device)] * L,
                      torch.nn.ModuleList(), torch.zeros(0, D, device=device))
    if resume is not None:
        learner.restore(resume, tasks)
    return learner


class Progress:
    """The run's progress lines, to the console (flushed; in place on a terminal) and to DIR/log.txt
    (appended on resume). While a task trains, a heartbeat thread writes the loop's latest state
    at least every `every` seconds, however long a step takes (minutes for ViT-B on a CPU), with
    the run's ETA, evaluation included (its images are timed apart from the training's)."""

    def __init__(self, folder, every=30.0):
        self.file = open(os.path.join(folder, "log.txt"), "a", encoding="utf-8")
        self.tty, self.every, self.last = sys.stdout.isatty(), every, time.time()
        self.seconds, self.images = {"train": 0.0, "eval": 0.0}, {"train": 0, "eval": 0}
        self.left = {"train": 0, "eval": 0}  # images still to pass, set by plan()
        self.describe, self.lock, self.stop = None, threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def log(self, line, in_place=False):
        with self.lock:  # the heartbeat writes too
            print("\r\033[K" * self.tty + line, end="" if in_place else "\n", flush=True)
            if not in_place:
                self.file.write(line + "\n")
                self.file.flush()
            self.last = time.time()

    def plan(self, train, evaluation):
        self.left = {"train": train, "eval": evaluation}

    def done(self, kind, images, seconds):
        self.seconds[kind] += seconds
        self.images[kind] += images
        self.left[kind] -= images

    def eta(self):
        """Seconds left: the images still to train and to evaluate, each at its measured rate (an
        evaluation not yet timed at a third of training's: a forward pass, no backward)."""
        train = self.seconds["train"] / max(self.images["train"], 1)
        evaluate = self.seconds["eval"] / self.images["eval"] if self.images["eval"] else train / 3
        return self.left["train"] * train + self.left["eval"] * evaluate

    def step(self, describe):
        """The training loop's latest state, as a function that words it (None: not training)."""
        self.describe = describe

    def beat(self):
        """A line of the loop's state if none came for `every` s; in place each second on a tty."""
        describe = self.describe
        if describe and time.time() - self.last >= (1.0 if self.tty else self.every):
            self.log(describe(), in_place=self.tty)

    def _beat(self):
        while not self.stop.wait(1.0):
            self.beat()

    def close(self):
        self.stop.set()
        self.thread.join()
        self.file.close()


def start_task(learner, t, tasks, splits, cfg):
    """Task t's start: a fresh head; with --lora-a inflora, InfLoRA designs each block's A from
    the task's K/V inputs (test transform) off the memory, and freezes it."""
    model, device = learner.model, learner.prototypes.device
    learner.heads.append(torch.nn.Linear(model.embed_dim, len(tasks[t])).to(device))
    learner.subspace.steps = 0  # each task's OE starts with large steps (README)
    for _, _, layer in model.lora_layers():
        layer.A.requires_grad_(cfg.lora_a == "trained")  # InfLoRA trains B only
    if cfg.lora_a != "inflora":
        return
    loader = data.make_loader(data.subset(splits.train_eval, tasks[t]), cfg.batch_size, False,
                              cfg.workers, 0, device)
    C = kv_covariance(model, loader, cfg)  # (L, D, D)
    A = [inflora_a(C_i, M, cfg.rank) for C_i, M in zip(C, learner.memory)]  # K, V share an A
    with torch.no_grad():
        for i, _, layer in model.lora_layers():
            layer.A.copy_(A[i])


def train_task(learner, t, classes, splits, cfg, progress):
    """Task t's training: Adam on the LoRA pairs and the task's head, cfg.epochs epochs."""
    device, model, head = learner.prototypes.device, learner.model, learner.heads[-1]
    local = torch.full((splits.num_classes,), -1, dtype=torch.long, device=device)
    local[classes] = torch.arange(len(classes), device=device)  # global class id -> index in head
    loader = data.make_loader(data.subset(splits.train, classes), cfg.batch_size, True, cfg.workers,
                              learner.seed * 1000 + t, device)
    params = [p for p in model.lora_parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: lr_factor(e, cfg.epochs, cfg.schedule))
    learner.throughput.append([])
    where, first = f"task {t + 1}/{cfg.tasks}", None
    for epoch in range(cfg.epochs):
        e0, loss_sum, correct, seen, steps = time.time(), 0.0, 0, 0, 0
        progress.step(lambda: f"{where} epoch {epoch + 1}/{cfg.epochs}: {steps}/{len(loader)} "
                      f"steps done" + (f", loss {float(loss_sum) / seen:.4f}, "
                                       f"{seen / (time.time() - e0):.1f} img/s, ETA "
                                       f"{progress.eta() / 60:.1f} min" if seen else ""))
        for images, y in loader:
            t0, images, y = time.time(), images.to(device, non_blocking=True), local[y.to(device)]
            loss, right = train_step(model, head, opt, images, y, cfg, learner.subspace,
                                     learner.prototypes)
            loss_sum, correct, seen = loss_sum + loss * len(y), correct + right, seen + len(y)
            first = float(loss) if first is None else first  # a sync a task: the divergence mark
            progress.done("train", len(y), time.time() - t0)
            steps += 1  # the heartbeat reads these, live
        progress.step(None)
        sched.step()
        if not torch.isfinite(loss_sum):  # a diverged run must not go on to write results
            raise FloatingPointError(
                f"task {t + 1} epoch {epoch + 1}: the loss is {float(loss_sum)}; lower --lr and "
                "start again (checkpoint.pt, if there is one, holds the tasks finished before)")
        mean, speed = float(loss_sum) / seen, seen / (time.time() - e0)
        learner.throughput[-1].append(speed)
        grew = mean > 100 * first  # orders of magnitude above the task's first batch: diverging
        if grew:
            learner.warnings.append(f"task {t + 1} epoch {epoch + 1}: the loss grew to {mean:.3g} "
                                    f"from {first:.3g}; these numbers are not a valid run")
        progress.log(f"{where} epoch {epoch + 1}/{cfg.epochs}  loss {mean:.4f}  train acc "
                     f"{100.0 * float(correct) / seen:5.2f}%  {speed:7.1f} img/s  ETA "
                     f"{progress.eta() / 60:.1f} min" + ("  WARNING: the loss is diverging; lower "
                                                          "--lr" if grew else ""))


@torch.no_grad()
def end_task(learner, t, tasks, splits, cfg):
    """Task t's end: its violation, class prototypes, the memory's update, the LoRA merge.
    Returns the task's factors (A, B) per layer, from before the merge."""
    model, device = learner.model, learner.prototypes.device
    for name in ("k", "v"):
        learner.violation[name].append([violation(layer) for _, n, layer in model.lora_layers()
                                        if n == name])
    loader = data.make_loader(data.subset(splits.train_eval, tasks[t]), cfg.batch_size, False,
                              cfg.workers, 0, device)
    new = class_prototypes(*features(model, loader, cfg), tasks[t])
    learner.prototypes = torch.cat([learner.prototypes, new])
    if cfg.oe and cfg.memory == "oe":  # this task's OE basis joins the memory
        learner.subspace.merge()
        learner.memory = list(learner.subspace.memory)
    elif cfg.oe and cfg.memory == "oe-rolling":  # the basis goes on to the next task as it is
        learner.memory = list(learner.subspace.basis)
    elif cfg.oe:  # GPM's offline pass over the task's images, counted in its task_seconds
        C = kv_covariance(model, loader, cfg)
        learner.memory = [gpm_extend(M, C_i, gpm_threshold(cfg, t))
                          for M, C_i in zip(learner.memory, C)]
    set_memories(model, learner.memory)
    factors = [(layer.A.detach().clone(), layer.B.detach().clone())
               for _, _, layer in model.lora_layers()]
    for _, _, layer in model.lora_layers():
        layer.merge_()  # W += s B A, then a fresh pair with A off the new memory
    return factors


def task_sizes(splits, tasks):
    """Per task: its training images, and the evaluation images after it (its prototype pass and
    the test images of the tasks seen by then), for the ETA."""
    count = lambda part: collections.Counter(part.targets)
    train, test = ([sum(n[c] for c in classes) for classes in tasks]
                   for n in (count(splits.train), count(splits.test)))
    return train, [train[t] + sum(test[:t + 1]) for t in range(len(tasks))]


def run_seed(cfg, seed, base_model, splits, save, progress, resume=None):
    """All tasks of one seed; save(snapshot) after each task; returns the seed's results."""
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    learner = start_learner(cfg, seed, base_model, tasks, resume)
    first, log, evaluated = len(learner.acc), progress.log, task_sizes(splits, tasks)[1]
    if resume is not None:
        log(f"seed {seed}: resumed after task {first}")
    for t in range(first, cfg.tasks):
        t0 = time.time()  # a task's time: its training and its method's own passes, not the tests
        start_task(learner, t, tasks, splits, cfg)
        train_task(learner, t, tasks[t], splits, cfg, progress)
        e0 = time.time()
        factors = end_task(learner, t, tasks, splits, cfg)
        learner.task_seconds.append(time.time() - t0)
        current = torch.zeros(splits.num_classes, dtype=torch.bool, device=cfg.device)
        current[tasks[t]] = True
        probe = Probe(factors, cfg.lora_scale, current, cfg.device) if t > 0 else None
        acc, aware, sample = evaluate(learner.model, learner.heads, splits, tasks, cfg, probe)
        progress.done("eval", evaluated[t], time.time() - e0)
        learner.acc.append(acc)
        learner.aware.append(aware)
        learner.sample_acc.append(sample)
        learner.interference.append(probe and probe.interference())
        learner.geometry.append(probe and dml_geometry(torch.cat(probe.z), torch.cat(probe.y),
                                                       learner.prototypes, tasks[t][0]))
        log(f"task {t + 1} accuracy per task: " + " ".join(f"{a:.2f}" for a in acc) +
            f"  | mean {sum(acc) / len(acc):.2f}  | over samples {sample:.2f}  | task-aware mean "
            f"{sum(aware) / len(aware):.2f}  | {learner.task_seconds[-1]:.1f} s")
        if t > 0 and cfg.oe:  # task 1 has no memory to violate
            viol = {n: " ".join(_fmt(v, ".3f") for v in learner.violation[n][-1]) for n in "kv"}
            log(f"task {t + 1} violation ||dW M||/||dW|| per block  K: {viol['k']}  V: {viol['v']}")
        if t > 0:
            g = learner.geometry[-1]
            log(f"task {t + 1} DML geometry: cos_old > 0.5 {g['danger']:.3f}, < 0.2 "
                f"{g['safe']:.3f}, cos_old > cos_own {g['closer_to_old']:.3f}")
        save(learner.snapshot(tasks))
    return learner.results(cfg.tasks)


# ==================================================================================================
# Results, checkpoints, plots, the benchmark, the command line
# ==================================================================================================
def summarize(runs):
    """Mean and std over seeds of ACC, MAA, BWT, and of the same three for task-aware accuracy."""
    def stats(v):  # undefined (None) if any run's is, as BWT with one task
        undefined = any(x is None for x in v)
        return {"mean": None if undefined else statistics.fmean(v),
                "std": None if undefined else statistics.pstdev(v)}
    out = {key: stats([r[key] for r in runs]) for key in ("ACC", "MAA", "BWT")}
    out["sample_ACC"] = stats([r["sample_acc"][-1] for r in runs])  # over the final test samples
    out["task_aware"] = {key: stats([r["task_aware"][key] for r in runs])
                         for key in ("ACC", "MAA", "BWT")}
    return out


def write_json(path, obj):
    tmp = path + ".tmp"  # write, then rename: an interruption never leaves half a file
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _mean(values):
    """The mean of the defined values (None: undefined, left out), or None."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _title(config):
    c = config
    return (f"{c['dataset']}, T={c['tasks']}, {c['method'] or 'custom'}: OE {c['oe']} "
            f"({c['memory']}) GR {c['gr']} ({c['rectify']}) DML {c['dml']}")


def plot_trajectory(plt, results, path):
    """Paper Fig. 5: the mean accuracy over the seen tasks after each task, mean over seeds."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, style, label in (("acc_matrix", "o-", "task-agnostic (the paper's metric)"),
                              ("task_aware", "s--", "task-aware (ours: the true task's head)")):
        curves = torch.tensor([[sum(row[:t + 1]) / (t + 1) for t, row in enumerate(
            r[key] if key == "acc_matrix" else r[key]["acc_matrix"])] for r in results["runs"]])
        x = range(1, curves.shape[1] + 1)
        ax.plot(x, curves.mean(0), style, label=label + f", mean of {len(curves)} seed(s)")
        ax.fill_between(x, curves.min(0).values, curves.max(0).values, alpha=0.2)  # the spread
    ax.set(xlabel="task", ylabel="mean accuracy on the seen tasks (%)", xticks=list(x),
           title=_title(results["config"]))
    ax.title.set_fontsize(8)
    ax.legend(fontsize=8), fig.tight_layout(), fig.savefig(path, dpi=120)


def plot_violation(plt, run, path):
    """Paper Fig. 2 per block (from 1), mean over tasks 2..T: ||dW M|| / ||dW|| against the memory
    and ||X_past dW^T|| / sqrt(n) on the past tasks' test inputs."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    past = {n: [[i["past"][2 * b + j] for b in range(len(i["past"]) // 2)]
                for i in run["interference"] if i] for j, n in enumerate("kv")}
    panels = ((axes[0], run["violation"], "||dW M|| / ||dW|| (against the memory)"),
              (axes[1], past, "||X_past dW^T|| / sqrt(n) (past test inputs)"))
    for ax, measure, ylabel in panels:
        for off, name in ((-0.2, "k"), (0.2, "v")):
            means = [_mean(col) for col in zip(*measure[name])]  # task 1's entries: None
            if all(m is None for m in means):
                continue
            ax.bar([i + 1 + off for i in range(len(means))], [m or 0 for m in means], width=0.4,
                   label=name.upper())
        ax.set(xlabel="block", ylabel=ylabel, title=f"mean over tasks 2..T, seed {run['seed']}")
        if ax.patches:
            ax.set(xticks=range(1, len(means) + 1), ylim=(0, ax.get_ylim()[1] * 1.2))
            ax.legend(ncol=2, loc="upper left")  # above the bars: the 20% headroom
        else:  # no memory (OE off), or a single task: nothing is defined
            ax.text(0.5, 0.5, "undefined: no memory or one task", ha="center",
                    transform=ax.transAxes)
    fig.tight_layout(), fig.savefig(path, dpi=120)


def plot_angular(plt, run, path):
    """Paper Fig. 3 and the appendix's density: the last task's samples, cos_old against cos_own,
    and each task's density of cos_old (DML pushes it below the margin)."""
    tasks = [(t + 1, g) for t, g in enumerate(run["geometry"]) if g]
    if not tasks:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    t, g = tasks[-1]
    left.scatter(g["cos_old"], g["cos_own"], s=6, alpha=0.5)
    left.axvline(0.5, color="red", ls="--", label=f"danger zone > 0.5: {g['danger']:.3f}")
    left.axvline(0.2, color="green", ls=":", label=f"safe < 0.2: {g['safe']:.3f}")
    left.set(xlabel="cos_old: largest similarity to an old prototype",
             ylabel="cos_own: similarity to its own prototype", xlim=(-0.2, 1), ylim=(-0.2, 1),
             title=f"seed {run['seed']}, task {t}'s test samples; cos_old > cos_own: "
                   f"{g['closer_to_old']:.3f}")
    left.legend(fontsize=8)
    for t, g in tasks:
        bins = torch.linspace(-1, 1, len(g["hist"]) + 1)
        right.plot((bins[1:] + bins[:-1]) / 2, g["hist"], label=f"task {t}")
    right.set(xlabel="cos_old", ylabel="share of the task's test samples", xlim=(-0.2, 1),
              title="density of cos_old per task")
    right.legend(fontsize=7), fig.tight_layout(), fig.savefig(path, dpi=120)
    return True


def plot(results, out):
    """trajectory.png, violation.png, angular.png (the first seed's analyses), with matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (results.json has the numbers)")
        return
    plot_trajectory(plt, results, os.path.join(out, "trajectory.png"))
    plot_violation(plt, results["runs"][0], os.path.join(out, "violation.png"))
    if not plot_angular(plt, results["runs"][0], os.path.join(out, "angular.png")):
        print("angular.png not drawn: one task has no old prototypes")
    plt.close("all")


def _bench_variant(cfg, base, change, m, C):
    """One --benchmark variant in a mid-run state: a random memory of m columns per block."""
    vcfg, model, D = Config(**{**asdict(cfg), **change}), copy.deepcopy(base), base.embed_dim
    model.to(cfg.device)
    for block in model.blocks if cfg.compile else []:
        block.compile()
    subspace = OnlineSubspace(D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, cfg.device,
                              blocks=len(model.blocks))
    if vcfg.oe:  # one memory per block, shared by its K and V; V starts off it
        subspace.memory = torch.linalg.qr(torch.randn(len(model.blocks), D, m)).Q.to(cfg.device)
        subspace.basis = subspace._fresh_basis()
        set_memories(model, subspace.memory)
        for _, _, layer in model.lora_layers():
            layer.reset_lora_()
    old = F.normalize(torch.randn(C * (cfg.tasks // 2), D, device=cfg.device), dim=1)
    head = torch.nn.Linear(D, C).to(cfg.device)
    opt = torch.optim.Adam(model.lora_parameters() + list(head.parameters()), lr=cfg.lr)
    return lambda images, y: train_step(model, head, opt, images, y, vcfg, subspace, old)


def _time_loader(cfg):
    """Images/s of the data loader alone, beside the step times: a loader stall shows."""
    try:
        splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size, 0.0, 1.0,
                                   download=False)
    except data.DataError:
        print(f"data loader not timed: no {cfg.dataset} files in {_q(cfg.data_dir)} (--data-dir)")
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


# ==================================================================================================
# --reproduce: every row of a table or figure of the paper, one command, resumable
# ==================================================================================================
# The paper's numbers (mean of 5 seeds; ACC, MAA, BWT), quoted from its LaTeX source, by
# (--reproduce NAME, data set, T): where they are, and per row. None: the paper gives no number.
PAPER = {
    ("ablation", "imagenet-r", 10): ("Table 1", {
        "1": (64.24, 74.68, -21.85), "2": (64.47, 75.81, -24.16), "3": (71.82, 79.28, -10.13),
        "4": (70.20, 78.80, -14.01), "5": (74.39, 80.47, -4.43), "6": (73.61, 80.68, -11.26),
        "7": (75.78, 81.64, -6.05)}),
    ("methods", "imagenet-r", 5): ("Table 2", {
        "finetune": (69.75, 78.93, -17.65), "lora-gpm": (73.96, 81.16, -10.24),
        "inflora": (76.31, 81.64, -6.17), "janus": (77.19, 82.52, -6.71)}),
    ("methods", "imagenet-r", 10): ("Table 2", {
        "finetune": (64.24, 74.68, -21.85), "lora-gpm": (71.56, 79.34, -10.95),
        "inflora": (73.90, 80.01, -6.33), "janus": (75.78, 81.64, -6.05)}),
    ("methods", "imagenet-r", 20): ("Table 2", {
        "finetune": (57.62, 69.86, -25.43), "lora-gpm": (64.06, 73.91, -14.56),
        "inflora": (68.91, 76.24, -7.74), "janus": (71.57, 77.11, -5.77)}),
    ("methods", "cifar100", 10): ("Table 3", {
        "finetune": (83.53, 90.18, -11.47), "lora-gpm": (86.01, 91.31, -5.56),
        "inflora": (86.69, 91.61, -4.61), "janus": (88.68, 92.58, -5.29)}),
    ("methods", "imagenet100", 10): ("Table 3", {
        "finetune": (89.10, 92.95, -6.80), "lora-gpm": (91.53, 94.00, -3.58),
        "inflora": (91.84, 93.94, -2.37), "janus": (92.47, 94.32, -3.24)}),
    ("methods", "domainnet", 5): ("Table 3", {
        "finetune": (69.34, 74.83, -5.14), "lora-gpm": (69.24, 74.84, -5.55),
        "inflora": (72.94, 78.98, -7.38), "janus": (73.82, 79.67, -7.74)}),
    ("oe-vs-gpm", "imagenet-r", 10): ("Table 5", {"gpm": (38.79, 42.48, -5.36),
                                                  "oe": (40.90, 45.93, -5.98)}),
    ("oe-vs-gpm", "cifar100", 10): ("Table 5", {"gpm": (74.84, 83.30, -7.70),
                                                "oe": (77.31, 84.83, -6.27)}),
    ("gr-plugin", "imagenet-r", 10): ("Fig. 6, as printed on the figure", {
        "lora-gpm": (71.89, 79.82, -11.48), "lora-gpm-gr": (74.14, 80.12, -4.55)}),
    ("backbones", "imagenet-r", 10): ("Tables 2 and 4", {
        "in21k": (75.78, 81.64, -6.05), "sam": (70.22, 77.90, -6.47),
        "dino": (68.20, 76.15, -5.73)}),
    ("k", "imagenet-r", 10): ("Sec. 4.2's text", {"k25": (None, None, -7.41),
                                                  "k100": (None, None, -4.14)}),
    ("lambda", "imagenet-r", 10): ("the appendix's text", {"l0.5": (None, None, -5.50),
                                                           "l2.0": (None, None, -6.62)}),
}


def to_argv(cfg, skip=("reproduce", "row", "dry_run", "out", "resume", "method")):
    """The flags that give cfg again: every field that differs from its default."""
    argv = []
    for f in fields(Config):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if f.name in skip or value == f.default or (isinstance(value, list) and
                                                    tuple(value) == f.default):
            continue
        if f.type is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def reproduce(cfg, given):
    """Each row into OUT/<row>/, with the flags given and the row's: a finished row is skipped, an
    interrupted one resumed; then the table of whichever rows have finished."""
    what, rows = REPRODUCE[cfg.reproduce]
    out = cfg.out or os.path.join("runs", f"{cfg.reproduce}-{cfg.dataset}-T{cfg.tasks}")
    print(f"--reproduce {cfg.reproduce}: {what}; {len(rows)} rows into {out}")
    for row in [cfg.row] if cfg.row else rows:
        folder = os.path.join(out, row)
        if not cfg.dry_run and set(cfg.seeds) <= {r["seed"] for r in _row_runs(folder)}:
            print(f"{row}: finished before, skipped")
            continue
        interrupted = os.path.exists(os.path.join(folder, "checkpoint.pt"))  # continues from there
        argv = given + rows[row] + ["--resume" if interrupted else "--out", folder]
        print(f"{row}: python janus_min.py {' '.join(argv)}")
        if cfg.dry_run:
            continue
        code = main(argv)
        if code:
            return code
    return 0 if cfg.dry_run else write_table(cfg, out, rows)


def _row_runs(folder):
    """The finished seeds' runs of a row, from its results.json; none if it has none."""
    try:
        with open(os.path.join(folder, "results.json")) as f:
            return json.load(f)["runs"]
    except (OSError, ValueError, KeyError):
        return []


def _row_summary(runs):
    """A row of table.json: the paper's metrics, ours beside them, time, violation, DML shares."""
    s = summarize(runs)
    stat = lambda key: [s[key]["mean"], s[key]["std"]]
    per_run = lambda f: _mean([f(r) for r in runs])
    return {"ACC": stat("ACC"), "MAA": stat("MAA"), "BWT": stat("BWT"),
            "sample_ACC": stat("sample_ACC"), "aware_ACC": [s["task_aware"]["ACC"]["mean"]],
            "aware_BWT": [s["task_aware"]["BWT"]["mean"]],
            "violation": per_run(lambda r: _mean(sum(r["violation"]["k"] + r["violation"]["v"],
                                                     []))),
            "interference": per_run(lambda r: _mean(sum([i["past"] for i in r["interference"] if i],
                                                        []))),
            "danger": per_run(lambda r: _mean([g["danger"] for g in r["geometry"] if g])),
            "seconds_per_task": per_run(lambda r: _mean(r["task_seconds"]))}


def write_table(cfg, out, rows):
    """table.json and table.md: each finished row's numbers beside the paper's; time.png."""
    source, paper = PAPER.get((cfg.reproduce, cfg.dataset, cfg.tasks), (None, {}))
    table = {"reproduce": cfg.reproduce, "what": REPRODUCE[cfg.reproduce][0],
             "dataset": cfg.dataset, "tasks": cfg.tasks, "paper_source": source, "rows": {},
             "missing": []}
    for row, flags in rows.items():
        runs = _row_runs(os.path.join(out, row))
        if not runs:
            table["missing"].append(row)
            continue
        table["rows"][row] = {"flags": " ".join(flags) or "(none)", "seeds": len(runs),
                              **_row_summary(runs),
                              "paper": dict(zip(("ACC", "MAA", "BWT"), paper.get(row, ())))}
    write_json(os.path.join(out, "table.json"), table)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(_table_md(table))
    plot_time(table, out)
    print(_table_md(table) + f"wrote {os.path.join(out, 'table.md')} and table.json")
    return 0


def _table_md(table):
    pm = lambda v: f"{v[0]:.2f} ± {v[1]:.2f}"
    source = table["paper_source"] or "none for this data set and T"
    paper = f"the paper's ACC / MAA / BWT ({source})"
    lines = [f"# --reproduce {table['reproduce']}: {table['what']}",
             f"{table['dataset']}, T = {table['tasks']}; ours: mean ± std over seeds.", "",
             f"| row | flags | seeds | ACC | MAA | BWT | ACC over samples | task-aware ACC | "
             f"task-aware BWT | violation | interference | danger share | s / task | {paper} |",
             "|" + "---|" * 14]
    for row, r in table["rows"].items():
        quoted = " / ".join(_fmt(r["paper"].get(k), ".2f") for k in ("ACC", "MAA", "BWT"))
        lines.append(f"| {row} | `{r['flags']}` | {r['seeds']} | {pm(r['ACC'])} | {pm(r['MAA'])} | "
                     f"{pm(r['BWT'])} | {pm(r['sample_ACC'])} | {r['aware_ACC'][0]:.2f} | "
                     f"{r['aware_BWT'][0]:.2f} | {_fmt(r['violation'], '.2e')} | "
                     f"{_fmt(r['interference'], '.3f')} | {_fmt(r['danger'], '.3f')} | "
                     f"{r['seconds_per_task']:.1f} | {quoted if r['paper'] else '-'} |")
    if table["missing"]:
        lines += ["", f"Not finished yet: {', '.join(table['missing'])}."]
    return "\n".join(lines) + "\n"


def plot_time(table, out):
    """time.png (the appendix's efficiency figures): per-task and cumulative time per row."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for row in table["rows"]:
        seconds = torch.tensor([r["task_seconds"] for r in _row_runs(os.path.join(out, row))])
        x = range(1, seconds.shape[1] + 1)
        left.plot(x, seconds.mean(0), "o-", label=row)
        right.plot(x, seconds.mean(0).cumsum(0), "o-", label=row)
    left.set(xlabel="task", ylabel="seconds (mean over seeds)", title="time per task")
    right.set(xlabel="task", ylabel="seconds", title="cumulative time")
    left.legend(fontsize=8), fig.tight_layout(), fig.savefig(os.path.join(out, "time.png"), dpi=120)
    plt.close(fig)


# ==================================================================================================
# The run's folder: resume, checkpoint, lock, interruption, summary, the command line
# ==================================================================================================
RESUME_FREE = ("out", "resume", "device", "workers", "compile")  # may change on --resume
CHECKPOINT_FORMAT = 4  # raised whenever checkpoint.pt's content changes: old files are refused


def _q(path):
    """A path as one shell word, so that a suggested command can be pasted as it is."""
    return shlex.quote(str(path))


def check_folder(folder, flag):
    """Refuse now, before any data or model loads, a run folder that cannot be made or written."""
    _require(folder != "", f"{flag} \"\": name a folder")
    nearest = os.path.abspath(folder)
    while not os.path.exists(nearest):  # the deepest part that exists: where the rest is made
        nearest = os.path.dirname(nearest)
    _require(os.path.isdir(nearest), f"{flag} {_q(folder)}: {_q(nearest)} is a file, not a "
             f"folder; choose another {flag}")
    _require(os.access(nearest, os.W_OK | os.X_OK), f"{flag} {_q(folder)}: {_q(nearest)} cannot "
             "be written (read-only); choose a folder you can write")


def read_checkpoint(folder):
    """checkpoint.pt of a run folder, checked: there, readable, ours and of this version."""
    path = os.path.join(folder, "checkpoint.pt")
    if not os.path.isfile(path) and os.path.isfile(os.path.join(folder, "results.json")):
        raise ConfigError(f"--resume {_q(folder)}: its results.json stays as it is, but without "
                          "checkpoint.pt nothing there can be continued; start a new run with "
                          "--out ANOTHER_FOLDER")
    _require(os.path.isfile(path), f"--resume {_q(folder)}: no checkpoint.pt there (a run saves "
             "one after its first task); start the run again with --out")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data
    except Exception as e:  # unreadable for whatever reason: the user's to replace
        raise ConfigError(f"--resume {_q(folder)}: checkpoint.pt cannot be read "
                          f"({type(e).__name__}); remove the folder and start again") from None
    _require(isinstance(ckpt, dict) and ckpt.get("format") == CHECKPOINT_FORMAT,
             f"--resume {_q(folder)}: checkpoint.pt was written by another version of janus_min.py"
             " (or is not ours); finish that run with the version that wrote it, or start again")
    return ckpt


def resume_config(cfg, given):
    """--resume DIR: the configuration saved in DIR, which flags typed now must agree with (but
    device, workers, compile; and seeds may be added), and the checkpoint."""
    folder = cfg.resume
    if os.path.basename(os.path.normpath(folder)) == "checkpoint.pt":  # the file for its folder
        folder = os.path.dirname(os.path.normpath(folder)) or "."
    ckpt = read_checkpoint(folder)
    saved = ckpt["config"]
    clash = [k for k, v in given.items() if k not in RESUME_FREE + ("seeds",) and v != saved[k]]
    _require(not clash, f"--resume {_q(folder)}: the run there has " + ", ".join(
        f"--{k.replace('_', '-')} {saved[k]}" for k in clash) + "; drop those flags (--resume "
        "alone continues it) or start a new run with --out")
    seeds = list(given.get("seeds", saved["seeds"]))
    _require(set(seeds) >= set(saved["seeds"]), f"--resume {_q(folder)}: its seeds are "
             f"{' '.join(map(str, saved['seeds']))}; give those (and more, to add seeds) or none")
    free = {k: given.get(k, cfg_default) for k, cfg_default in
            (("device", "auto"), ("workers", cfg.workers), ("compile", saved["compile"]))}
    return Config(**{**saved, **free, "seeds": seeds, "out": folder, "resume": folder}), ckpt


def save_checkpoint(out, cfg, runs, current):
    """checkpoint.pt, written then renamed: Ctrl-C during the save leaves the last one intact."""
    tmp = os.path.join(out, "checkpoint.pt.tmp")
    torch.save({"format": CHECKPOINT_FORMAT, "config": asdict(cfg), "runs": runs,
                "current": current}, tmp)
    os.replace(tmp, os.path.join(out, "checkpoint.pt"))


class RunLock:
    """DIR/run.lock while a run writes to DIR: a second run refuses; a lock whose process has gone
    (a crash, kill -9) is taken over."""

    def __init__(self, folder):
        self.path = os.path.join(folder, "run.lock")
        self.me = f"{os.getpid()} {socket.gethostname()}"

    def acquire(self):
        for _ in range(2):
            try:
                with open(self.path, "x") as f:  # created only if absent: one winner
                    f.write(self.me)
                return
            except FileExistsError:
                with open(self.path) as f:
                    pid, host = (f.read().split() + ["0", ""])[:2]
                _require(host == socket.gethostname() and not _alive(int(pid)),
                         f"{_q(os.path.dirname(self.path))} is in use by the run of process {pid} "
                         f"on {host}; wait for it or choose another --out (if no run writes there "
                         f"any more, delete {_q(self.path)})")
                os.remove(self.path)  # its process is gone: a stale lock
        raise ConfigError(f"{_q(self.path)}: two runs are starting in one folder; start one")

    def release(self):
        os.remove(self.path)


def _alive(pid):
    if pid <= 0:  # no process of ours: a damaged lock
        return False
    try:
        os.kill(pid, 0)  # no signal: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class Stopped(Exception):
    """SIGTERM, as cluster schedulers send it: handled as Ctrl-C is."""


def _on_sigterm(signum, frame):
    raise Stopped


def environment(cfg):
    """What results.json needs to say where its numbers come from."""
    import torchvision  # noqa: PLC0415 -- its version only
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or None  # none outside a git checkout
    except OSError:  # no git on this machine
        git = None
    return {"torch": torch.__version__, "torchvision": torchvision.__version__,
            "device": torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda")
            else f"cpu ({torch.get_num_threads()} threads)",
            "git_commit": git}


def prepare(cfg):
    """Everything that can fail on bad input, before the output folder is touched."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = cfg.resume or (os.path.join("runs", f"{cfg.dataset}-{stamp}") if cfg.out is None
                         else cfg.out)
    check_folder(out, "--resume" if cfg.resume else "--out")
    _require(cfg.resume or not any(os.path.exists(os.path.join(out, f))
                                   for f in ("checkpoint.pt", "results.json")),
             f"{_q(out)} already holds a run; continue it with --resume {_q(out)} or choose another"
             " --out")
    scale = cfg.input_range
    if scale == "checkpoint":
        scale = vit.PRETRAINED_INPUT[cfg.weights]
    mean_std = vit.MEAN_STD.get(scale, (0.0, 1.0))  # unit: ToTensor's [0, 1] as it is
    splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size, *mean_std, seed=0,
                               limit_per_class=cfg.limit_per_class)
    width = vit.PRESETS[cfg.model].keywords["embed_dim"]
    if cfg.oe and cfg.memory == "oe" and cfg.k * (cfg.tasks - 1) >= width:  # the reader should know
        full = -(-width // cfg.k)
        print(f"note: k x (T - 1) = {cfg.k * (cfg.tasks - 1)} reaches the block width {width}: the "
              f"memory is full after task {full} and K/V learn nothing from task {full + 1} on")
    cfg.out = out  # results.json's config names the folder, after a resume too
    return out, splits, build_model(cfg)  # the backbone: loaded once, copied per seed


def print_summary(results, log):
    last, s, T = results["runs"][-1], results["summary"], len(results["runs"][-1]["acc_matrix"])
    log(f"accuracy (%) on each task (columns) after each task (rows), seed {last['seed']}:")
    log("after task | " + " ".join(f"task {i + 1:<2d}" for i in range(T)))
    for t, row in enumerate(last["acc_matrix"]):
        log(f"{t + 1:10d} | " + " ".join(f"{'-' if a is None else f'{a:.1f}':>7s}" for a in row))
    stat = lambda v: "undefined" if v["mean"] is None else f"{v['mean']:.2f} +- {v['std']:.2f}"
    log("  ".join(f"{k} {stat(s[k])}" for k in ("ACC", "MAA", "BWT", "sample_ACC")) +
        f"  over {len(results['runs'])} seed(s); task-aware: ACC {stat(s['task_aware']['ACC'])}"
        f"  BWT {stat(s['task_aware']['BWT'])}")
    log("ACC: mean accuracy over the tasks after the last; MAA: mean over tasks of the accuracy on "
        "the tasks seen so far; BWT: mean change of a task's accuracy from right after it to the "
        "end (negative: forgetting); sample_ACC: ACC over all test samples (InfLoRA's logs); "
        "task-aware (ours): the argmax over the true task's head only")
    log(f"time per task (s): {' '.join(f'{x:.1f}' for x in last['task_seconds'])}; total "
        f"{sum(last['task_seconds']):.1f} s")
    for run in results["runs"]:
        for warning in run["warnings"]:
            log(f"WARNING (seed {run['seed']}): {warning}")


def load_run(folder, device="cpu"):
    """(cfg, Learner) of the state checkpoint.pt holds: a finished run's final model (merged K and V
    weights, heads, prototypes, memories). The rest of the backbone comes from cfg.weights."""
    ckpt = read_checkpoint(folder)
    cfg = Config(**{**ckpt["config"], "device": device})
    tasks = data.task_classes(data.DATASETS[cfg.dataset]["num_classes"], cfg.tasks)
    state = ckpt["current"]
    return cfg, start_learner(cfg, state["seed"], build_model(cfg), tasks, state)


def run_all(cfg, ckpt, out, splits, base_model, progress):
    """Every seed not finished yet; checkpoint.pt after each task, results.json after each seed."""
    results = {"config": asdict(cfg), "environment": environment(cfg),
               "runs": ckpt["runs"] if ckpt else []}
    todo = [s for s in cfg.seeds if all(r["seed"] != s for r in results["runs"])]
    current = ckpt["current"] if ckpt else None
    first = len(current["acc"]) if current and todo and current["seed"] == todo[0] else 0
    train, evaluated = task_sizes(splits, data.task_classes(splits.num_classes, cfg.tasks))
    progress.plan(sum(train) * cfg.epochs * len(todo) - sum(train[:first]) * cfg.epochs,
                  sum(evaluated) * len(todo) - sum(evaluated[:first]))
    for seed in todo:
        state = {"current": current if current and current["seed"] == seed else None}

        def save(snapshot):  # after each task; a finished run keeps its final state
            state["current"] = snapshot
            save_checkpoint(out, cfg, results["runs"], snapshot)
        results["runs"].append(run_seed(cfg, seed, base_model, splits, save, progress,
                                        state["current"]))
        save_checkpoint(out, cfg, results["runs"], state["current"])
        results["summary"] = summarize(results["runs"])  # after every seed: keep the others
        write_json(os.path.join(out, "results.json"), results)
    if "summary" not in results:  # --resume of a run whose seeds had all finished
        results["summary"] = summarize(results["runs"])
        write_json(os.path.join(out, "results.json"), results)
    return results


def _interrupted(out, signal_name, code):
    saved = os.path.exists(os.path.join(out, "checkpoint.pt"))
    print(f"\ninterrupted ({signal_name}): " + (
        f"{_q(out)}/checkpoint.pt holds the tasks finished so far; continue with: python "
        f"janus_min.py --resume {_q(out)}" if saved else
        "no task had finished, so nothing was saved; start the run again"), flush=True)
    return code


def main(argv=None):
    cfg = parse_args(argv)
    given = to_argv(cfg)  # the flags as given, before the data set's defaults fill the rest
    ckpt = None
    try:
        if cfg.resume and not cfg.reproduce:
            cfg, ckpt = resume_config(cfg, parse_args(argv, given_only=True))
        cfg = check_config(cfg)
        if cfg.benchmark:
            return benchmark(cfg)
        if cfg.reproduce:
            return reproduce(cfg, given)
        out, splits, base_model = prepare(cfg)
        os.makedirs(out, exist_ok=True)
        lock = RunLock(out)
        lock.acquire()
    except (ConfigError, vit.CheckpointError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    progress = Progress(out)
    progress.log(f"{cfg.dataset}: {len(splits.train)} training / {len(splits.test)} test images, "
                 f"{splits.num_classes} classes, {cfg.tasks} tasks; {cfg.method or 'custom'}: OE "
                 f"{cfg.oe} ({cfg.memory}) GR {cfg.gr} ({cfg.rectify}) DML {cfg.dml}; device "
                 f"{cfg.device}; out {_q(out)}")
    try:
        results = run_all(cfg, ckpt, out, splits, base_model, progress)
    except KeyboardInterrupt:
        return _interrupted(out, "Ctrl-C", 130)
    except Stopped:
        return _interrupted(out, "SIGTERM", 143)
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
        lock.release()
        progress.close()
    print_summary(results, print)
    plot(results, out)
    print(f"wrote {_q(os.path.join(out, 'results.json'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
