"""Janus-LoRA, minimal: the method, the class-incremental task loop, metrics and the command line.

Janus-LoRA (ICML 2026) keeps a frozen ViT-B/16 and trains LoRA factors on K and V, one pair per task,
merged at the task's end. Three pieces, named as in the paper's Sec. 3:
  * Online Estimation (OE, Eqs. (8)-(10)): per block, an orthonormal basis V of the current task's
    activations, learned on the Stiefel manifold by one projected gradient step and a QR retraction per
    batch; at the end of a task V joins the protected memory M.
  * The safe gradient (Theorem 1, Eq. (3)) G (I - M M^T) and Gradient Rectification (GR, Eqs. (5)-(7)):
    closed-form factor gradients whose composite s (B dA + dB A) best matches it.
  * The Decoupled Margin Loss (DML, Eq. (11)): a prototype cross-entropy over the current classes plus a
    hinge that pushes features away from the stored prototypes of old classes.
GR acts where the paper puts it, on the gradients that Adam takes (`--rectify grad`), or, our variant, on
the step Adam proposes, split between A and B with the least norm (`--rectify update`).
Equations are numbered as in the paper's LaTeX source. Our reading of the paper where it is silent is in
the README ("Where the paper is silent").
References: C. Chen et al., "JANUS-LoRA: A Balanced Low-Rank Adaptation for Continual Learning", ICML 2026;
InfLoRA (Liang & Li, CVPR 2024) for the protocol; LoRA-Pro (Wang et al., ICLR 2025) for the
tangent-space view of GR.
"""
import argparse
import copy
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F

import data
import vit


# ---------------------------------------------------------------------------------------------------
# Theorem 1 and Gradient Rectification
# ---------------------------------------------------------------------------------------------------
def safe_gradient(G, M):
    """G (d_out x d_in), M (d_in x m) orthonormal -> G (I - M M^T); an empty M returns G."""
    if M.shape[1] == 0:
        return G
    return G - (G @ M) @ M.T  # Janus-LoRA Theorem 1, Eq. (3), without forming I - M M^T


def _ridge(S, delta):
    """S + delta' I for a small Gram matrix S (GR's B^T B and A A^T, OE's energies), delta' = delta * mean
    eigenvalue of S.

    Relative, not absolute: B^T B and A A^T scale with the factors' magnitude, which grows from 0 over a
    task, and a relative ridge keeps GR covariant under B -> cB (dA -> dA / c). The floor `tiny` keeps
    the solve finite for S = 0 (B = 0 at every task's first step), where the right-hand side is exactly 0."""
    lam = delta * S.diagonal().mean() + torch.finfo(S.dtype).tiny
    return S + lam * torch.eye(S.shape[0], dtype=S.dtype, device=S.device)


def rectify_factors(BtG, GAt, A, B, scale, delta=1e-4):
    """Gradient Rectification from the two thin products it needs: BtG = B^T G_safe (r x d_in) and
    GAt = G_safe A^T (d_out x r). Never forms a d_out x d_in matrix. Returns (dA, dB)."""
    dA = torch.linalg.solve(_ridge(B.T @ B, delta), BtG) / scale  # Janus-LoRA Eq. (6)
    RAt = GAt - scale * B @ (dA @ A.T)  # R A^T with the residual R = G_safe - s B dA
    dB = torch.linalg.solve(_ridge(A @ A.T, delta), RAt.T).T / scale  # Eq. (7); A A^T symmetric
    return dA, dB


def rectify(G_safe, A, B, scale, delta=1e-4):
    """Closed-form GR for a dense target G_safe (d_out x d_in): (grad_A, grad_B) such that
    s (B grad_A + grad_B A) is the least-squares match of G_safe (Eq. (5)). With delta -> 0
    this is the projection onto the tangent space of rank-r matrices at BA: P_B G + G P_A - P_B G P_A."""
    return rectify_factors(B.T @ G_safe, G_safe @ A.T, A, B, scale, delta)


def rectify_gradients_(layers, delta):
    """`--rectify grad` (the paper): replace each LoRA pair's gradients by GR's before Adam sees them.
    The LoRA forward routes the part of A inside span(M) through detached copies (vit.LoRALinear), so
    autograd already returns gA = s B^T G_safe and gB = s G_safe A^T: GR needs nothing else."""
    for layer in layers:
        A, B, s = layer.A, layer.B, layer.scale
        dA, dB = rectify_factors(A.grad / s, B.grad / s, A.detach(), B.detach(), s, delta)
        A.grad.copy_(dA)
        B.grad.copy_(dB)


def least_norm_split(dA, dB, A, B):
    """Of all factor steps with the composite B dA + dB A of (dA, dB), the one of least ||dA||^2 + ||dB||^2 (ours).

    They differ by (C A, -B C) for an r x r matrix C. The best C solves the Sylvester equation
    (B^T B) C + C (A A^T) = B^T dB - dA A^T, which is diagonal in the eigenbases of the two Gram matrices.
    Why: GR's hierarchical split (Eqs. (6)-(7)) gives dA all of G_safe's part in col(B). While B is small, as
    at every task's start, a B-sized step then doubles A, and A ends up orders of magnitude larger than B."""
    lam, U = torch.linalg.eigh(B.T @ B)  # (r,), (r, r)
    sig, W = torch.linalg.eigh(A @ A.T)
    den = lam[:, None] + sig[None, :]  # (r, r), >= 0: the Sylvester operator in those eigenbases
    rhs = U.T @ (B.T @ dB - dA @ A.T) @ W
    ok = den > den.max() * den.shape[0] * torch.finfo(den.dtype).eps  # zero where it is singular (B = A = 0)
    C = U @ torch.where(ok, rhs / torch.where(ok, den, 1), 0) @ W.T
    return dA + C @ A, dB - B @ C


@torch.no_grad()
def rectify_updates_(layers, before, delta):
    """`--rectify update` (ours; README, "--rectify grad and update"): Adam's per-coordinate scaling does not keep
    a rectified gradient in the safe set, so rectify the step Adam proposed instead. The first-order
    composite step dW = s (B dA + dB A) is projected by Theorem 1 and rectified; only r-wide products
    are formed. The rectified step is split between A and B with the least norm, which keeps the two
    factors of comparable size. `before` holds each layer's (A, B) from before `optimizer.step()`."""
    for layer, (A0, B0) in zip(layers, before):
        M, s = layer.memory, layer.scale
        dA, dB = layer.A - A0, layer.B - B0  # Adam's proposed step
        # B^T dW_safe = s (B^T B dA + B^T dB A)(I - M M^T)  and  dW_safe A^T = s (B dA + dB A)(I - M M^T) A^T
        BtW = safe_gradient(s * ((B0.T @ B0) @ dA + (B0.T @ dB) @ A0), M)
        Ap = safe_gradient(A0, M).T  # (I - M M^T) A^T  (d_in x r)
        WAt = s * (B0 @ (dA @ Ap) + dB @ (A0 @ Ap))
        rA, rB = least_norm_split(*rectify_factors(BtW, WAt, A0, B0, s, delta), A0, B0)
        layer.A.copy_(A0 + rA)
        layer.B.copy_(B0 + rB)


@torch.no_grad()
def violation(layer):
    """Relative null-space violation ||dW M||_F / ||dW||_F of the layer's task update dW = s B A
    (the paper's null-space violation figure, Fig. 2), from r x r products only: ||B A||_F^2 = tr((B^T B)(A A^T))."""
    A, B, M = layer.A, layer.B, layer.memory
    if M.shape[1] == 0:
        return 0.0
    num = (B @ (A @ M)).norm()
    den = ((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt()
    return float(num / den) if den > 0 else 0.0


# ---------------------------------------------------------------------------------------------------
# Online Estimation on the Stiefel manifold
# ---------------------------------------------------------------------------------------------------
def _columns_off(V, M):
    """(I - M M^T) V: the columns of V (dim x k) with their components in span(M) removed."""
    return V - M @ (M.T @ V)


class OnlineSubspace:
    """Per-block basis V (dim x k) of the current task's activations, learned online, and the protected
    memory M (dim x m) of all finished tasks. V is kept orthogonal to M (the projection during a task
    uses M only: projecting out V, the task's own subspace, would remove most of its gradient)."""

    def __init__(self, dim, k, lr=1.0, decay_steps=5, device=None):
        self.dim, self.k, self.lr, self.decay_steps = dim, k, lr, decay_steps
        self.memory = torch.zeros(dim, 0, device=device)
        self.basis = self._fresh_basis()
        self.steps = 0

    def _fresh_basis(self):
        # Room left beside the memory: once M spans the whole width, nothing is left to protect or learn.
        k = min(self.k, self.dim - self.memory.shape[1])
        # Drawn on the CPU, so that a run's random numbers do not depend on the device.
        V = _columns_off(torch.randn(self.dim, k).to(self.memory.device), self.memory)
        return torch.linalg.qr(V).Q

    @torch.no_grad()
    def update(self, X):
        """One step on (1/2)||X_p - X_p V V^T||_F^2 with X_p = X (I - M M^T), X (n x dim) any dtype."""
        V, M = self.basis, self.memory
        if V.shape[1] == 0:
            return
        X = X.float()
        XV = X @ V  # (n, k); equals X_p V because V is orthogonal to M
        CV = _columns_off(X.T @ XV, M)  # X_p^T X_p V = (I - M M^T) X^T X V   (dim, k)
        grad = -(CV - V @ (V.T @ CV))  # Euclidean gradient of Eq. (8) at an orthonormal V
        # The step is preconditioned by S^-1, where S = (XV)^T XV is the energy each basis direction captures
        # (k x k). That makes it scale-free (X -> cX changes nothing), and a unit step is then one step of
        # subspace iteration, span(V - grad S^-1) = span(X_p^T X_p V), however unevenly the energy is spread.
        # (A scalar step cannot be right for every direction: ViT activations have one direction with most
        # of the energy, and a step sized for the others overshoots it.)
        S = _ridge(XV.T @ XV, 1e-6)  # the ridge only keeps a direction that sees no energy finite
        # Harmonic decay: large early steps converge within an epoch; the decay averages out the batches'
        # noise, which a constant step leaves as a floor (as Oja's rule does). decay_steps = 5 from a sweep
        # on planted spectra (test_oe_converges_to_the_planted_subspace, gaps 3 and 10).
        lr = self.lr * self.decay_steps / (self.decay_steps + self.steps)
        V_tilde = V - lr * torch.linalg.solve(S, grad.T).T  # Eq. (9), preconditioned: grad S^-1 (S symmetric)
        Q, R = torch.linalg.qr(V_tilde)  # Eq. (10)
        signs = torch.diagonal(R).sign()
        V = Q * torch.where(signs == 0, 1.0, signs)  # fix R's diagonal positive, so that V does not flip
        self.basis = _columns_off(V, M)  # re-project: round-off must not leak V into span(M)
        self.steps += 1

    @torch.no_grad()
    def merge(self):
        """End of a task: M <- orth([M, V]); a fresh V orthogonal to the new memory."""
        self.memory = torch.linalg.qr(torch.cat([self.memory, self.basis], dim=1)).Q
        self.basis = self._fresh_basis()
        self.steps = 0

    def state_dict(self):
        return {"memory": self.memory, "basis": self.basis, "steps": self.steps}

    def load_state_dict(self, state):
        self.memory, self.basis, self.steps = state["memory"], state["basis"], state["steps"]


# ---------------------------------------------------------------------------------------------------
# Decoupled Margin Loss and metrics
# ---------------------------------------------------------------------------------------------------
def dml_loss(z, y, old_prototypes, margin=0.3, tau=0.07):
    """Janus-LoRA Eq. (11), the DML. z (B, D) features, y (B,) labels of the current task, old_prototypes (P, D)
    unit rows (P may be 0). Current prototypes: the normalised class means of the batch."""
    z = F.normalize(z.float(), dim=1)
    classes, y_idx = torch.unique(y, return_inverse=True)  # the current classes present in the batch
    protos = torch.zeros(len(classes), z.shape[1], device=z.device).index_add(0, y_idx, z)
    protos = F.normalize(protos, dim=1)  # (C_b, D)
    intra = F.cross_entropy(z @ protos.T / tau, y_idx)  # intra-task term: softmax over C_t of z.p_c / tau
    if old_prototypes.shape[0] == 0:
        return intra
    inter = F.relu(z @ old_prototypes.T - margin).mean()  # inter-task hinge, mean over batch x old prototypes
    return intra + inter


def metrics(acc):
    """acc[t][i]: accuracy (%) on task i after training task t (only i <= t is read).
    ACC = mean_i A[T][i]; MAA = mean_t mean_{i<=t} A[t][i]; BWT = mean_{i<T} (A[T][i] - A[i][i])."""
    T = len(acc)
    last = [acc[T - 1][i] for i in range(T)]
    maa = sum(sum(acc[t][: t + 1]) / (t + 1) for t in range(T)) / T
    bwt = sum(acc[T - 1][i] - acc[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else 0.0
    return {"ACC": sum(last) / T, "MAA": maa, "BWT": bwt}


# ---------------------------------------------------------------------------------------------------
# Configuration: one dataclass; every field is a command-line flag (help = meaning and source)
# ---------------------------------------------------------------------------------------------------
def _opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Config:
    dataset: str = _opt("cifar100", "data set (paper Sec. 4.1; protocol of the InfLoRA codebase)", choices=sorted(data.DATASETS))
    data_dir: str = _opt("data", "folder that holds (or receives) the data set")
    tasks: int = _opt(None, "number of tasks T (default: the protocol's, e.g. 10 for CIFAR-100; paper Sec. 4.1)")
    epochs: int = _opt(None, "epochs per task (default: CIFAR-100 20, ImageNet-R 50, DomainNet 5; paper Sec. 4.1)")
    batch_size: int = _opt(None, "batch size (default: 128, paper Sec. 4.1; synthetic 16)")
    lr: float = _opt(5e-4, "Adam learning rate, cosine-annealed per task (InfLoRA codebase)")
    model: str = _opt("vit_base", "backbone (paper: ViT-B/16)", choices=["vit_base", "vit_small", "vit_tiny"])
    weights: str = _opt("in21k", "in21k (paper), sam, dino (paper Table 4), torchvision, none, or a checkpoint file")
    img_size: int = _opt(None, "input resolution (default: 224, the paper's; synthetic 64)")
    patch_size: int = _opt(16, "patch size (paper: 16); free only with --weights none")
    rank: int = _opt(10, "LoRA rank r on K and V (paper Sec. 4.1)")
    lora_scale: float = _opt(1.0, "LoRA scale s (ours; the paper does not give it)")
    k: int = _opt(50, "rank of the OE basis V per block and task (paper Sec. 4.1)")
    oe_lr: float = _opt(1.0, "OE step size at a task's start; 1 is a step of subspace iteration (ours; "
                        "scale-free, see OnlineSubspace)")
    oe_decay_steps: int = _opt(5, "OE step halves after this many steps, then decays as 1/t (ours)")
    delta: float = _opt(1e-4, "GR ridge delta, relative to the mean eigenvalue of B^T B or A A^T (ours)")
    margin: float = _opt(0.3, "DML margin m (paper Sec. 4.1)")
    lambda_dml: float = _opt(1.0, "DML weight lambda (paper Eq. (12), Sec. 4.1)")
    tau: float = _opt(0.07, "DML temperature tau (paper Sec. 4.1, after CLIP)")
    oe: bool = _opt(True, "Online Estimation and the safe gradient (paper Table 1, the ablation)")
    gr: bool = _opt(True, "Gradient Rectification (paper Table 1, the ablation)")
    dml: bool = _opt(True, "Decoupled Margin Loss (paper Table 1, the ablation)")
    rectify: str = _opt("grad", "grad: rectified gradients go to Adam (paper); update: rectify the step Adam "
                        "proposes and split it between A and B with the least norm (ours)",
                        choices=["grad", "update"])
    input_range: str = _opt("unit", "unit: images in [0, 1] as the InfLoRA codebase feeds them (paper); checkpoint: "
                            "the normalisation a named --weights was trained with; half: [-1, 1] (Google's npz files); "
                            "imagenet: ImageNet mean and std (DINO, torchvision)",
                            choices=["unit", "checkpoint", "half", "imagenet"])
    seeds: list = _opt((0,), "seeds; several give mean +- std (paper: 5 seeds)", nargs="+", type=int)
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    workers: int = _opt(min(8, os.cpu_count() or 1), "data loader workers (default: the cores, at most 8)")
    limit_per_class: int = _opt(None, "keep at most this many training images per class (quick runs)")
    out: str = _opt(None, "output folder (default runs/<dataset>-<time>)")
    resume: str = _opt(None, "continue the run in this folder from its last finished task (same flags)")
    benchmark: bool = _opt(False, "time training steps of plain LoRA and Janus on generated inputs, then exit",
                           action="store_true")
    steps: int = _opt(20, "--benchmark: timed steps per variant (after 3 warm-up steps)")


class ConfigError(Exception):
    """An impossible combination of flags."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message}; see python janus_min.py --help\n")


def parse_args(argv=None):
    p = _Parser(description="Janus-LoRA (ICML 2026): class-incremental learning with a frozen "
                                "ViT and LoRA, made stable by OE + GR and plastic by DML.")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        if f.type is bool and f.default is False:
            p.add_argument(flag, **meta)
        elif f.type is bool:
            p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                           help="turn off " + meta["help"] + " (on by default)")
        else:
            meta.setdefault("type", {"int": int, "float": float}.get(getattr(f.type, "__name__", f.type), str))
            if f.default is not None and "default" not in meta["help"]:  # None: the help says what applies
                shown = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
                meta["help"] += f" (default: {shown})"
            p.add_argument(flag, default=f.default, **meta)
    return Config(**vars(p.parse_args(argv)))


def check_config(cfg):
    """Fill the dataset defaults and refuse impossible values with a message that says what to do."""
    info = data.DATASETS[cfg.dataset]
    for key in ("tasks", "epochs", "batch_size", "img_size"):
        if getattr(cfg, key) is None:
            setattr(cfg, key, info[key])
    width = {"vit_base": 768, "vit_small": 384, "vit_tiny": 192}[cfg.model]
    cfg.seeds = list(cfg.seeds)  # the default is a tuple, a typed --seeds a list: one form, for --resume's check
    floats = [f.name for f in fields(Config) if f.type is float]
    checks = [(all(math.isfinite(getattr(cfg, n)) for n in floats),
               "--" + ", --".join(n.replace("_", "-") for n in floats) + " must be finite numbers"),
              (all(0 <= s < 2**63 for s in cfg.seeds), "--seeds must lie in 0 .. 2^63 - 1"),
              (cfg.img_size >= 1 and cfg.patch_size >= 1, "--img-size and --patch-size must be at least 1"),
              (cfg.out is None or not os.path.exists(cfg.out) or os.path.isdir(cfg.out),
               f"--out {cfg.out} is a file, not a folder; choose another --out"),
              (cfg.tasks >= 1 and info["num_classes"] % cfg.tasks == 0,
               f"--tasks {cfg.tasks} does not divide the {info['num_classes']} classes of {cfg.dataset}"),
              (cfg.epochs >= 1, "--epochs must be at least 1"), (cfg.batch_size >= 1, "--batch-size must be at least 1"),
              (cfg.rank >= 1, "--rank must be at least 1"),
              (1 <= cfg.k <= width, f"--k must lie in 1..{width} (the block width of {cfg.model})"),
              (cfg.lr >= 0 and cfg.margin >= 0 and cfg.lambda_dml >= 0, "--lr, --margin and --lambda-dml must not be negative"),
              (cfg.tau > 0, "--tau must be positive"), (cfg.lora_scale > 0, "--lora-scale must be positive"),
              (cfg.weights == "none" or cfg.patch_size == 16,
               "--patch-size other than 16 needs --weights none (the checkpoints are ViT-*/16)"),
              (cfg.patch_size < 1 or cfg.img_size % cfg.patch_size == 0, "--img-size must be a multiple of --patch-size"),
              (cfg.input_range != "checkpoint" or cfg.weights in vit.PRETRAINED_INPUT,
               "--input-range checkpoint needs a named --weights; a file does not say how it was normalised: "
               "pass --input-range half (Google npz files) or imagenet (DINO, torchvision)"),
              (cfg.limit_per_class is None or cfg.limit_per_class >= 1, "--limit-per-class must be at least 1"),
              (cfg.workers >= 0, "--workers must not be negative"),
              (cfg.delta > 0 and cfg.oe_lr > 0 and cfg.oe_decay_steps >= 1 and cfg.steps >= 1,
               "--delta, --oe-lr, --oe-decay-steps and --steps must be positive"),
              (re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device), f"--device {cfg.device}: use auto, cpu, cuda or cuda:N")]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if cfg.oe and cfg.k * (cfg.tasks - 1) >= width:  # allowed, but the reader should know what follows
        print(f"note: k x (T - 1) = {cfg.k * (cfg.tasks - 1)} reaches the block width {width}: the protected memory "
              f"is full after task {-(-width // cfg.k)} and K/V learn nothing from task {-(-width // cfg.k) + 1} on "
              "(README, 'Where the paper is silent')")
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    index = int(cfg.device.partition(":")[2] or 0)
    if cfg.device.startswith("cuda") and index >= torch.cuda.device_count():
        raise ConfigError(f"--device {cfg.device} asked for, but torch sees {torch.cuda.device_count()} GPU(s); "
                          "use --device cpu or an index below that")
    return cfg


# ---------------------------------------------------------------------------------------------------
# The class-incremental task loop
# ---------------------------------------------------------------------------------------------------
def build_model(cfg):
    make = {"vit_base": vit.vit_base_patch16, "vit_small": vit.vit_small_patch16, "vit_tiny": vit.vit_tiny_patch16}
    torch.manual_seed(0)  # with --weights none the random backbone plays the checkpoint: the same for every seed
    model = make[cfg.model](img_size=cfg.img_size, patch_size=cfg.patch_size, lora_rank=cfg.rank,
                            lora_scale=cfg.lora_scale)
    vit.load_pretrained(model, cfg.weights)
    return model.eval()  # for good: the ViT has no dropout, and training never switches modes


def train_step(model, head, opt, images, y, cfg, subspaces, prototypes):
    """One step of Sec. 3 "The integrated Janus-LoRA update process". y: labels local to the task.
    Returns (loss, number correct). The backbone runs under bf16 autocast on CUDA; the OE and GR
    arithmetic runs outside it in float32."""
    layers = [layer for _, _, layer in model.lora_layers()]
    with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=images.device.type == "cuda"):
        if cfg.oe:
            z, kv_inputs = model.encode(images)  # kv_inputs[i]: block i's K/V input (B, N, D)
        else:
            z = model(images)
    z = z.float()
    logits = head(z)
    loss = F.cross_entropy(logits, y)  # L_task: the current task's head only (InfLoRA protocol)
    if cfg.dml:
        loss = loss + cfg.lambda_dml * dml_loss(z, y, prototypes, cfg.margin, cfg.tau)  # Eq. (12)
    if cfg.oe:  # OE before backward, so the activations are released before the backward pass peaks
        for sub, X in zip(subspaces, kv_inputs):
            sub.update(X.detach().flatten(0, 1))  # (B, N, D) -> (B*N, D): every token is a sample
        del kv_inputs
    opt.zero_grad(set_to_none=True)
    loss.backward()  # with OE on, LoRALinear's forward makes these the safe gradients (Theorem 1)
    if cfg.gr and cfg.rectify == "grad":
        rectify_gradients_(layers, cfg.delta)
    before = [(l.A.detach().clone(), l.B.detach().clone()) for l in layers] if cfg.gr and cfg.rectify == "update" else None
    opt.step()
    if before is not None:
        rectify_updates_(layers, before, cfg.delta)
    return loss.detach(), (logits.argmax(1) == y).sum()  # tensors: no GPU sync per step


@torch.no_grad()
def features(model, loader, device):
    zs, ys = [], []
    for images, y in loader:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            zs.append(model(images.to(device, non_blocking=True)).float())
        ys.append(y.to(device))
    return torch.cat(zs), torch.cat(ys)


@torch.no_grad()
def evaluate(model, heads, splits, tasks, cfg, device):
    """Row t of the accuracy matrix, accuracy (%) per seen task: task-agnostic, the paper's (heads
    concatenated, argmax over all seen classes, no task id), and task-aware (argmax over the true task's
    head only). Task-aware is a diagnostic of ours: it leaves out how the separately trained heads compare."""
    seen = torch.tensor([c for classes in tasks[:len(heads)] for c in classes], device=device)
    test = data.subset(splits.test, seen.tolist())
    z, y = features(model, data.make_loader(test, cfg.batch_size, False, cfg.workers, 0), device)
    task_of = torch.empty(int(seen.max()) + 1, dtype=torch.long, device=device)
    for i, classes in enumerate(tasks[:len(heads)]):
        task_of[classes] = i
    logits = torch.cat([h(z) for h in heads], dim=1)  # (n, seen classes), columns in the order of `seen`
    other_task = task_of[seen][None, :] != task_of[y][:, None]  # (n, seen classes)
    rows = []
    for pred in (seen[logits.argmax(1)], seen[logits.masked_fill(other_task, -math.inf).argmax(1)]):
        rows.append([100.0 * float((pred == y)[task_of[y] == i].float().mean()) for i in range(len(heads))])
    return rows


def _kv_state(model):
    """What training changes in the backbone: K and V (merged weights, the fresh LoRA pair, the memory)."""
    return {name: t for name, t in model.state_dict().items() if ".attn.k." in name or ".attn.v." in name}


def run(cfg, seed, base_model, splits, resume=None, log=print):
    """All tasks for one seed, from `base_model` (the loaded backbone, copied, never changed). A generator:
    after each task it yields the state the next task needs (main saves it as checkpoint.pt; `resume` is
    such a state), and at the end the seed's results."""
    torch.manual_seed(seed)  # the only generator a run draws from (the loaders seed their own)
    device = torch.device(cfg.device)
    model = copy.deepcopy(base_model).to(device)
    for _, _, layer in model.lora_layers():
        layer.reset_lora_()  # the first task's A comes from this seed too
    D, tasks = model.embed_dim, data.task_classes(splits.num_classes, cfg.tasks)
    subspaces = [OnlineSubspace(D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, device) for _ in model.blocks]
    heads, prototypes = torch.nn.ModuleList(), torch.zeros(0, D, device=device)
    acc, aware, task_seconds, viol = [], [], [], {"k": [], "v": []}  # aware: task-aware rows
    if resume is not None:
        for sub, state in zip(subspaces, resume["subspaces"]):
            sub.load_state_dict({k: v.to(device) if torch.is_tensor(v) else v for k, v in state.items()})
        for i, _, layer in model.lora_layers():
            layer.memory = subspaces[i].memory  # the buffer's shape grows over a run: set it before loading
        model.load_state_dict(resume["kv"], strict=False)  # K and V only; the rest is the pretrained backbone
        heads.extend(torch.nn.Linear(D, len(c)) for c in tasks[:len(resume["acc"])])
        heads.load_state_dict(resume["heads"])
        heads.to(device)
        prototypes, acc, aware = resume["prototypes"].to(device), resume["acc"], resume["aware"]
        task_seconds, viol = resume["task_seconds"], resume["violation"]
        torch.set_rng_state(resume["rng"])
        log(f"seed {seed}: resumed after task {len(acc)}")
    first, t_start, done_epochs = len(acc), time.time(), 0
    for t in range(first, cfg.tasks):
        classes, t0 = tasks[t], time.time()
        head = torch.nn.Linear(D, len(classes)).to(device)
        heads.append(head)
        local = torch.full((splits.num_classes,), -1, dtype=torch.long, device=device)
        local[classes] = torch.arange(len(classes), device=device)  # global class id -> index in this head
        loader = data.make_loader(data.subset(splits.train, classes), cfg.batch_size, True, cfg.workers, seed * 1000 + t)
        opt = torch.optim.Adam(model.lora_parameters() + list(head.parameters()), lr=cfg.lr, betas=(0.9, 0.999))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)  # per epoch, as InfLoRA
        for epoch in range(cfg.epochs):
            e0, loss_sum, correct, seen = time.time(), 0.0, 0, 0
            for images, y in loader:
                images, y = images.to(device, non_blocking=True), local[y.to(device)]
                loss, right = train_step(model, head, opt, images, y, cfg, subspaces, prototypes)
                loss_sum, correct, seen = loss_sum + loss * len(y), correct + right, seen + len(y)
            sched.step()
            if not torch.isfinite(loss_sum):  # stop now: a diverged run would go on to write meaningless results
                raise FloatingPointError(f"task {t + 1} epoch {epoch + 1}: the loss is {float(loss_sum)}; lower --lr "
                                         "and start again (checkpoint.pt, if there is one, holds the tasks finished before)")
            done_epochs += 1
            eta = (time.time() - t_start) / done_epochs * ((cfg.tasks - first) * cfg.epochs - done_epochs)
            log(f"task {t + 1}/{cfg.tasks} epoch {epoch + 1}/{cfg.epochs}  loss {float(loss_sum) / seen:.4f}  "
                f"train acc {100.0 * float(correct) / seen:5.2f}%  {seen / (time.time() - e0):7.1f} img/s  ETA {eta / 60:.1f} min")
        # End of task: violation of this task's update, prototypes, OE merge, LoRA merge, evaluation.
        for name in ("k", "v"):
            viol[name].append([violation(layer) for _, n, layer in model.lora_layers() if n == name])
        train_eval = data.make_loader(data.subset(splits.train_eval, classes), cfg.batch_size, False, cfg.workers, 0)
        z, y = features(model, train_eval, device)
        z = F.normalize(z, dim=1)
        new = torch.stack([F.normalize(z[y == c].mean(0), dim=0) for c in classes])  # class prototypes (DML)
        prototypes = torch.cat([prototypes, new])
        if cfg.oe:
            for sub in subspaces:
                sub.merge()
        for i, name, layer in model.lora_layers():
            layer.memory = subspaces[i].memory  # K and V of block i share their input, hence one memory
            layer.merge_()  # W += s B A, then a fresh pair with A off the (new) memory
        for rows, row in zip((acc, aware), evaluate(model, heads, splits, tasks, cfg, device)):
            rows.append(row)
        task_seconds.append(time.time() - t0)
        log(f"task {t + 1} accuracy per task: " + " ".join(f"{a:.2f}" for a in acc[-1]) +
            f"  | mean {sum(acc[-1]) / len(acc[-1]):.2f}  | task-aware mean {sum(aware[-1]) / len(aware[-1]):.2f}"
            f"  | {task_seconds[-1]:.1f} s")
        if t > 0 and cfg.oe:  # task 1 has no memory to violate
            log(f"task {t + 1} violation ||dW M||/||dW|| per block  K: " + " ".join(f"{v:.3f}" for v in viol["k"][-1]) +
                "  V: " + " ".join(f"{v:.3f}" for v in viol["v"][-1]))
        state = {"seed": seed, "kv": _kv_state(model), "subspaces": [s.state_dict() for s in subspaces],
                 "heads": heads.state_dict(), "prototypes": prototypes, "acc": acc, "aware": aware, "task_seconds": task_seconds,
                 "violation": viol, "tasks": tasks, "rng": torch.get_rng_state()}
        yield state
    full = [row + [None] * (cfg.tasks - len(row)) for row in acc]
    aware_full = [row + [None] * (cfg.tasks - len(row)) for row in aware]
    yield {"seed": seed, "acc_matrix": full, **metrics(acc), "task_aware": {"acc_matrix": aware_full, **metrics(aware)},
           "task_seconds": task_seconds, "violation": viol}


# ---------------------------------------------------------------------------------------------------
# Results, plots, command line
# ---------------------------------------------------------------------------------------------------
def summarize(runs):
    """Mean and std over seeds of ACC, MAA, BWT, and of the same three for task-aware accuracy."""
    def stats(values):
        vals = torch.tensor(values, dtype=torch.float64)
        return {"mean": float(vals.mean()), "std": float(vals.std(unbiased=False))}
    out = {key: stats([r[key] for r in runs]) for key in ("ACC", "MAA", "BWT")}
    out["task_aware"] = {key: stats([r["task_aware"][key] for r in runs]) for key in ("ACC", "MAA", "BWT")}
    return out


def write_json(path, obj):
    tmp = path + ".tmp"  # write then rename: an interrupted write never leaves a half file behind
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def plot(results, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no trajectory.png / violation.png (results.json has the numbers)")
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))  # paper Fig. 5: mean accuracy over seen tasks after each task
    for r in results["runs"]:
        for m, style, what in ((r["acc_matrix"], "o-", ""), (r["task_aware"]["acc_matrix"], "s--", ", task-aware")):
            ax.plot(range(1, len(m) + 1), [sum(row[:t + 1]) / (t + 1) for t, row in enumerate(m)], style,
                    label=f"seed {r['seed']}{what}")
    ax.set(xlabel="task", ylabel="average accuracy on seen tasks (%)", title=results["config"]["dataset"],
           xticks=range(1, len(results["runs"][0]["acc_matrix"]) + 1))
    ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(out, "trajectory.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(6, 3.5))  # paper Fig. 2: per-layer violation, mean over tasks 2..T
    viol = results["runs"][0]["violation"]
    for off, name in ((-0.2, "k"), (0.2, "v")):
        rows = viol[name][1:] or viol[name]
        mean = [sum(col) / len(col) for col in zip(*rows)]
        ax.bar([i + off for i in range(len(mean))], mean, width=0.4, label=name.upper())
    ax.set(xlabel="block", ylabel="||dW M|| / ||dW||", title="null-space violation (seed %d)" % results["runs"][0]["seed"])
    ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the legend above the bars
    ax.legend(ncol=2, loc="upper right"), fig.tight_layout(), fig.savefig(os.path.join(out, "violation.png"), dpi=120)


def benchmark(cfg):
    """--benchmark: ms/step, images/s and peak memory of plain LoRA (OE, GR, DML off), janus-grad and
    janus-update on the same model (random weights: the cost does not depend on them) and generated
    inputs. Janus runs in a mid-sequence state: a memory of k * T/2 directions per block, T/2 tasks of
    old prototypes. Then the data loader alone, when the data set's files are at hand."""
    device = torch.device(cfg.device)
    torch.manual_seed(0)
    base = build_model(Config(**{**asdict(cfg), "weights": "none"}))
    D, C = base.embed_dim, data.DATASETS[cfg.dataset]["num_classes"] // cfg.tasks
    m = min(cfg.k * (cfg.tasks // 2), D - cfg.k)
    images = torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, device=device)
    y = torch.randint(0, C, (cfg.batch_size,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    variants = {"plain": dict(oe=False, gr=False, dml=False), "janus-grad": dict(rectify="grad"),
                "janus-update": dict(rectify="update")}
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
              "model": cfg.model, "batch_size": cfg.batch_size, "img_size": cfg.img_size, "memory_columns": m, "variants": {}}
    for name, change in variants.items():
        vcfg = Config(**{**asdict(cfg), **change})
        model = copy.deepcopy(base).to(device)
        subspaces = [OnlineSubspace(D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, device) for _ in model.blocks]
        if vcfg.oe:  # one random memory per block, shared by its K and V as in training; V starts off it
            for sub in subspaces:
                sub.memory = torch.linalg.qr(torch.randn(D, m, device=device)).Q
                sub.basis = sub._fresh_basis()
            for i, _, layer in model.lora_layers():
                layer.memory = subspaces[i].memory
                layer.reset_lora_()
        prototypes = F.normalize(torch.randn(C * (cfg.tasks // 2), D, device=device), dim=1)
        head = torch.nn.Linear(D, C).to(device)
        opt = torch.optim.Adam(model.lora_parameters() + list(head.parameters()), lr=cfg.lr)
        times = []
        for step in range(3 + cfg.steps):  # 3 warm-up steps: allocator, kernels, Adam state
            if step == 3 and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync()
            t0 = time.perf_counter()
            train_step(model, head, opt, images, y, vcfg, subspaces, prototypes)
            sync()
            times.append(time.perf_counter() - t0)
        ms = 1000 * sorted(times[3:])[len(times[3:]) // 2]  # the median: robust to a stray slow step
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
        report["variants"][name] = {"ms_per_step": ms, "images_per_s": cfg.batch_size / ms * 1000, "peak_mem_mb": peak}
        del model, opt
    plain = report["variants"]["plain"]
    report["overhead"] = {n: v["ms_per_step"] / plain["ms_per_step"] for n, v in report["variants"].items()}
    print(f"{report['device']}, {cfg.model}, batch {cfg.batch_size}, {cfg.img_size} px, Janus memory {m} columns/block, "
          f"median of {cfg.steps} steps")
    print(f"{'variant':14s} {'ms/step':>9s} {'images/s':>9s} {'peak MiB':>9s} {'x plain':>8s}")
    for n, v in report["variants"].items():
        peak = "n/a" if v["peak_mem_mb"] is None else f"{v['peak_mem_mb']:.0f}"
        print(f"{n:14s} {v['ms_per_step']:9.1f} {v['images_per_s']:9.1f} {peak:>9s} {report['overhead'][n]:8.3f}")
    try:  # the input pipeline alone, so that a loader stall is visible next to the step time
        splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size, 0.0, 1.0, download=False)
        loader = data.make_loader(splits.train, cfg.batch_size, True, cfg.workers, 0)
        it, n, t0 = iter(loader), 0, time.perf_counter()
        for _ in range(min(cfg.steps, len(loader))):
            n += len(next(it)[1])
        report["loader_images_per_s"] = n / (time.perf_counter() - t0)
        print(f"data loader alone ({cfg.dataset}, {cfg.workers} workers): {report['loader_images_per_s']:.1f} images/s")
    except data.DataError as e:
        print(f"data loader not timed: {e}")
    out = cfg.out or os.path.join("runs", f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "benchmark.json"), report)
    print(f"wrote {os.path.join(out, 'benchmark.json')}")
    return 0


RESUME_FREE = ("out", "resume", "device", "workers")  # flags that may differ when a run is resumed
CHECKPOINT_FORMAT = 2  # raised whenever what checkpoint.pt holds changes: an older file is refused, not misread


def load_checkpoint(cfg):
    """The state saved in --resume DIR, after checking that it belongs to the same configuration."""
    path = os.path.join(cfg.resume, "checkpoint.pt")
    if not os.path.isfile(path):
        raise ConfigError(f"--resume {cfg.resume}: no checkpoint.pt there; start a new run with --out instead")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # tensors, numbers, strings, lists, dicts
    except Exception as e:  # a checkpoint we cannot read is the user's to replace, whatever the reason
        raise ConfigError(f"--resume {cfg.resume}: checkpoint.pt cannot be read ({type(e).__name__}); remove the folder "
                          "and start again") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"--resume {cfg.resume}: checkpoint.pt was written by another version of janus_min.py "
                          "(or is not ours); finish that run with the version that wrote it, or start again")
    old, new = ckpt["config"], asdict(cfg)
    diff = [k for k in new if k not in RESUME_FREE and old.get(k) != new[k]]
    if diff:
        raise ConfigError(f"--resume {cfg.resume}: the run there used a different configuration ("
                          + ", ".join(f"{k}={old.get(k)!r}, not {new[k]!r}" for k in diff) + "); pass the same flags")
    return ckpt


def main(argv=None):
    cfg = parse_args(argv)
    try:
        cfg = check_config(cfg)
        if cfg.benchmark:
            return benchmark(cfg)
        ckpt = load_checkpoint(cfg) if cfg.resume else None
        out = cfg.resume or cfg.out or os.path.join("runs", f"{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}")
        if ckpt is None and any(os.path.exists(os.path.join(out, f)) for f in ("checkpoint.pt", "results.json")):
            raise ConfigError(f"{out} already holds a run; continue it with --resume {out} or choose another --out")
        scale = vit.PRETRAINED_INPUT[cfg.weights] if cfg.input_range == "checkpoint" else cfg.input_range
        mean_std = vit.MEAN_STD.get(scale, (0.0, 1.0))  # unit: ToTensor's [0, 1] as it is
        splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size, *mean_std, seed=0,
                                   limit_per_class=cfg.limit_per_class)
        base_model = build_model(cfg)  # loaded once, copied per seed; a bad checkpoint fails before DIR is touched
    except (ConfigError, vit.CheckpointError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    print(f"{cfg.dataset}: {len(splits.train)} training / {len(splits.test)} test images, {splits.num_classes} classes, "
          f"{cfg.tasks} tasks; OE {cfg.oe} GR {cfg.gr} ({cfg.rectify}) DML {cfg.dml}; device {cfg.device}; out {out}")
    results = {"config": asdict(cfg), "runs": ckpt["runs"] if ckpt else []}
    try:
        for seed in cfg.seeds:
            if any(r["seed"] == seed for r in results["runs"]):
                continue  # finished before the interruption
            resume = ckpt["current"] if ckpt and ckpt["current"] and ckpt["current"]["seed"] == seed else None
            for state in run(cfg, seed, base_model, splits, resume):
                if "acc_matrix" in state:  # the seed's final results
                    results["runs"].append(state)
                    state = None
                # Atomic write: Ctrl-C during a task or during this save leaves the last checkpoint intact.
                torch.save({"format": CHECKPOINT_FORMAT, "config": asdict(cfg), "runs": results["runs"], "current": state},
                           out + "/checkpoint.pt.tmp")
                os.replace(out + "/checkpoint.pt.tmp", os.path.join(out, "checkpoint.pt"))
            results["summary"] = summarize(results["runs"])  # after every seed: an interruption keeps the others
            write_json(os.path.join(out, "results.json"), results)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {out}/checkpoint.pt holds the last finished task; continue with --resume {out}")
        return 130
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "summary" not in results:  # --resume of a run whose seeds had all finished: nothing ran above
        results["summary"] = summarize(results["runs"])
        write_json(os.path.join(out, "results.json"), results)
    last = results["runs"][-1]
    print("accuracy matrix (row t: after task t; %):")
    for row in last["acc_matrix"]:
        print("  " + " ".join("  -  " if a is None else f"{a:5.1f}" for a in row))
    summary, n = results["summary"], len(results["runs"])
    print("  ".join(f"{k} {summary[k]['mean']:.2f} +- {summary[k]['std']:.2f}" for k in ("ACC", "MAA", "BWT"))
          + f"  over {n} seed(s);  task-aware: " + "  ".join(f"{k} {v['mean']:.2f}" for k, v in summary["task_aware"].items()))
    print(f"time per task (s): {' '.join(f'{x:.1f}' for x in last['task_seconds'])}; total {sum(last['task_seconds']):.1f} s")
    plot(results, out)
    print(f"wrote {os.path.join(out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
