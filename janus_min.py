"""Janus-LoRA (ICML 2026), minimal. Part 1, read top-down beside the paper: the configuration, the
method (Sec. 3) in the order of its update step, our --rectify update, the baselines, the task loop,
`main`. Part 2, after its banner: the program around it. Equations are numbered as in the paper's
LaTeX source; the README lists our readings where the paper is silent. References: C. Chen et al.,
"JANUS-LoRA: A Balanced Low-Rank Adaptation for Continual Learning", ICML 2026; InfLoRA (Liang & Li,
CVPR 2024), whose protocol the paper follows; LoRA-Pro (Wang et al., ICLR 2025)."""
import copy
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields

try:  # Ctrl-C while torch loads (seconds): one line and exit 130, not a traceback
    import torch
    import torch.nn.functional as F
    import data
    import vit
except KeyboardInterrupt:
    print("\ninterrupted (Ctrl-C) while starting: nothing was saved", file=sys.stderr)
    sys.exit(130)


def _opt(default, help, **argparse_kw):
    """A configuration field: its default and its --help line (meaning and source)."""
    return field(default=default, metadata=dict(help=help, **argparse_kw))


@dataclass
class Config:
    """Every flag (python janus_min.py --help lists them by group). None: the data set's default."""
    # data and protocol (paper Sec. 4.1 and the InfLoRA codebase, which the paper ran on)
    dataset: str = _opt("cifar100", "data set (Sec. 4.1)", choices=list(data.DATASETS))
    data_dir: str = _opt("data", "folder that holds (or receives) the data set")
    tasks: int = _opt(None, "tasks T (default: the protocol's; CIFAR-100 10)")
    epochs: int = _opt(None, "epochs per task (default: CIFAR-100 20, ImageNet-R 50, DomainNet 5)")
    batch_size: int = _opt(None, "batch size (default: 128, Sec. 4.1; synthetic 16)")
    img_size: int = _opt(None, "input resolution (default: 224, the paper's; synthetic 64)")
    limit_per_class: int = _opt(None, "keep at most this many training images per class")
    input_range: str = _opt("unit", "unit: [0, 1], as InfLoRA's code; checkpoint: as --weights was "
                            "trained", choices=["unit", "checkpoint", "half", "imagenet"])
    # the backbone and its LoRA pairs (Sec. 3.1, 4.1)
    model: str = _opt("vit_base", "backbone (the paper's: ViT-B/16)", choices=list(vit.PRESETS))
    weights: str = _opt("in21k", "in21k (paper), sam, dino (Table 4), torchvision, none, or a file")
    patch_size: int = _opt(16, "patch size (the paper's: 16; another needs --weights none)")
    rank: int = _opt(10, "LoRA rank r on K and V (Sec. 4.1)")
    lora_scale: float = _opt(1.0, "LoRA scale s (ours: the paper does not give it)")
    # the method (Sec. 3 and 4.1), and our readings where the paper is silent (README)
    lr: float = _opt(5e-4, "Adam's learning rate (Sec. 4.1; the InfLoRA codebase)")
    schedule: str = _opt("inflora", "lr per epoch: inflora, the codebase's quarter cosine; "
                         "cosine, a half cosine to 0", choices=["inflora", "cosine"])
    k: int = _opt(50, "rank k of the OE basis V of each block and task (Sec. 4.1)")
    oe_lr: float = _opt(1.0, "OE's step at a task's start; 1: a step of subspace iteration (ours)")
    oe_decay_steps: int = _opt(5, "OE's step halves after this many, then decays as 1/t (ours)")
    delta: float = _opt(1e-4, "GR's ridge, relative to the mean eigenvalue of B^T B, A A^T (ours)")
    margin: float = _opt(0.3, "DML's margin m (Sec. 4.1)")
    lambda_dml: float = _opt(1.0, "DML's weight lambda (Eq. (12), Sec. 4.1)")
    tau: float = _opt(0.07, "DML's temperature tau (Sec. 4.1)")
    oe: bool = _opt(True, "Online Estimation and the safe gradient (Table 1, the ablation)")
    gr: bool = _opt(True, "Gradient Rectification (Table 1, the ablation)")
    dml: bool = _opt(True, "the Decoupled Margin Loss (Table 1, the ablation)")
    rectify: str = _opt("grad", "grad: GR's gradients go to Adam (the paper's); update: GR acts on "
                        "Adam's step, split with the least norm (ours)", choices=["grad", "update"])
    memory: str = _opt("oe", "protected memory: oe, each task's basis joins it (ours); oe-rolling, "
                       "one (the paper's words); gpm", choices=["oe", "oe-rolling", "gpm"])
    gpm_threshold: list = _opt(None, "GPM's energy share at task 1 and its limit (InfLoRA's; "
                               "default 0.95 1, ImageNet-R 0.98 1)", nargs=2, type=float)
    lora_a: str = _opt("trained", "each task's A: trained (the paper's), or designed off the "
                       "memory and frozen (InfLoRA)", choices=["trained", "inflora"])
    method: str = _opt(None, "a method of the paper's tables, as a preset of flags put first "
                       "(README, 'The paper's comparisons')")
    # the run
    seeds: list = _opt((0,), "seeds; several give mean +- std (the paper: 5)", nargs="+", type=int)
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    precision: str = _opt("bf16", "on CUDA: bf16 autocast (ours) or fp32 (the InfLoRA codebase)",
                          choices=["bf16", "fp32"])
    compile: str = _opt("off", "on: compiled ViT blocks, and on CUDA each step a CUDA graph (ours; "
                        "README, 'Speed')", choices=["on", "off"], nargs="?", const="on")
    workers: int = _opt(None, "loader processes of the file-based data sets (default: the cores)")
    resume: str = _opt(None, "continue the run in this folder after its last finished task")
    # output, and the other modes
    out: str = _opt(None, "output folder (default runs/<dataset>-<time>)")
    benchmark: bool = _opt(False, "time plain LoRA and Janus steps, then exit", action="store_true")
    steps: int = _opt(20, "--benchmark: timed rounds (after 5 warm-up steps)")
    reproduce: str = _opt(None, "run every row of a table or figure of the paper, then write "
                          "OUT/table.md (README, 'Reproducing the paper')")
    row: str = _opt(None, "with --reproduce: run this row alone (one job of an array)")
    dry_run: bool = _opt(False, "with --reproduce: list the commands only", action="store_true")


# ==== The paper's method (Sec. 3), in the order of "The Integrated Janus-LoRA Update Process" ====
def train_step(learner, opt, images, y, cfg):
    """One training step, "The Integrated Janus-LoRA Update Process" in (1)-(5), our numbering. The
    learner: the ViT and its LoRA pairs, the task's head (heads[-1]), OE (oe), each block's memory M
    (memory: the finished tasks' OE bases, which end_task merges; none in task 1), DML's old
    prototypes. y: labels within the task. Returns the loss and the number right, as tensors."""
    model, head = learner.model, learner.heads[-1]
    if cfg.memory == "oe-rolling":  # the paper's words read literally: V, as it stands, is M
        for M, V in zip(learner.memory, learner.oe.basis):
            M.copy_(V)  # in place, as OE's own update: a CUDA graph replays fixed addresses
    # (1) the total loss, Eq. (12): the current head's cross-entropy plus lambda * DML, Eq. (11).
    # The LoRA layers take M in this forward pass: that is where step (3) is prepared.
    with autocast(images.device, cfg):  # bf16 on CUDA (ours)
        z, kv_inputs = model.encode(images, learner.memory)  # kv_inputs: (B, N+1, D) per block
    z = z.float()
    logits = head(z)
    loss = F.cross_entropy(logits, y)
    if cfg.dml:
        dml = dml_loss(z, y, learner.prototypes, cfg.margin, cfg.tau, head.out_features)
        loss = loss + cfg.lambda_dml * dml
    # OE, Eqs. (8)-(10), the paper's "basis V provided by our OE algorithm": each block's V takes a
    # step on this batch's K/V inputs. Ours: V joins M at the task's end, and (3) projects with M,
    # never with V, which would take out this task's own gradient (README, "Protected memory").
    if cfg.oe and cfg.memory != "gpm":
        learner.oe.update(kv_inputs, learner.memory if cfg.memory == "oe" else None)
    del kv_inputs  # released before the backward pass peaks
    # (2) the raw gradient G = dL/dW of each K/V layer (the paper's dW_orig = -lr G; (3)-(7) are
    # linear in it), and with it (3) Theorem 1's safe gradient, Eq. (3), G_safe = G (I - M M^T):
    # vit.LoRALinear.forward held A's part in span(M) constant, so backward returns G_safe's factor
    # gradients, s B^T G_safe and s G_safe A^T.
    opt.zero_grad(set_to_none=True)
    loss.backward()
    # (4) GR, Eqs. (5)-(7): factor gradients whose composite s (B dA + dB A) best matches G_safe
    layers = [layer for _, _, layer in model.lora_layers()]
    if cfg.gr and cfg.rectify == "grad":
        rectify_gradients_(layers, cfg.delta)
    # (5) the optimizer (train_task's Adam) takes them; ours, --rectify update: GR acts on Adam's
    # proposed step instead
    if cfg.gr and cfg.rectify == "update":
        rectified_adam_step_(opt, layers, learner.memory, cfg.delta)
    else:
        opt.step()
    return loss.detach(), (logits.argmax(1) == y).sum()


# ---- (1) The Decoupled Margin Loss, Eq. (11) -----------------------------------------------------
def dml_loss(z, y, old_prototypes, margin=0.3, tau=0.07, num_classes=None):
    """Eq. (11). z (B, D) features, y (B,) labels of the current task (of num_classes), old
    prototypes (P, D) unit rows. The current prototypes: the batch's unit class means (ours)."""
    z = F.normalize(z.float(), dim=1)
    onehot = F.one_hot(y, num_classes or int(y.max()) + 1).float()  # (B, C); pass C: no sync
    protos = F.normalize(onehot.T @ z, dim=1)  # (C, D); a class absent from the batch: 0
    absent = onehot.sum(0) == 0  # (C,): left out of the softmax, which runs over C_t only
    logits = (z @ protos.T / tau).masked_fill(absent, -math.inf)
    intra = F.cross_entropy(logits, y)  # softmax over the batch's classes of z.p_c / tau
    if old_prototypes.shape[0] == 0:
        return intra
    return intra + F.relu(z @ old_prototypes.T - margin).mean()  # hinge: mean over batch x old


# ---- OE: Online Estimation, Eqs. (8)-(10) --------------------------------------------------------
class OnlineSubspace:
    """OE's basis V (D, k) of the current task's K/V inputs, kept orthonormal and off the memory M;
    for all blocks at once with blocks=L: V (L, D, k). The memory itself is the learner's."""

    def __init__(self, dim, k, lr=1.0, decay_steps=5, device=None, blocks=None):
        self.dim, self.k = dim, k
        self.blocks = blocks
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
        batch's tokens, (B, N+1, D) per block (or (n, D) unbatched); memory: M (D, m) a block."""
        V, M = self.basis, _stacked(memory)
        if V.shape[-1] == 0:  # a full memory: nothing left to learn
            return
        XtXV, S = [], []
        for x, v in zip(X if self.blocks else [X], V if self.blocks else [V]):
            x = x.reshape(-1, self.dim)  # (n, D), in its own dtype: bf16 under autocast (README)
            xv = x @ v.to(x.dtype)  # (n, k); equals X_p V, as V is orthogonal to M
            XtXV.append((x.T @ xv).float())
            S.append(_gram(xv))  # (k, k): the energy each direction captures
        CV = _off(torch.stack(XtXV).reshape(V.shape), M)  # X_p^T X_p V
        S = _ridge(torch.stack(S).reshape(*V.shape[:-2], *S[0].shape), 1e-6)  # idle: still finite
        grad = -(CV - V @ (V.mT @ CV))  # the gradient of Eq. (8) at an orthonormal V
        grad = _spd_solve(S, grad.mT.double()).mT.to(V.dtype)  # ours: grad S^-1, scale-free
        lr = torch.full_like(self.steps, self.lr * self.decay_steps)  # ours: decays as 1/t; lr 1 is
        lr = lr / (self.decay_steps + self.steps)  # subspace iteration, V_tilde = C V S^-1 (README)
        V_tilde = V - lr * grad  # Eq. (9)
        V = _qr_q(V_tilde)  # Eq. (10): V <- Q of V_tilde = QR; ours: R's diagonal > 0 (no flips)
        self.basis.copy_(_off(V, M))  # off M: no round-off leaks into span(M); in place, so a
        self.steps += 1  # CUDA graph's replay advances V and the step count (README, "Speed")

    @torch.no_grad()
    def merge(self, memory):
        """A task's end (ours): M <- orth([M, V]) per block; returns it, with a fresh V off it."""
        M = torch.linalg.qr(torch.cat([_stacked(memory), self.basis], dim=-1)).Q
        self.basis = self.fresh_basis(M)
        self.steps.zero_()
        return list(M) if self.blocks else M


# ---- (3) Theorem 1: the safe gradient comes from the LoRA forward (vit.LoRALinear.forward) -------
def safe_gradient(G, M):
    """Reference form of Theorem 1, Eq. (3), for a dense G: the tests and --rectify update use it
    (training gets G_safe from the LoRA forward). G (..., d_out, d_in), M (..., d_in, m)."""
    if M.shape[-1] == 0:
        return G
    return G - (G @ M) @ M.mT  # without forming the d_in x d_in projector


# ---- (4) Gradient Rectification, Eqs. (5)-(7) ----------------------------------------------------
def rectify_gradients_(layers, delta):
    """Replace the LoRA pairs' gradients by GR's, all layers in one batch (Adam then takes them)."""
    A = torch.stack([layer.A.detach() for layer in layers])  # (L, r, d_in)
    B = torch.stack([layer.B.detach() for layer in layers])  # (L, d_out, r)
    s = layers[0].scale
    # autograd left Eq. (4) of G_safe, transposed as the shapes need: s B^T G_safe, s G_safe A^T
    BtG = torch.stack([layer.A.grad for layer in layers]) / s  # B^T G_safe (L, r, d_in)
    GAt = torch.stack([layer.B.grad for layer in layers]) / s  # G_safe A^T (L, d_out, r)
    dA, dB = rectify_factors(BtG, GAt, A, B, s, delta)
    for layer, a, b in zip(layers, dA, dB):
        layer.A.grad.copy_(a)
        layer.B.grad.copy_(b)


def rectify_factors(BtG, GAt, A, B, scale, delta=1e-4):
    """GR from B^T G_safe (..., r, d_in) and G_safe A^T (..., d_out, r) alone -> (dA, dB), in
    BtG's dtype; the r x r systems in float64 (see _gram), which costs nothing at rank r."""
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


def _stacked(memory):
    """Memories per block, (D, m_i), as one (L, D, m): zero columns, which change no projection, pad
    the narrower ones (GPM's); a tensor or None as it is."""
    if not isinstance(memory, list):
        return memory
    m = max(M.shape[1] for M in memory)
    return torch.stack([F.pad(M, (0, m - M.shape[1])) for M in memory])


def _gram(X):
    """X^T X (..., k, k) of X (..., n, k), in float64: float32's round-off can leave a Gram matrix
    indefinite under its ridge, and Cholesky then fails (NaN on CUDA; a fp32 ViT-B run hit it)."""
    X = X.double()
    return X.mT @ X


def _ridge(S, delta):
    """S + delta * mean(eig S) * I for Gram matrices S (..., r, r) (README, "GR ridge")."""
    lam = delta * S.diagonal(dim1=-2, dim2=-1).mean(-1) + torch.finfo(S.dtype).tiny  # S = 0: finite
    return S + lam[..., None, None] * torch.eye(S.shape[-1], dtype=S.dtype, device=S.device)


def _qr_q(V):
    """Eq. (10)'s Q of V = QR (..., n, k), R's diagonal > 0: R^T is V^T V's Cholesky factor, in
    float64 (V^T V >= I: OE's step is orthogonal to V); on a GPU far faster than Householder QR."""
    R = torch.linalg.cholesky_ex(_gram(V)).L.mT
    return torch.linalg.solve_triangular(R, V.double(), upper=True, left=False).to(V.dtype)


def _spd_solve(S, rhs):
    """S^-1 rhs for symmetric positive definite S (..., n, n), by Cholesky and two triangular
    solves: unlike linalg.solve, nothing checks the result on the host (no CUDA sync)."""
    L = torch.linalg.cholesky_ex(S).L
    y = torch.linalg.solve_triangular(L, rhs, upper=False)
    return torch.linalg.solve_triangular(L.mT, y, upper=True)


# ==== Ours: --rectify update, GR on the step Adam proposes (README, "--rectify grad and update") ==
def rectified_adam_step_(opt, layers, memory, delta):
    """Step (5) under --rectify update: Adam proposes a step, which GR rectifies."""
    before = [(layer.A.detach().clone(), layer.B.detach().clone()) for layer in layers]
    opt.step()
    rectify_updates_(layers, before, [memory[j // 2] for j in range(len(layers))], delta)


@torch.no_grad()
def rectify_updates_(layers, before, memories, delta):
    """Under --rectify update (not the default): the step Adam took from `before`, each layer's
    (A, B), as s (B dA + dB A), projected by Theorem 1, rectified, and split with the least norm."""
    A0 = torch.stack([a for a, _ in before])  # (L, r, d_in)
    B0 = torch.stack([b for _, b in before])  # (L, d_out, r)
    s = layers[0].scale
    dA = torch.stack([layer.A for layer in layers]) - A0  # Adam's proposed step
    dB = torch.stack([layer.B for layer in layers]) - B0
    M = _stacked(memories)
    # B^T dW_safe and dW_safe A^T of dW = s (B dA + dB A), with r-wide products only
    BtW = safe_gradient(s * ((B0.mT @ B0) @ dA + (B0.mT @ dB) @ A0), M)
    Ap = safe_gradient(A0, M).mT  # (I - M M^T) A^T  (L, d_in, r)
    WAt = s * (B0 @ (dA @ Ap) + dB @ (A0 @ Ap))
    rA, rB = least_norm_split(*rectify_factors(BtW, WAt, A0, B0, s, delta), A0, B0)
    for layer, a, b in zip(layers, A0 + rA, B0 + rB):
        layer.A.copy_(a)
        layer.B.copy_(b)


def least_norm_split(dA, dB, A, B):
    """Of the steps (dA + C A, dB - B C), which keep the composite B dA + dB A, the one of least
    ||dA||^2 + ||dB||^2: C solves (B^T B) C + C (A A^T) = B^T dB - dA A^T. With A and B of full
    rank r these are all the steps with that composite (README). In float64, as GR."""
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


# ==== The comparisons: GPM's memory (LoRA-GPM) and InfLoRA's A, as InfLoRA's code computes them ===
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


def inflora_a(C, M, rank):
    """InfLoRA's A (r, D): the top-r left singular vectors of (I - M M^T) C, over sqrt(3) as in its
    code (Liang & Li, CVPR 2024); it lies off span(M) and stays frozen."""
    C, M64 = C.double(), M.double()  # float64: the trailing vectors' round-off stays off M
    U = _off(torch.linalg.svd(C - M64 @ (M64.T @ C)).U[:, :rank], M64)
    return (U.T / math.sqrt(3)).to(M.dtype)


# ==== The task loop: a Learner takes each task in turn (InfLoRA's protocol; README, "Protocol") ==
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
    warnings: list = field(default_factory=list)  # what makes the numbers invalid (divergence)
    analyses: dict = field(default_factory=dict)  # the paper's analyses (Part 2's record)


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
    learner.oe.steps.zero_()  # each task's OE starts with large steps (README)
    if cfg.memory == "oe-rolling":  # V, as it stands, is the memory (train_step keeps it so)
        learner.memory = list(learner.oe.basis.clone())
    for _, _, layer in model.lora_layers():
        layer.A.requires_grad_(cfg.lora_a == "trained")  # InfLoRA trains B only
    if cfg.lora_a == "inflora":
        C = kv_covariance(model, data.subset(splits.train_eval, tasks[t]), cfg)  # (L, D, D)
        A = [inflora_a(C_i, M, cfg.rank) for C_i, M in zip(C, learner.memory)]  # K, V share an A
        with torch.no_grad():
            for i, _, layer in model.lora_layers():
                layer.A.copy_(A[i])


def train_task(learner, t, tasks, splits, cfg, clock):
    """Task t's training: cfg.epochs epochs of train_step, Adam on the LoRA pairs and the head."""
    local = torch.full((splits.num_classes,), -1, device=cfg.device)  # class id -> head's index
    local[tasks[t]] = torch.arange(len(tasks[t]), device=cfg.device)
    seed = learner.seed * 1000 + t  # the loader's own generator: its order, crops and flips
    loader = data.make_loader(data.subset(splits.train, tasks[t]), cfg.batch_size, True,
                              cfg.workers, seed, cfg.device)
    params = [p for p in learner.model.lora_parameters() if p.requires_grad]
    params += learner.heads[-1].parameters()
    graphed = cfg.compile == "on" and cfg.device.startswith("cuda")  # ours, for speed (StepGraph)
    lr = torch.tensor(cfg.lr, device=cfg.device) if graphed else cfg.lr  # a graph reads a tensor
    opt = torch.optim.Adam(params, lr=lr, capturable=graphed)  # betas (0.9, 0.999), as InfLoRA
    step_fn = StepGraph(train_step) if graphed else train_step
    learner.throughput.append([])
    first_loss = None
    for epoch in range(cfg.epochs):
        lr = cfg.lr * lr_factor(epoch, cfg.epochs, cfg.schedule)
        for group in opt.param_groups:  # a graph's lr tensor changes in place, as it replays it
            group["lr"] = group["lr"].fill_(lr) if graphed else lr
        start = time.time()
        loss_sum, correct, seen = 0.0, 0, 0
        for step, (images, y) in enumerate(loader, 1):
            images, y = images.to(cfg.device, non_blocking=True), local[y.to(cfg.device)]
            loss, right = step_fn(learner, opt, images, y, cfg)
            loss_sum = loss_sum + loss * len(y)  # tensors: read once an epoch
            correct = correct + right
            seen += len(y)
            if first_loss is None:  # the task's first loss, the mark of divergence (one sync)
                first_loss = float(loss)
            if clock.passed("train", len(y)):
                clock.show(f"task {t + 1}/{cfg.tasks} epoch {epoch + 1}/{cfg.epochs}: "
                           f"{step}/{len(loader)} steps, loss {float(loss_sum) / seen:.4f}")
        mean_loss, speed = float(loss_sum) / seen, seen / (time.time() - start)
        if not math.isfinite(mean_loss):  # a diverged run must not go on to write results
            raise FloatingPointError(f"task {t + 1} epoch {epoch + 1}: the loss is {mean_loss}; "
                                     "lower --lr and start again (checkpoint.pt, if there is "
                                     "one, holds the tasks finished before)")
        learner.throughput[-1].append(speed)
        line = (f"task {t + 1}/{cfg.tasks} epoch {epoch + 1}/{cfg.epochs}  loss {mean_loss:.4f}  "
                f"train acc {100.0 * float(correct) / seen:5.2f}%  {speed:7.1f} img/s")
        if mean_loss > 100 * first_loss:  # orders of magnitude above the task's start: diverging
            learner.warnings.append(f"task {t + 1} epoch {epoch + 1}: the loss grew to "
                                    f"{mean_loss:.3g} from {first_loss:.3g}; these numbers are "
                                    "not a valid run")
            line += "  WARNING: the loss is diverging; lower --lr"
        clock.show(line)


def lr_factor(epoch, epochs, schedule):
    """The lr of a task's epoch, as a factor of --lr: InfLoRA's CosineSchedule as its code steps
    it, cos(99 pi e / (200 (K - 1))) for e = epoch - 1 after an epoch at 1; or a half cosine."""
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * epoch / epochs))
    if epoch == 0 or epochs == 1:  # the codebase divides by zero at K = 1; one epoch at lr
        return 1.0
    return math.cos(99 * math.pi * (epoch - 1) / (200 * (epochs - 1)))


class StepGraph:
    """Ours, for speed: after `warmup` ordinary steps, a task's train_step is recorded as one CUDA
    graph, replayed for each batch of that shape (the host does nothing per step)."""

    def __init__(self, step, warmup=3):
        self.step, self.warmup = step, warmup
        self.graph = None

    def __call__(self, learner, opt, images, y, cfg):
        if self.graph is not None and images.shape == self.images.shape:
            self.images.copy_(images)
            self.y.copy_(y)
            self.graph.replay()
            return self.out
        if self.graph is None and self.warmup == 0:  # recorded, not run: the replay runs it
            self.images, self.y = images.clone(), y.clone()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.step(learner, opt, self.images, self.y, cfg)
            return self(learner, opt, images, y, cfg)
        self.warmup -= 1
        side = torch.cuda.Stream()  # warm-up, or another shape: on a side stream, as CUDA graphs
        side.wait_stream(torch.cuda.current_stream())  # want (their recording runs on one too)
        with torch.cuda.stream(side):
            out = self.step(learner, opt, images, y, cfg)
        torch.cuda.current_stream().wait_stream(side)
        return out


@torch.no_grad()
def end_task(learner, t, tasks, splits, cfg, clock):
    """Task t's end: DML's prototypes of its classes, the memory's update, the LoRA merge. Returns
    the task's factors (A, B) per layer, from before the merge (for the analyses)."""
    images = data.subset(splits.train_eval, tasks[t])  # the test transform
    memory = learner.memory  # these passes run the forward as training ran it, round-off too
    z, y = features(learner.model, images, cfg, clock, f"task {t + 1}'s prototypes", memory)
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
        layer.merge_(learner.memory[i])  # W += s B A, then a fresh pair with A off the memory
    return factors


@torch.no_grad()
def class_prototypes(z, y, classes):
    """(len(classes), D): each class's normalised mean of normalised features (DML's C_past)."""
    z = F.normalize(z, dim=1)
    return torch.stack([F.normalize(z[y == c].mean(0), dim=0) for c in classes])


@torch.no_grad()
def evaluate(model, heads, splits, tasks, cfg, clock=None):
    """Row t of the accuracy matrices: per seen task, task-agnostic (the paper's: an argmax over all
    heads) and task-aware (ours: the true task's head); and over the seen test samples (InfLoRA)."""
    seen = torch.tensor([c for classes in tasks[:len(heads)] for c in classes], device=cfg.device)
    z, y = features(model, data.subset(splits.test, seen.tolist()), cfg, clock, "evaluation")
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
def features(model, images, cfg, clock=None, what="", memory=None):
    """z (n, D) and labels y (n,) of the images, in order (test transform)."""
    zs, ys = [], []
    for z, _, y in batches(model, images, cfg, memory):
        zs.append(z)
        ys.append(y)
        if clock and clock.passed("eval", len(y)):
            clock.show(f"{what}: {sum(map(len, ys))}/{len(images)} images")
    return torch.cat(zs), torch.cat(ys)


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


class Clock:
    """Progress: a line when 30 s have passed since the last, checked after each batch, with the
    ETA of the images still to train and to evaluate, each at its rate (untimed: a third)."""

    def __init__(self, train_images, eval_images, every=30.0):
        self.left = {"train": train_images, "eval": eval_images}
        self.done = {"train": 0, "eval": 0}
        self.seconds = {"train": 0.0, "eval": 0.0}
        self.every = every
        self.shown = self.ticked = time.time()

    def passed(self, kind, images):
        """Count a batch done; True when a progress line is due."""
        now = time.time()
        self.seconds[kind] += now - self.ticked
        self.ticked = now
        self.done[kind] += images
        self.left[kind] -= images
        return now - self.shown >= self.every

    def eta(self):
        train = self.seconds["train"] / max(self.done["train"], 1)  # seconds an image
        evaluate = self.seconds["eval"] / self.done["eval"] if self.done["eval"] else train / 3
        return self.left["train"] * train + self.left["eval"] * evaluate

    def show(self, line):
        print(f"{line}  ETA {self.eta() / 60:.1f} min", flush=True)
        self.shown = time.time()


def run_seed(learner, splits, cfg, clock, record):
    """One seed: every task not finished yet, in turn. record(learner, t, factors, memory) is the
    program's (Part 2): the analyses, their lines and checkpoint.pt after each task."""
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    for t in range(len(learner.acc), cfg.tasks):
        start = time.time()  # a task's time: training and the method's own passes, not the tests
        start_task(learner, t, tasks, splits, cfg)
        train_task(learner, t, tasks, splits, cfg, clock)
        memory = learner.memory  # what this task's updates were to stay off
        factors = end_task(learner, t, tasks, splits, cfg, clock)
        learner.task_seconds.append(time.time() - start)
        acc, aware, sample = evaluate(learner.model, learner.heads, splits, tasks, cfg, clock)
        learner.acc.append(acc)
        learner.aware.append(aware)
        learner.sample_acc.append(sample)
        print(f"task {t + 1} accuracy per task: {' '.join(f'{a:.2f}' for a in acc)}  | mean "
              f"{sum(acc) / len(acc):.2f}  | over samples {sample:.2f}  | task-aware mean "
              f"{sum(aware) / len(aware):.2f}  | {learner.task_seconds[-1]:.1f} s", flush=True)
        record(learner, t, factors, memory)
    return learner


def main(argv=None):
    """python janus_min.py [flags]: every seed's tasks, then results.json and the plots."""
    try:
        cfg, saved = configure(argv)  # Part 2: the flags, checked; --resume: the run's own
        if cfg.benchmark:
            return benchmark(cfg)
        if cfg.reproduce:
            return reproduce(cfg, argv)
        run = Run(cfg, saved)  # Part 2: the locked folder, log.txt, the data and the backbone
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C) while starting: nothing was saved", file=sys.stderr)
        return 130
    with run:  # Ctrl-C, SIGTERM, a diverged loss, a full disk: one line that says what to do
        for seed in run.seeds_left():
            learner = start_learner(cfg, seed, run.base_model)
            run.restore(learner)  # a seed interrupted before goes on after its last finished task
            run_seed(learner, run.splits, cfg, run.clock, run.record)
            run.finish(learner)  # its entry in results.json
        run.report()  # the summary, and the plots
    return run.exit_code


####################################################################################################
# PART 2. The program around the method: the flags and their checks, the run folder (resume,
# checkpoint, lock, signals), results and plots, the analyses' recording, the benchmark, and
# --reproduce with the paper's numbers. Nothing above needs it to be understood.
####################################################################################################
import argparse  # noqa: E402 -- the program's own tools, which Part 1 does not use
import errno  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402


# ---- The flags: the methods as presets, --help's groups, parsing and checks ----------------------
# The methods of the paper's comparisons as flag sets: --method NAME puts them before the others.
METHODS = {"janus": [], "janus-rolling": ["--memory", "oe-rolling"],
           "finetune": ["--no-oe", "--no-gr", "--no-dml"],
           "lora-gpm": ["--memory", "gpm", "--no-gr", "--no-dml"],
           "lora-gpm-gr": ["--memory", "gpm", "--no-dml"],
           "inflora": ["--memory", "gpm", "--lora-a", "inflora", "--no-gr", "--no-dml"]}
# A preset's switch and the flags it makes meaningless: refused beside it (--memory gpm's: unless
# --memory is typed too, which overrides it)
MEANINGLESS = {"--no-oe": "memory gpm_threshold k oe_lr oe_decay_steps", "--no-gr": "delta rectify",
               "--no-dml": "margin lambda_dml tau", "--memory gpm": "k oe_lr oe_decay_steps"}
GPM_THRESHOLDS = {"imagenet-r": (0.98, 1.0)}  # InfLoRA's configs (lamb, lame); the others 0.95, 1.0
GROUPS = {  # --help's groups, in order: every field in one
    "data": "dataset data_dir tasks epochs batch_size limit_per_class img_size input_range",
    "model": "model weights patch_size rank lora_scale",
    "method (the paper's, and our readings)": "method lr schedule k oe_lr oe_decay_steps delta "
                                              "margin lambda_dml tau rectify memory gpm_threshold "
                                              "lora_a",
    "ablation (paper Table 1)": "oe gr dml",
    "run": "seeds device precision compile workers resume",
    "output and other modes": "out benchmark steps reproduce row dry_run"}
EXAMPLES = """examples:
  python janus_min.py --dataset cifar100 --data-dir data --seeds 0 1 2 3 4 --out runs/cifar
  python janus_min.py --reproduce ablation --dataset fashion-mnist --data-dir DIR \\
      --model vit_tiny --weights none --img-size 28 --patch-size 7 --limit-per-class 500 \\
      --epochs 2 --out runs/ablation"""
DESCRIPTION = ("Janus-LoRA (ICML 2026): class-incremental learning with a frozen ViT and LoRA,\n"
               "made stable by OE + GR and plastic by DML. Flags by group; README.md has more.")


class ConfigError(Exception):
    """An impossible combination of flags, or a run folder that cannot be used."""


UserError = (ConfigError, vit.CheckpointError, data.DataError)  # bad input: one line, exit 2


def _require(ok, message):
    if not ok:
        raise ConfigError(message)


def _flag(name):
    return "--" + name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message}; see python janus_min.py --help\n")


def _parser(typed_only):
    """Config's flags by group; typed_only: without defaults, so that it returns what was typed."""
    p = _Parser(usage="python janus_min.py [flags]", description=DESCRIPTION, epilog=EXAMPLES,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                argument_default=argparse.SUPPRESS if typed_only else None)
    group = {}
    for title, names in GROUPS.items():
        group.update(dict.fromkeys(names.split(), p.add_argument_group(title)))
    choices = {"method": sorted(METHODS), "reproduce": list(REPRODUCE)}
    for f in fields(Config):
        kw = dict(f.metadata, **({"choices": choices[f.name]} if f.name in choices else {}))
        if f.type is bool and f.default:
            kw.update(help=f"turn off {kw['help']} (on by default)", action="store_false")
            group[f.name].add_argument("--no-" + f.name, dest=f.name, **kw)
            continue
        if f.type is not bool:
            kw.setdefault("type", {"int": int, "float": float}.get(f.type.__name__, str))
            if f.default is not None:
                shown = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
                kw["help"] += f" (default: {shown})"
            if not typed_only:
                kw["default"] = f.default
        group[f.name].add_argument(_flag(f.name), **kw)
    return p


def parse_args(argv=None, typed_only=False):
    """The Config of argv, a --method preset's flags put first (later flags override its values);
    typed_only: a dict of the flags typed, and nothing else (what --resume compares)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    typed = vars(_parser(True).parse_args(argv))
    if typed_only:
        return typed
    return Config(**vars(_parser(False).parse_args(METHODS.get(typed.get("method"), []) + argv)))


def meaningless(typed):
    """{flag name: the switch of the typed --method's preset that makes it meaningless}."""
    preset = f" {' '.join(METHODS.get(typed.get('method'), []))} "
    switches = [s for s in MEANINGLESS if f" {s} " in preset and
                not (s == "--memory gpm" and "memory" in typed)]
    return {name: s for s in switches for name in MEANINGLESS[s].split() if name in typed}


def configure(argv=None):
    """The command line's Config, checked; with --resume, the run's own (what is typed must agree)
    and its checkpoint."""
    cfg = parse_args(argv)
    typed = parse_args(argv, typed_only=True)
    for name, switch in meaningless(typed).items():  # the first is enough to act on
        raise ConfigError(f"{_flag(name)} has no effect with --method {cfg.method} (its {switch}): "
                          f"drop {_flag(name)}")
    saved = None
    if cfg.resume and not cfg.reproduce:
        cfg, saved = resume_config(cfg, typed)
    return check_config(cfg), saved


def check_config(cfg):
    """Fill the data set's defaults; refuse impossible values with a line that says what to do."""
    for key in ("tasks", "epochs", "batch_size", "img_size"):
        if getattr(cfg, key) is None:
            setattr(cfg, key, data.DATASETS[cfg.dataset][key])
    cfg.gpm_threshold = list(cfg.gpm_threshold or GPM_THRESHOLDS.get(cfg.dataset, (0.95, 1.0)))
    cfg.seeds = list(cfg.seeds)  # one form (a typed --seeds is a list), for --resume's comparison
    if cfg.workers is None:  # the cores this process may use (sched_getaffinity: not everywhere)
        affinity = getattr(os, "sched_getaffinity", None)
        cfg.workers = len(affinity(0)) if affinity else os.cpu_count()
    floats = [f.name for f in fields(Config) if f.type is float]
    _require(all(math.isfinite(getattr(cfg, n)) for n in floats),
             ", ".join(map(_flag, floats)) + " must be finite numbers")
    for name in ("lr", "tau", "lora_scale", "delta", "oe_lr"):
        _require(getattr(cfg, name) > 0, f"{_flag(name)} must be positive")
    for name in ("epochs", "batch_size", "img_size", "patch_size", "oe_decay_steps", "steps",
                 "limit_per_class"):
        _require(getattr(cfg, name) is None or getattr(cfg, name) >= 1, f"{_flag(name)} must "
                 "be at least 1")
    for name in ("margin", "lambda_dml", "workers"):
        _require(getattr(cfg, name) >= 0, f"{_flag(name)} must not be negative")
    data.task_classes(data.DATASETS[cfg.dataset]["num_classes"], cfg.tasks)  # T divides the classes
    width = vit.PRESETS[cfg.model].keywords["embed_dim"]
    for name in ("rank", "k"):
        _require(1 <= getattr(cfg, name) <= width,
                 f"{_flag(name)} must lie in 1..{width} (the width of {cfg.model})")
    _require(all(0 <= s < 2**32 for s in cfg.seeds), "--seeds must lie in 0 .. 2^32 - 1")
    _require(len(set(cfg.seeds)) == len(cfg.seeds), "--seeds: each seed once")
    _require(cfg.weights == "none" or cfg.patch_size == 16 or cfg.benchmark,  # it: random ones
             "--patch-size other than 16 needs --weights none (the checkpoints are ViT-*/16)")
    _require(cfg.img_size % cfg.patch_size == 0, "--img-size must be a multiple of --patch-size")
    _require(cfg.input_range != "checkpoint" or cfg.weights in vit.PRETRAINED_INPUT,
             "--input-range checkpoint needs a named --weights; a file does not say how it was "
             "normalised: pass --input-range half (Google npz) or imagenet (DINO, torchvision)")
    _require(0 < cfg.gpm_threshold[0] <= cfg.gpm_threshold[1] <= 1,
             "--gpm-threshold takes two numbers 0 < first <= last <= 1")
    _require(cfg.lora_a == "trained" or not cfg.gr,
             "--lora-a inflora freezes A, and GR needs a trainable A: add --no-gr")
    _require(not cfg.reproduce or not (cfg.method or cfg.resume),
             "--reproduce chooses its rows' methods and resumes them: drop --method and --resume")
    rows = REPRODUCE.get(cfg.reproduce, ("", {}))[1]
    _require(cfg.row is None or cfg.row in rows, f"--row {cfg.row}: --reproduce {cfg.reproduce} "
             f"has the rows {', '.join(rows) or 'of a table: add --reproduce NAME'}")
    _require(cfg.reproduce or not cfg.dry_run, "--dry-run lists the rows of --reproduce NAME and "
             "trains nothing: add --reproduce NAME, or drop --dry-run to train")
    return _check_device(cfg)


def _check_device(cfg):
    """auto: CUDA where there is a GPU; cuda:N must name one that torch sees."""
    _require(cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:")
             and cfg.device[5:].isdigit(), f"--device {cfg.device}: use auto, cpu, cuda or cuda:N")
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count()
    _require(not cfg.device.startswith("cuda") or int(cfg.device.partition(":")[2] or 0) < gpus,
             f"--device {cfg.device} asked for, but torch sees {gpus} GPU(s); use --device cpu or "
             "an index below that")
    return cfg


# ---- The run folder: resume, checkpoint.pt, the lock, log.txt, signals ---------------------------
RESUME_FREE = ("out", "resume", "device", "workers", "compile", "seeds")  # may change on --resume
CHECKPOINT_FORMAT = 5  # raised whenever checkpoint.pt's content changes: old files are refused
MEASURED = ("acc", "aware", "sample_acc", "task_seconds", "throughput", "warnings", "analyses")
_q = data.quoted  # a path as one shell word, so that a suggested command pastes as it is


class DiskFull(Exception):
    """A file of the run could not be written; the last complete one is kept."""


class Stopped(Exception):
    """SIGTERM, as cluster schedulers send it: handled as Ctrl-C is."""


def resume_config(cfg, typed):
    """--resume DIR: the Config saved in DIR, which the flags typed must agree with (but those of
    RESUME_FREE; seeds may be added), and its checkpoint."""
    folder = cfg.resume
    if os.path.basename(os.path.normpath(folder)) == "checkpoint.pt":  # the file for its folder
        folder = os.path.dirname(os.path.normpath(folder)) or "."
    ckpt = read_checkpoint(folder)
    saved = ckpt["config"]
    clash = [k for k, v in typed.items() if k not in RESUME_FREE and v != saved[k]]
    _require(not clash, f"--resume {_q(folder)}: the run there has " + ", ".join(
        f"{_flag(k)} {saved[k]}" for k in clash) + "; drop those flags (--resume alone continues "
        "it) or start a new run with --out")
    seeds = list(typed.get("seeds", saved["seeds"]))
    _require(set(seeds) >= set(saved["seeds"]), f"--resume {_q(folder)}: its seeds are "
             f"{' '.join(map(str, saved['seeds']))}; give those (and more, to add seeds) or none")
    free = dict(device=typed.get("device", "auto"), workers=typed.get("workers"),
                compile=typed.get("compile", saved["compile"]), seeds=seeds)
    return Config(**{**saved, **free, "out": folder, "resume": folder}), ckpt


def read_checkpoint(folder):
    """checkpoint.pt of a run folder, checked: there, readable, ours and of this version."""
    path = os.path.join(folder, "checkpoint.pt")
    _require(os.path.isfile(path) or not os.path.isfile(os.path.join(folder, "results.json")),
             f"--resume {_q(folder)}: its results.json stays as it is, but without checkpoint.pt "
             "nothing there can be continued; start a new run with --out ANOTHER_FOLDER")
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


def lock_folder(folder, flag):
    """DIR/run.lock, created only where there is none: one run writes to a folder at a time."""
    path = os.path.join(folder, "run.lock")
    try:
        with open(path, "x") as f:
            f.write(f"process {os.getpid()} on {socket.gethostname()}")
    except FileExistsError:
        with open(path) as f:
            holder = f.read().strip() or "another process"
        then = "run --resume again" if flag == "--resume" else "choose another --out"
        raise ConfigError(f"{_q(folder)} is in use by the run of {holder}; wait for it to end or "
                          f"stop it, then {then} (if no run writes there any more, delete "
                          f"{_q(path)})") from None
    return path


def save_file(path, write):
    """write(tmp), then rename: an interruption or a full disk leaves the last complete file."""
    tmp = path + ".tmp"
    try:
        write(tmp)
    except (OSError, RuntimeError) as e:  # torch's writer reports a full disk as a RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        full = isinstance(e, RuntimeError) or e.errno == errno.ENOSPC
        why = "the disk is full" if full else e.strerror or type(e).__name__
        raise DiskFull(f"{_q(path)} could not be written: {why}; the last complete one is "
                       "kept") from None
    os.replace(tmp, path)


def write_json(path, obj):
    def dump(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
    save_file(path, dump)


def _on_sigterm(signum, frame):
    raise Stopped


class Tee:
    """A console stream that also writes each line to log.txt, after a timestamp."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log
        self.line_start = True

    def write(self, text):
        self.stream.write(text)
        for piece in text.splitlines(keepends=True):
            if self.line_start:
                self.log.write(time.strftime("%Y-%m-%d %H:%M:%S  "))
            self.log.write(piece)
            self.line_start = piece.endswith("\n")
        self.log.flush()
        return len(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):  # encoding, isatty, fileno: the console's
        return getattr(self.stream, name)


class Run:
    """A run in its folder: locked, its console lines in log.txt, checkpoint.pt after each task,
    results.json after each seed; and the data and the backbone it trains on."""

    def __init__(self, cfg, saved):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = cfg.resume or (os.path.join("runs", f"{cfg.dataset}-{stamp}") if cfg.out is None
                                  else cfg.out)
        self.flag = "--resume" if cfg.resume else "--out"
        check_folder(self.out, self.flag)
        _require(cfg.resume or not any(os.path.exists(os.path.join(self.out, name))
                                       for name in ("checkpoint.pt", "results.json")),
                 f"{_q(self.out)} already holds a run; continue it with --resume {_q(self.out)} "
                 "or choose another --out")
        made = [p for p in (self.out, os.path.join(self.out, "log.txt")) if not os.path.exists(p)]
        os.makedirs(self.out, exist_ok=True)
        self.lock = lock_folder(self.out, self.flag)  # before the data: a busy folder is told now
        self.log = open(os.path.join(self.out, "log.txt"), "a", encoding="utf-8")
        self.streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(sys.stdout, self.log), Tee(sys.stderr, self.log)
        try:
            self.splits, self.base_model = load_data_and_model(cfg)
        except BaseException:  # bad data or weights, Ctrl-C: leave the folder as it was
            self.close()
            for path in reversed(made):  # log.txt, then the folder if this run made it
                if os.path.isfile(path):
                    os.remove(path)
                elif not os.listdir(path):
                    os.rmdir(path)
            raise
        cfg.out = self.out  # results.json's config names the folder, after a resume too
        self.cfg, self.saved = cfg, saved
        self.current = None  # the last task's snapshot, which checkpoint.pt keeps at the end
        self.exit_code = 0
        self.results = {"config": asdict(cfg), "environment": environment(cfg),
                        "runs": saved["runs"] if saved else []}
        self.clock = Clock(*images_to_pass(cfg, self.splits, self.seeds_left(), saved))

    def close(self):
        sys.stdout, sys.stderr = self.streams
        self.log.close()
        os.remove(self.lock)

    def __enter__(self):
        self.sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
        cfg = self.cfg
        splits = self.splits
        print(f"{cfg.dataset}: {len(splits.train)} training / {len(splits.test)} test images, "
              f"{splits.num_classes} classes, {cfg.tasks} tasks; {describe(asdict(cfg))}; "
              f"device {cfg.device}; out {_q(self.out)}", flush=True)
        width = self.base_model.embed_dim
        if cfg.oe and cfg.memory == "oe" and cfg.k * (cfg.tasks - 1) >= width:
            full = -(-width // cfg.k)
            print(f"note: k x (T - 1) = {cfg.k * (cfg.tasks - 1)} reaches the block width {width}: "
                  f"the memory is full after task {full} and K/V learn nothing from task "
                  f"{full + 1} on")
        return self

    def __exit__(self, kind, error, traceback):
        saved = os.path.exists(os.path.join(self.out, "checkpoint.pt"))
        resume = f"continue with: python janus_min.py --resume {_q(self.out)}"
        if kind in (KeyboardInterrupt, Stopped):
            name = "Ctrl-C" if kind is KeyboardInterrupt else "SIGTERM"
            self.exit_code = 130 if kind is KeyboardInterrupt else 143
            print(f"\ninterrupted ({name}): " + (
                f"{_q(self.out)}/checkpoint.pt holds the tasks finished so far; {resume}" if saved
                else "no task had finished, so nothing was saved; start the run again"), flush=True)
        elif kind is FloatingPointError:
            print(f"error: {error}", file=sys.stderr)
            self.exit_code = 2
        elif kind is DiskFull:
            then = f"free some space, then {resume}" if saved else "free some space and start again"
            print(f"error: {error}; {then}", file=sys.stderr)
            self.exit_code = 1
        signal.signal(signal.SIGTERM, self.sigterm)
        self.close()
        return kind in (KeyboardInterrupt, Stopped, FloatingPointError, DiskFull)

    def seeds_left(self):
        done = {r["seed"] for r in self.results["runs"]}
        return [s for s in self.cfg.seeds if s not in done]

    def restore(self, learner):
        """A seed that an interruption stopped: its state after its last finished task."""
        state = self.saved and self.saved["current"]
        if state and state["seed"] == learner.seed:
            restore(learner, state, self.cfg)
            print(f"seed {learner.seed}: resumed after task {len(learner.acc)}", flush=True)

    def record(self, learner, t, factors, memory):
        """After task t: the paper's analyses, their lines, and checkpoint.pt."""
        record_analyses(learner, t, factors, memory, self.splits, self.cfg)
        self.current = snapshot(learner)
        save_checkpoint(self.out, self.cfg, self.results["runs"], self.current)

    def finish(self, learner):
        """A seed's last task done: its entry in results.json, and the summary so far."""
        self.results["runs"].append(results_entry(learner, self.cfg.tasks))
        save_checkpoint(self.out, self.cfg, self.results["runs"], self.current)
        self.results["summary"] = summarize(self.results["runs"])
        write_json(os.path.join(self.out, "results.json"), self.results)

    def report(self):
        """The run's end: results.json's summary, the summary lines, the plots."""
        self.results["summary"] = summarize(self.results["runs"])
        write_json(os.path.join(self.out, "results.json"), self.results)
        print_summary(self.results)
        plot(self.results, self.out)
        print(f"wrote {_q(os.path.join(self.out, 'results.json'))}")


def build_model(cfg):
    """The backbone with its LoRA layers, loaded from cfg.weights, in eval mode for good."""
    torch.manual_seed(0)  # with --weights none, a random backbone plays the checkpoint: one for all
    model = vit.PRESETS[cfg.model](img_size=cfg.img_size, patch_size=cfg.patch_size,
                                   lora_rank=cfg.rank, lora_scale=cfg.lora_scale)
    vit.load_pretrained(model, cfg.weights)
    return model.eval()  # the ViT has no dropout, and training never switches modes


def load_data_and_model(cfg):
    """The data set's splits in the input range asked for, and the backbone (copied per seed)."""
    scale = cfg.input_range
    if scale == "checkpoint":
        scale = vit.PRETRAINED_INPUT[cfg.weights]
    mean_std = vit.MEAN_STD.get(scale, (0.0, 1.0))  # unit: ToTensor's [0, 1] as it is
    splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size, *mean_std, seed=0,
                               limit_per_class=cfg.limit_per_class)
    return splits, build_model(cfg)


def images_to_pass(cfg, splits, seeds, saved):
    """(images to train, images to evaluate) in the seeds still to run, for the ETA: each task's
    training images per epoch; its prototypes' pass and the test images of the tasks seen."""
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    train = [sum(splits.train.targets.count(c) for c in classes) for classes in tasks]
    test = [sum(splits.test.targets.count(c) for c in classes) for classes in tasks]
    evaluated = [train[t] + sum(test[:t + 1]) for t in range(cfg.tasks)]
    state = saved and saved["current"]
    done = len(state["acc"]) if state and seeds and state["seed"] == seeds[0] else 0
    return (sum(train) * len(seeds) - sum(train[:done])) * cfg.epochs, \
        sum(evaluated) * len(seeds) - sum(evaluated[:done])


def snapshot(learner):
    """checkpoint.pt's "current": all the next task needs, what was measured, the generator."""
    kv = {n: t for n, t in learner.model.state_dict().items() if ".attn.k." in n or ".attn.v." in n}
    return {"seed": learner.seed, "kv": kv, "oe_basis": learner.oe.basis,
            "oe_steps": learner.oe.steps, "memory": learner.memory,
            "heads": learner.heads.state_dict(), "prototypes": learner.prototypes,
            "rng": torch.get_rng_state(), **{key: getattr(learner, key) for key in MEASURED}}


def restore(learner, state, cfg):
    """The learner as snapshot(learner) saved it; the rest of the backbone is the pretrained one."""
    def here(value):
        return value.to(cfg.device) if torch.is_tensor(value) else value
    learner.model.load_state_dict(state["kv"], strict=False)  # K and V with the tasks merged in
    learner.oe.basis = here(state["oe_basis"])
    learner.oe.steps = here(state["oe_steps"])
    learner.memory = [here(M) for M in state["memory"]]
    tasks = data.task_classes(data.DATASETS[cfg.dataset]["num_classes"], cfg.tasks)
    for classes in tasks[:len(state["acc"])]:
        learner.heads.append(torch.nn.Linear(learner.model.embed_dim, len(classes)))
    learner.heads.load_state_dict(state["heads"])
    learner.heads.to(cfg.device)
    learner.prototypes = here(state["prototypes"])
    for key in MEASURED:
        setattr(learner, key, state[key])
    torch.set_rng_state(state["rng"])


def save_checkpoint(out, cfg, runs, current):
    """checkpoint.pt, written then renamed: Ctrl-C or a full disk leaves the last one intact."""
    ckpt = {"format": CHECKPOINT_FORMAT, "config": asdict(cfg), "runs": runs, "current": current}

    def write(tmp):
        torch.save(ckpt, tmp)
    save_file(os.path.join(out, "checkpoint.pt"), write)


def environment(cfg):
    """What results.json needs to say where its numbers come from."""
    import torchvision  # noqa: PLC0415 -- its version only
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or None  # none outside a git checkout
    except OSError:  # no git on this machine
        git = None
    if cfg.device.startswith("cuda"):
        device = torch.cuda.get_device_name(cfg.device)
    else:
        device = f"cpu ({torch.get_num_threads()} threads)"
    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "device": device,
            "git_commit": git}


def load_run(folder, device="cpu"):
    """(cfg, Learner) of the state checkpoint.pt holds: a finished run's final model (merged K and V
    weights, heads, prototypes, memories). The rest of the backbone comes from cfg.weights."""
    ckpt = read_checkpoint(folder)
    cfg = Config(**{**ckpt["config"], "device": device})
    learner = start_learner(cfg, ckpt["current"]["seed"], build_model(cfg))
    restore(learner, ckpt["current"], cfg)
    return cfg, learner


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
            **learner.analyses, "throughput": learner.throughput, "warnings": learner.warnings}


def summarize(runs):
    """Mean and std over seeds of ACC, MAA, BWT, and of the same three for task-aware accuracy."""
    def stats(values):  # undefined (None) if any run's is, as BWT with one task
        if any(v is None for v in values):
            return {"mean": None, "std": None}
        return {"mean": statistics.fmean(values), "std": statistics.pstdev(values)}
    out = {key: stats([r[key] for r in runs]) for key in ("ACC", "MAA", "BWT")}
    out["sample_ACC"] = stats([r["sample_acc"][-1] for r in runs])  # over the final test samples
    out["task_aware"] = {key: stats([r["task_aware"][key] for r in runs])
                         for key in ("ACC", "MAA", "BWT")}
    return out


def _stat(s):
    return "undefined" if s["mean"] is None else f"{s['mean']:.2f} +- {s['std']:.2f}"


def print_summary(results):
    last = results["runs"][-1]
    s = results["summary"]
    T = len(last["acc_matrix"])
    print(f"accuracy (%) on each task (columns) after each task (rows), seed {last['seed']}:")
    print("after task | " + " ".join(f"task {i + 1:<2d}" for i in range(T)))
    for t, row in enumerate(last["acc_matrix"]):
        print(f"{t + 1:10d} | " + " ".join(f"{_fmt(a, '.1f'):>7s}" for a in row))
    print("  ".join(f"{k} {_stat(s[k])}" for k in ("ACC", "MAA", "BWT", "sample_ACC")) +
          f"  over {len(results['runs'])} seed(s); task-aware: ACC {_stat(s['task_aware']['ACC'])}"
          f"  BWT {_stat(s['task_aware']['BWT'])}")
    print("ACC: mean accuracy over the tasks after the last; MAA: mean over tasks of the accuracy "
          "on the tasks seen so far; BWT: mean change of a task's accuracy from right after it to "
          "the end (negative: forgetting); sample_ACC: ACC over all test samples (InfLoRA's logs); "
          "task-aware (ours): the argmax over the true task's head only")
    print(f"time per task (s): {' '.join(f'{x:.1f}' for x in last['task_seconds'])}; total "
          f"{sum(last['task_seconds']):.1f} s")
    for run in results["runs"]:
        for warning in run["warnings"]:
            print(f"WARNING (seed {run['seed']}): {warning}")


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _mean(values):
    """The mean of the defined values (None: undefined, left out), or None."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def describe(config):
    """The method's switches in words: the preset's name, and OE (memory), GR (rectify), DML."""
    c = config
    return (f"{c['method'] or 'custom'}: OE {c['oe']} ({c['memory']}) GR {c['gr']} "
            f"({c['rectify']}) DML {c['dml']}")


# ---- The paper's analyses, recorded after each task: the null-space violation against the memory
# and on real activations (Fig. 2), DML's geometry (Fig. 3 and the appendix's density) -------------
def record_analyses(learner, t, factors, memory, splits, cfg):
    """Task t's analyses into learner.analyses, and their lines. factors: each layer's (A, B) of
    the task, before the merge; memory: what they were to stay off."""
    a = learner.analyses
    if not a:
        a.update(violation={"k": [], "v": []}, interference=[], geometry=[])
    layers = learner.model.lora_layers()
    for name in ("k", "v"):
        a["violation"][name].append([violation(A, B, memory[i]) for (A, B), (i, n, _)
                                     in zip(factors, layers) if n == name])
    if t > 0 and cfg.oe:  # task 1 has no memory to violate
        viol = {n: " ".join(_fmt(v, ".3f") for v in a["violation"][n][-1]) for n in "kv"}
        print(f"task {t + 1} violation ||dW M||/||dW|| per block  K: {viol['k']}  V: {viol['v']}")
    if t == 0:  # no past tasks, no old prototypes
        a["interference"].append(None)
        a["geometry"].append(None)
        return
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    current = torch.zeros(splits.num_classes, dtype=torch.bool, device=cfg.device)
    current[tasks[t]] = True
    probe = Probe(factors, cfg.lora_scale, current, cfg.device)
    seen = [c for classes in tasks[:t + 1] for c in classes]
    probe.read(learner.model, data.subset(splits.test, seen), cfg)
    a["interference"].append(probe.interference())
    a["geometry"].append(dml_geometry(torch.cat(probe.z), torch.cat(probe.y),
                                      learner.prototypes, tasks[t][0]))
    g = a["geometry"][-1]
    print(f"task {t + 1} DML geometry: cos_old > 0.5 {g['danger']:.3f}, < 0.2 {g['safe']:.3f}, "
          f"cos_old > cos_own {g['closer_to_old']:.3f}", flush=True)


@torch.no_grad()
def violation(A, B, M):
    """||dW M||_F / ||dW||_F of a task's update dW = s B A, never forming dW; None where it is
    undefined (no memory yet, or no update, as under a full memory)."""
    den = ((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt()  # ||B A||_F^2 = tr(B^T B A A^T)
    if M.shape[1] == 0 or den == 0:
        return None
    return float((B @ (A @ M)).norm() / den)


class Probe:
    """Task t's analyses from a pass over the seen tasks' test images: each K/V layer's
    interference ||X dW_t^T||_F^2 on the past tasks' inputs and the current task's, and the
    current task's features. factors: per layer, the task's (A, B) before the merge."""

    def __init__(self, factors, scale, current, device):
        self.factors, self.scale = factors, scale
        self.current = current  # (classes,) bool: the current task's
        self.energy = torch.zeros(2, len(factors), device=device)  # (past, current) x layers
        self.tokens = torch.zeros(2, device=device)
        self.z, self.y = [], []

    @torch.no_grad()
    def read(self, model, images, cfg):
        for z, kv_inputs, y in batches(model, images, cfg):
            self.add(z, kv_inputs, y)

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
        ratio = [p / c if c > 0 else None for p, c in zip(past, now)]
        return {"past": past, "current": now, "ratio": ratio}


def dml_geometry(z, y, prototypes, old, bins=20):
    """For one task's test features z (n, D) of classes y: cos_old, the largest cosine to an old
    class's prototype (classes < old), and cos_own, to its own class's (prototypes: one per class,
    in class order); the shares the paper reads, and the histogram of cos_old over [-1, 1]."""
    z = F.normalize(z.float(), dim=1)
    cos_old = (z @ prototypes[:old].T).amax(1)  # (n,)
    cos_own = (z * prototypes[y]).sum(1)
    return {"danger": float((cos_old > 0.5).float().mean()),
            "safe": float((cos_old < 0.2).float().mean()),
            "closer_to_old": float((cos_old > cos_own).float().mean()),
            "hist": (torch.histc(cos_old, bins, -1, 1) / len(z)).tolist(),
            "cos_old": [round(v, 4) for v in cos_old.tolist()],
            "cos_own": [round(v, 4) for v in cos_own.tolist()]}


# ---- Plots (matplotlib, if installed) ------------------------------------------------------------
def _pyplot():
    """matplotlib's pyplot without a display, or None where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 -- optional: only the plots need it
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    return plt


def plot(results, out):
    """trajectory.png, violation.png, angular.png (the first seed's analyses)."""
    plt = _pyplot()
    if plt is None:
        print("matplotlib is not installed: no plots (results.json has the numbers)")
        return
    plot_trajectory(plt, results, os.path.join(out, "trajectory.png"))
    first, config = results["runs"][0], results["config"]
    plot_violation(plt, first, config, os.path.join(out, "violation.png"))
    if not plot_angular(plt, first, config, os.path.join(out, "angular.png")):
        print("angular.png not drawn: one task has no old prototypes")
    plt.close("all")


def _title(config):
    return f"{config['dataset']}, T={config['tasks']}, {describe(config)}"


def plot_trajectory(plt, results, path):
    """Paper Fig. 5: the mean accuracy over the seen tasks after each task, mean over seeds."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, style, label in (("acc_matrix", "o-", "task-agnostic (the paper's metric)"),
                              ("task_aware", "s--", "task-aware (ours: the true task's head)")):
        runs = results["runs"]
        matrices = [r[key] if key == "acc_matrix" else r[key]["acc_matrix"] for r in runs]
        curves = torch.tensor([[sum(row[:t + 1]) / (t + 1) for t, row in enumerate(matrix)]
                               for matrix in matrices])
        x = range(1, curves.shape[1] + 1)
        ax.plot(x, curves.mean(0), style, label=label + f", mean of {len(curves)} seed(s)")
        ax.fill_between(x, curves.min(0).values, curves.max(0).values, alpha=0.2)  # the spread
    ax.set(xlabel="task", ylabel="mean accuracy on the seen tasks (%)", xticks=list(x),
           title=_title(results["config"]))
    ax.title.set_fontsize(8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_violation(plt, run, config, path):
    """Paper Fig. 2 per block (from 1), mean over tasks 2..T: ||dW M|| / ||dW|| against the memory
    and ||X_past dW^T|| / sqrt(n) on the past tasks' test inputs."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    fig.suptitle(f"{_title(config)}\nsmall: the task's update leaves the protected inputs' outputs "
                 "alone (left: the memory's directions; right: the past tasks' test inputs)",
                 fontsize=9)
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
    fig.tight_layout(rect=(0, 0, 1, 0.96))  # below the two-line suptitle
    fig.savefig(path, dpi=120)


def plot_angular(plt, run, config, path):
    """Paper Fig. 3 and the appendix's density: the last task's samples, cos_old against cos_own,
    and each task's density of cos_old (DML pushes it below the margin)."""
    tasks = [(t + 1, g) for t, g in enumerate(run["geometry"]) if g]
    if not tasks:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    fig.suptitle(_title(config), fontsize=9)
    t, g = tasks[-1]
    values = g["cos_old"] + g["cos_own"]
    lo = min(values) - 0.05  # both axes: the data's range with a margin, square
    hi = max(values) + 0.05
    left.scatter(g["cos_old"], g["cos_own"], s=6, alpha=0.5)
    left.plot([lo, hi], [lo, hi], "k--", lw=0.8,
              label=f"cos_old = cos_own; below, closer to old: {g['closer_to_old']:.3f}")
    left.axvline(0.5, color="red", ls="--", label=f"danger zone > 0.5: {g['danger']:.3f}")
    left.axvline(0.2, color="green", ls=":", label=f"safe < 0.2: {g['safe']:.3f}")
    left.set(xlabel="cos_old: largest similarity to an old prototype",
             ylabel="cos_own: similarity to its own prototype", xlim=(lo, hi), ylim=(lo, hi),
             title=f"seed {run['seed']}, task {t}'s test samples")
    left.legend(fontsize=8)
    width = 2 / len(g["hist"])  # the bins of dml_geometry's histogram over [-1, 1]
    used = []  # the centres of the bins that hold samples
    for t, g in tasks:
        centres = [-1 + width * (i + 0.5) for i in range(len(g["hist"]))]
        right.plot(centres, g["hist"], "o-", ms=3, label=f"task {t}")
        used += [c for c, share in zip(centres, g["hist"]) if share > 0]
    right.set(xlabel="cos_old", ylabel=f"share of the task's test samples per bin (width {width})",
              xlim=(max(min(used) - width, -1), min(max(used) + width, 1)),
              title="cos_old per task: the share of its test samples in each bin")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# ---- --benchmark: plain LoRA against the Janus step, interleaved ---------------------------------
def benchmark(cfg):
    """--benchmark: plain LoRA, janus-grad and janus-update, one step of each in turn on the same
    inputs, so that drift hits all alike; the median of the per-round ratios to plain."""
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    C = data.DATASETS[cfg.dataset]["num_classes"] // cfg.tasks  # classes in a task
    base = build_model(Config(**{**asdict(cfg), "weights": "none"}))  # the cost is the same
    m = min(cfg.k * (cfg.tasks // 2), base.embed_dim - cfg.k)  # the memory at mid-run
    images = torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, device=device)
    y = torch.randint(0, C, (cfg.batch_size,), device=device)
    changes = {"plain": dict(oe=False, gr=False, dml=False), "janus-grad": dict(rectify="grad"),
               "janus-update": dict(rectify="update")}
    steps, peaks = {}, {}
    for name, change in changes.items():  # built and warmed up one by one: each one's own memory
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        steps[name] = bench_step(cfg, base, change, m, C)
        for _ in range(5):  # warm-up: allocator, kernels, Adam's state, a CUDA graph's recording
            steps[name](images, y)
        peaks[name] = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if cuda else None
    ms = {name: [] for name in steps}
    for _ in range(cfg.steps):  # interleaved rounds
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step(images, y)
            _sync(device)
            ms[name].append(1e3 * (time.perf_counter() - start))
    return bench_report(cfg, ms, peaks, m)


def bench_report(cfg, ms, peaks, m):
    """--benchmark's table and benchmark.json: per variant, the median step, images/s, the peak
    memory, and the median and IQR of its per-round ratio to plain LoRA (drift cancels)."""
    cuda = cfg.device.startswith("cuda")
    report = {"device": torch.cuda.get_device_name(cfg.device) if cuda else
              f"cpu ({torch.get_num_threads()} threads)", "model": cfg.model,
              "batch_size": cfg.batch_size, "img_size": cfg.img_size, "memory_columns": m,
              "rounds": cfg.steps, "precision": cfg.precision, "compile": cfg.compile,
              "variants": {}}
    print(f"{report['device']}, {cfg.model}, batch {cfg.batch_size}, {cfg.img_size} px, memory "
          f"{m} columns/block, {cfg.precision}, --compile {cfg.compile}, {cfg.steps} interleaved "
          f"rounds\n{'variant':14s} {'ms/step':>9s} {'images/s':>9s} {'peak MiB':>9s} "
          f"{'x plain (median, IQR)':>24s}")
    for name, t in ms.items():
        ratios = sorted(a / b for a, b in zip(t, ms["plain"]))
        iqr = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]
        step_ms = sorted(t)[len(t) // 2]
        report["variants"][name] = {"ms_per_step": step_ms, "images_per_s": 1e3 * cfg.batch_size /
                                    step_ms, "peak_mem_mb": peaks[name],
                                    "x_plain": ratios[len(ratios) // 2], "x_plain_iqr": iqr}
        peak = "n/a" if peaks[name] is None else f"{peaks[name]:.0f}"
        print(f"{name:14s} {step_ms:9.1f} {1e3 * cfg.batch_size / step_ms:9.1f} {peak:>9s} "
              f"{ratios[len(ratios) // 2]:12.3f} ({iqr[0]:.3f}-{iqr[1]:.3f})")
    report["loader_images_per_s"] = _time_loader(cfg)
    out = cfg.out or os.path.join("runs", f"benchmark-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "benchmark.json"), report)
    print(f"wrote {os.path.join(out, 'benchmark.json')}")
    return 0


def _sync(device):
    if device.type == "cuda":  # the steps run asynchronously: wait for them before a clock reads
        torch.cuda.synchronize(device)


def bench_step(cfg, base, change, m, C):
    """One --benchmark variant's training step, in a mid-run state: a random memory of m
    columns per block, C classes in the task, and the old prototypes of half the tasks."""
    vcfg = Config(**{**asdict(cfg), **change})
    learner = start_learner(vcfg, 0, base)
    L, D = len(base.blocks), base.embed_dim
    if vcfg.oe:  # one memory per block, shared by its K and V; V and A start off it
        learner.memory = list(torch.linalg.qr(torch.randn(L, D, m)).Q.to(cfg.device))
        learner.oe.basis = learner.oe.fresh_basis(learner.memory)
        for i, _, layer in learner.model.lora_layers():
            layer.reset_lora_(learner.memory[i])
    learner.prototypes = F.normalize(torch.randn(C * (cfg.tasks // 2), D, device=cfg.device), dim=1)
    learner.heads.append(torch.nn.Linear(D, C).to(cfg.device))
    if vcfg.memory == "oe-rolling":  # V itself, as start_task sets it
        learner.memory = list(learner.oe.basis.clone())
    params = learner.model.lora_parameters() + list(learner.heads[-1].parameters())
    graphed = vcfg.compile == "on" and vcfg.device.startswith("cuda")  # as train_task's
    lr = torch.tensor(vcfg.lr, device=vcfg.device) if graphed else vcfg.lr
    opt = torch.optim.Adam(params, lr=lr, capturable=graphed)
    step_fn = StepGraph(train_step) if graphed else train_step

    def step(images, y):
        return step_fn(learner, opt, images, y, vcfg)
    step.learner, step.opt = learner, opt  # for the tests
    return step


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
    batches = iter(loader)
    start = time.perf_counter()
    images = sum(len(next(batches)[1]) for _ in range(min(cfg.steps, len(loader))))
    _sync(device)  # the device pipeline's kernels run asynchronously
    speed = images / (time.perf_counter() - start)
    kind = (f"batched on {device}" if isinstance(loader, data.DeviceLoader)
            else f"{cfg.workers} workers")
    print(f"data loader alone ({cfg.dataset}, {kind}): {speed:.1f} images/s")
    return speed


# ---- --reproduce: every row of a table or figure of the paper, one command, resumable ------------
# --reproduce NAME: (what it reproduces, {row: its flags}); the sweeps' values as read in the paper
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
    "k": ("Fig. 4a: the rank k of the OE basis", {
        f"k{k}": ["--k", str(k)] for k in (25, 50, 75, 100)}),
    "margin": ("Fig. 4b: the DML margin m", {
        f"m{m}": ["--margin", str(m)] for m in (0.1, 0.2, 0.3, 0.4, 0.5)}),
    "lambda": ("the appendix's figure: the DML weight lambda", {
        f"l{v}": ["--lambda-dml", str(v)] for v in (0.5, 1.0, 1.5, 2.0)}),
    "backbones": ("Table 4: Janus-LoRA on other pre-trainings", {
        w: ["--weights", w] for w in ("in21k", "sam", "dino")}),
}
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
    ("oe-vs-gpm", "imagenet-r", 10): ("Table 5", {
        "gpm": (38.79, 42.48, -5.36), "oe": (40.90, 45.93, -5.98)}),
    ("oe-vs-gpm", "cifar100", 10): ("Table 5", {
        "gpm": (74.84, 83.30, -7.70), "oe": (77.31, 84.83, -6.27)}),
    ("gr-plugin", "imagenet-r", 10): ("Fig. 6, as printed on the figure", {
        "lora-gpm": (71.89, 79.82, -11.48), "lora-gpm-gr": (74.14, 80.12, -4.55)}),
    ("backbones", "imagenet-r", 10): ("Tables 2 and 4", {
        "in21k": (75.78, 81.64, -6.05), "sam": (70.22, 77.90, -6.47),
        "dino": (68.20, 76.15, -5.73)}),
    ("k", "imagenet-r", 10): ("Sec. 4.2's text", {
        "k25": (None, None, -7.41), "k100": (None, None, -4.14)}),
    ("lambda", "imagenet-r", 10): ("the appendix's text", {
        "l0.5": (None, None, -5.50), "l2.0": (None, None, -6.62)}),
    ("margin", "imagenet-r", 10): ("Fig. 4b, drawn only: its source quotes no value", {}),
}


def paper_note(name, dataset, tasks):
    """Whether the paper gives numbers for --reproduce NAME on this data set and T, or where."""
    source, rows = PAPER.get((name, dataset, tasks), (None, {}))
    if rows:
        return f"the paper's numbers: {source}"
    note = f"the paper gives no numbers for {dataset}, T={tasks}"
    if source:  # the setting of a figure whose values its source does not quote
        note += f" ({source})"
    where = [(d, t, s) for (n, d, t), (s, _) in PAPER.items()
             if n == name and (d, t) != (dataset, tasks)]
    if not where:
        return note
    settings = ", ".join(f"{d}, T={t} ({s})" for d, t, s in where)
    return f"{note}; its settings for this set: {settings}: add --dataset {where[0][0]} " \
        f"--tasks {where[0][1]}"


def to_argv(cfg, drop=()):
    """The flags that give cfg again: every field that differs from its default, but those of the
    mode and those named in drop."""
    argv, skip = [], ("reproduce", "row", "dry_run", "out", "resume", "method", *drop)
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if f.name in skip or value == f.default or isinstance(value, list) and \
                tuple(value) == f.default:
            continue
        if f.type is bool:
            argv.append(_flag(f.name) if value else "--no-" + f.name)
        else:
            argv += [_flag(f.name), *map(str, value if isinstance(value, list) else [value])]
    return argv


def reproduce(cfg, argv=None):
    """Each row into OUT/<row>/, with the flags given and the row's: a finished row is skipped, an
    interrupted one resumed; then the table of whichever rows have finished."""
    typed = parse_args(argv, typed_only=True)
    what, rows = REPRODUCE[cfg.reproduce]
    out = cfg.out or os.path.join("runs", f"{cfg.reproduce}-{cfg.dataset}-T{cfg.tasks}")
    print(f"--reproduce {cfg.reproduce}: {what}; {len(rows)} rows on {cfg.dataset}, T={cfg.tasks}, "
          f"into {_q(out)}; {paper_note(cfg.reproduce, cfg.dataset, cfg.tasks)}")
    for row in [cfg.row] if cfg.row else rows:
        folder = os.path.join(out, row)
        if not cfg.dry_run and set(cfg.seeds) <= {r["seed"] for r in _row_runs(folder)}:
            print(f"{row}: finished before, skipped")
            continue
        interrupted = os.path.exists(os.path.join(folder, "checkpoint.pt"))  # continues from there
        # the flags typed (before the data set's defaults) but those the row's preset makes moot
        useless = meaningless({**typed, **parse_args(rows[row], typed_only=True)})
        row_argv = to_argv(parse_args(argv), useless) + rows[row] + [
            "--resume" if interrupted else "--out", folder]
        print(f"{row}: python janus_min.py {shlex.join(row_argv)}")  # quoted: it pastes
        if cfg.dry_run:
            continue
        code = main(row_argv)
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
    violations = [_mean(sum(r["violation"]["k"] + r["violation"]["v"], [])) for r in runs]
    past = [_mean(sum([i["past"] for i in r["interference"] if i], [])) for r in runs]
    danger = [_mean([g["danger"] for g in r["geometry"] if g]) for r in runs]
    return {**{key: [s[key]["mean"], s[key]["std"]] for key in ("ACC", "MAA", "BWT", "sample_ACC")},
            "aware_ACC": [s["task_aware"]["ACC"]["mean"]],
            "aware_BWT": [s["task_aware"]["BWT"]["mean"]], "violation": _mean(violations),
            "interference": _mean(past), "danger": _mean(danger),
            "seconds_per_task": _mean([_mean(r["task_seconds"]) for r in runs])}


def write_table(cfg, out, rows):
    """table.json and table.md: each finished row's numbers beside the paper's; time.png."""
    source, paper = PAPER.get((cfg.reproduce, cfg.dataset, cfg.tasks), (None, {}))
    table = {"reproduce": cfg.reproduce, "what": REPRODUCE[cfg.reproduce][0],
             "dataset": cfg.dataset, "tasks": cfg.tasks, "paper_source": source, "rows": {},
             "missing": [], "paper_note": paper_note(cfg.reproduce, cfg.dataset, cfg.tasks)}
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
    def pm(v):
        return f"{v[0]:.2f} ± {v[1]:.2f}"
    source = table["paper_source"] or "none for this data set and T"
    lines = [f"# --reproduce {table['reproduce']}: {table['what']}",
             f"{table['dataset']}, T = {table['tasks']}; {table['paper_note']}; ours: mean ± std "
             "over seeds.", "",
             "| row | flags | seeds | ACC | MAA | BWT | ACC over samples | task-aware ACC | "
             "task-aware BWT | violation | interference | danger share | s / task | "
             f"the paper's ACC / MAA / BWT ({source}) |", "|" + "---|" * 14]
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
    plt = _pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for row in table["rows"]:
        seconds = torch.tensor([r["task_seconds"] for r in _row_runs(os.path.join(out, row))])
        x = range(1, seconds.shape[1] + 1)
        left.plot(x, seconds.mean(0), "o-", label=row)
        right.plot(x, seconds.mean(0).cumsum(0), "o-", label=row)
    left.set(xlabel="task", ylabel="seconds (mean over seeds)", title="time per task")
    right.set(xlabel="task", ylabel="seconds", title="cumulative time")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "time.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
