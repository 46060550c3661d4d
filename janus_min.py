"""Janus-LoRA, minimal: class-incremental learning with a frozen ViT and LoRA on K and V, kept
stable by Online Estimation (OE) and Gradient Rectification (GR), plastic by the Decoupled Margin
Loss (DML).

Read it top-down beside the paper: (1) the method, from train_step, one training step, to what it
calls; (2) our variant of GR and the baselines; (3) the protocol, from a learner's start to a
task's metrics and the paper's analyses; (4) the program around them. Parts 1-3 use nothing
defined in part 4. Equations are numbered as in the paper's LaTeX source.

One run calls, in order: main -> run -> run_seed, which for each task calls start_task,
train_task (a loop of train_step), end_task, evaluate, record_analyses and run's after_task,
which saves the run's state. To read the method, go straight to train_step, part 1's first.

Where the code reads the paper differently, or fills a silence (the README says why):
- The memory. The safe gradient projects with M, the finished tasks' OE bases (the basis memory of
  the paper's Fig. 1), not with the current task's V: projecting out the task's own subspace would
  remove most of its gradient. K and V of a block share their input, and so one M. At the end of
  each task its V, all k columns, joins M (OnlineSubspace.merge): M grows by k columns per task,
  and once a block's M is full (ViT-B at k = 50: at the end of task 16) its K and V learn no more.
  Two other rules are ours and opt-in: --oe-share adds only the directions of V that bring M to
  that share of the task's K/V-input energy, and --memory rolling projects with V itself, one V
  estimating all the tasks' inputs, as the paper's words can be read.
- G is dL/dW of Eq. (12)'s total loss, as Sec. 3 says; the appendix names the task loss's. Eq. (4)
  as printed has the wrong shapes and no s: the chain rule gives s B^T G and s G A^T, which GR's
  Eqs. (6)-(7) take divided by s (rectify_gradients_).
- GR's delta is Appendix B's Tikhonov constant. The paper gives no value: Config says why 1e-6.
- GR hands its factor gradients to Adam, as the paper says. Adam's per-coordinate scaling moves
  the step out of the safe set, and it drops the 1 / ||B|| size of A's step that GR relies on
  (rectify_factors). Ours, --rectify update, rectifies Adam's step instead.
- OE's samples are all the batch's tokens, taken off M: X_p = X (I - M M^T). OE steps after
  Adam's step, on the K/V inputs of the forward pass before it (OnlineSubspace.update).
- OE's step replaces Eq. (9)'s plain gradient step (ours): it is preconditioned by S^-1, with
  S = V^T X_p^T X_p V plus a ridge of 1e-6 of its mean eigenvalue, and its size is eta =
  oe_lr n / (n + t) after t steps, n = --oe-decay-steps: 5 / (5 + t) with the defaults. Eq. (10)'s
  R is taken with a positive diagonal (OnlineSubspace.update, qr_q).
- DML's old prototypes (and the energies of --oe-share) need a pass over each task's training
  images at its end, though the paper calls OE free of offline passes: one forward pass, about
  half an epoch's compute, as a frozen backbone's backward costs about its forward (end_task).
- DML's z is the class token after the final LayerNorm, the heads' input (train_step). The current
  prototypes are the batch's unit class means, each sample in its own class's, and the gradient
  flows through them. So a class with one sample in the batch has z.p = 1: that sample gets no
  pull toward its class, only the push away from the others. The hinge is averaged over the batch
  and the old prototypes, each a finished class's unit mean of the unit features of its training
  images, under the test transform (dml_loss, end_task, class_prototypes).
- LoRA's life: s = 1. Each task starts a fresh pair, A drawn off M and B = 0, and folds s B A into
  W0 at its end (LoRALinear.reset_, merge_). B = 0 is a choice: then A's gradient, s B^T G, is 0,
  and each task's first step changes B alone.
- Under bf16 autocast, A's split off M and OE's products stay in float32, and GR and the small
  systems run in float64 (LoRALinear.forward, rectify_factors, OnlineSubspace.update).
- Ours beside the paper's: GR on Adam's step, --rectify update (rectified_adam_step_); the frozen
  backbone's control, --method frozen; the task-aware accuracy (evaluate); Fig. 2's violation
  made relative, ||dW M|| / ||dW|| (violation).
- The protocol is the InfLoRA codebase's: a head per task, trained by the current head's
  cross-entropy, and the argmax over all heads at test (train_step, evaluate); inputs in [0, 1]
  (Config.input_range); classes in natural order (data.task_classes); a fresh Adam and lr schedule
  per task (adam, lr_factor); GPM's thresholds (end_task, gpm_extend).

References: C. Chen et al., "JANUS-LoRA: A Balanced Low-Rank Adaptation for Continual Learning",
ICML 2026. The protocol is that of the InfLoRA codebase (Liang & Li, CVPR 2024), on which the paper
ran; GPM: Saha et al., ICLR 2021.
"""
import argparse
import contextlib
import copy
import errno
import hashlib
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

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import data
import vit

try:
    import fcntl  # POSIX's file locks (Linux, macOS): one process per seed of a run
except ImportError:  # Windows: runs without the lock
    fcntl = None


def checked(kind, ok, what):
    """The type of a flag: kind(text), which argparse refuses in one line unless it is finite
    and ok."""
    def convert(text):
        value = kind(text)
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{text}: must be {what}")
        return value
    convert.__name__ = kind.__name__  # so that argparse names the type: "invalid int value"
    return convert


POSITIVE = checked(float, lambda v: v > 0, "a positive number")
NON_NEGATIVE = checked(float, lambda v: v >= 0, "a number, 0 or more")
COUNT = checked(int, lambda v: v >= 1, "1 or more")
NATURAL = checked(int, lambda v: v >= 0, "0 or more")
SHARE = checked(float, lambda v: 0 < v <= 1, "a share in (0, 1]")


def device(text):
    """A --device: auto, or a device that torch can use on this machine."""
    if text == "auto":
        return text
    try:
        torch.empty(0, device=text)  # CUDA starts here: a device this machine lacks fails now
    except (RuntimeError, AssertionError) as e:  # no such name, or no such device here
        raise argparse.ArgumentTypeError(f"{text}: {str(e).splitlines()[0]}") from None
    return str(torch.device(text))


def _opt(default, help, **argparse_kw):
    """A configuration field: its default and its --help line (its meaning and source)."""
    return field(default=default, metadata=dict(help=help, **argparse_kw))


@dataclass
class Config:
    """The hyperparameters, each a flag of `python janus_min.py --help`; a field left at None
    takes the data set's value (data.DATASETS). Without --method, the defaults run the paper's
    method, Janus-LoRA."""
    # Data and protocol: the paper's Sec. 4.1, and the InfLoRA codebase, which the paper ran on.
    dataset: str = _opt("cifar100", "data set (Sec. 4.1)", choices=list(data.DATASETS))
    data_dir: str = _opt("data", "folder that holds (or receives) the data set")
    tasks: int = _opt(None, "tasks T (default: CIFAR-100 10, as the paper's)", type=COUNT)
    epochs: int = _opt(None, "epochs per task (default: CIFAR-100 20, ImageNet-R 50, synthetic 5)",
                       type=COUNT)
    batch_size: int = _opt(None, "batch size (default: 128, Sec. 4.1; synthetic 16)", type=COUNT)
    img_size: int = _opt(None, "input resolution (default: 224, the paper's; synthetic 64)",
                         type=COUNT)
    limit_per_class: int = _opt(None, "keep at most this many training images per class (ours)",
                                type=COUNT)
    input_range: str = _opt("unit", "the pixels' range: unit: [0, 1], as InfLoRA's code; half: "
                            "[-1, 1], as Google's checkpoints were trained; imagenet: ImageNet's "
                            "mean and std, as DINO's; checkpoint: the one of --weights",
                            choices=["unit", "checkpoint", "half", "imagenet"])
    # The backbone and its LoRA pairs (Sec. 3.1 and 4.1).
    model: str = _opt("vit_base", "backbone (the paper's: ViT-B/16)", choices=list(vit.PRESETS))
    weights: str = _opt("in21k", "in21k (the paper's), sam, dino (Table 4), none, or a file")
    patch_size: int = _opt(16, "patch size (the paper's: 16; another needs --weights none)",
                           type=COUNT)
    rank: int = _opt(10, "LoRA rank r on K and V (Sec. 4.1); 0: no adapter, only the heads train "
                     "(the frozen-backbone control)", type=NATURAL)
    lora_scale: float = _opt(1.0, "LoRA scale s of Eq. (1) (ours: the paper does not give it)",
                             type=POSITIVE)
    # The method (Sec. 3 and 4.1), and our readings where the paper is silent (the list above).
    method: str = _opt(None, "a method of the paper's tables: its flags, put before yours")
    lr: float = _opt(5e-4, "Adam's learning rate (the InfLoRA codebase's; the paper gives none)",
                     type=POSITIVE)
    schedule: str = _opt("inflora", "lr per epoch: InfLoRA's quarter cosine, or a half cosine",
                         choices=["inflora", "cosine"])
    k: int = _opt(50, "rank k of each block's OE basis V (Sec. 4.1): at the end of each task its k "
                  "columns join the block's memory M", type=COUNT)
    oe_lr: float = _opt(1.0, "OE's first step size eta, at each task's start (the run's, under "
                        "--memory rolling); at 1, a step of subspace iteration (ours)",
                        type=POSITIVE)
    oe_decay_steps: int = _opt(5, "OE's step size halves after this many steps, then decays as "
                               "1 / t (ours)", type=COUNT)
    oe_share: float = _opt(1.0, "ours: V's directions join M only until M holds this share of "
                           "the task's K/V-input energy (1: all k columns, the paper's)",
                           type=SHARE)
    # Appendix B's Tikhonov constant; the paper gives no value. Along a direction of B with singular
    # value sigma, Eq. (6) scales G_safe's part by sigma / (sigma^2 + delta): GR's exact 1 / sigma
    # where sigma^2 >> delta, and at most 1 / (2 sqrt(delta)) where B is weak. "Small": Adam's
    # first step moves each entry of B by about lr, so that sigma^2 is about d_out lr^2, 4.8e-5
    # for ViT-Ti and 1.9e-4 for ViT-B at lr 5e-4; 1e-6 is 50 to 200 times smaller, and damps only
    # B's weakest directions. "Numerical stability": the gain stays below 500, and the float64
    # solves are accurate for any B.
    delta: float = _opt(1e-6, "GR's Tikhonov constant delta of Eqs. (6)-(7) (Appendix B)",
                        type=POSITIVE)
    margin: float = _opt(0.3, "DML's margin m (Sec. 4.1)", type=NON_NEGATIVE)
    lambda_dml: float = _opt(1.0, "DML's weight lambda in Eq. (12) (Sec. 4.1)", type=NON_NEGATIVE)
    tau: float = _opt(0.07, "DML's temperature tau (Sec. 4.1)", type=POSITIVE)
    oe: bool = _opt(True, "Online Estimation and the safe gradient (Table 1's ablation)")
    gr: bool = _opt(True, "Gradient Rectification (Table 1's ablation)")
    dml: bool = _opt(True, "the Decoupled Margin Loss (Table 1's ablation)")
    rectify: str = _opt("grad", "GR on the gradients Adam takes (the paper's) or on Adam's step "
                        "(ours)", choices=["grad", "update"])
    memory: str = _opt("tasks", "memory M: the finished tasks' OE bases (the paper's), OE's V as "
                       "it moves (the paper's words read literally), or GPM's",
                       choices=["tasks", "rolling", "gpm"])
    gpm_threshold: list = _opt(None, "GPM's energy share at task 1 and at the end (InfLoRA's: "
                               "0.95 1, ImageNet-R 0.98 1)", nargs=2, type=SHARE)
    lora_a: str = _opt("trained", "each task's A: trained (the paper's), or off M and frozen "
                       "(InfLoRA)", choices=["trained", "inflora"])
    # The run: these may differ between the parts of a run (its --out follows from the others).
    seeds: list = _opt((0,), "seeds; several give mean +- std (the paper: 5)", nargs="+",
                       type=NATURAL, action="extend")
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N", type=device)
    precision: str = _opt("bf16", "CUDA's: bf16 autocast (ours) or fp32 (InfLoRA's); CPU: fp32",
                          choices=["bf16", "fp32"])
    compile: str = _opt("auto", "the ViT's blocks compiled by torch.compile (ours); auto: on "
                        "for CUDA, off on a CPU", choices=["auto", "on", "off"],
                        nargs="?", const="on")
    workers: int = _opt(None, "loader processes of the file-based data sets (default, and most: "
                        "the cores)", type=NATURAL)
    out: str = _opt(None, "the run's folder (default: runs/<method>-<dataset>-T<tasks>-<a digest "
                    "of the other flags that change results>): the same command continues it")
    resume: str = _opt(None, "continue the run in this folder with its own flags")
    # The other modes.
    benchmark: bool = _opt(False, "time plain LoRA and Janus-LoRA steps, then exit")
    steps: int = _opt(20, "--benchmark: timed rounds (after 5 warm-up steps)", type=COUNT)
    reproduce: str = _opt(None, "run each row of a table or figure of the paper, then table.md")
    row: str = _opt(None, "with --reproduce: run this row alone (one job of an array)")
    dry_run: bool = _opt(False, "with --reproduce: print the rows' commands")


# ==== 1. The method (Sec. 3) ======================================================================
@dataclass
class Learner:
    """What the method carries from one task to the next. During a task each block's M is fixed,
    and the LoRA pairs and OE's V train off it; at its end W0 takes s B A, M takes V, and A, B and
    V start afresh off the new M. Each field is saved and restored whole (learner_state,
    restore): a field added here needs no edit there."""
    model: nn.Module  # the frozen ViT; its K and V layers are LoRALinear, merged at each task's end
    heads: nn.ModuleList  # one linear head per task so far; the last is the current task's
    subspace: "OnlineSubspace"  # OE's basis V of each block; None without OE, or under GPM
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
    # M its block's memory. The forward pass set up the projection (LoRALinear derives it), so
    # the backward pass leaves s B^T G_safe in A.grad and s G_safe A^T in B.grad, not G's.
    opt.zero_grad(set_to_none=True)
    loss.backward()  # Eq. (3): the safe gradient's factor gradients

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
    # off the memory. V joins M at the task's end (the module docstring's first reading says why
    # not sooner). Under --memory rolling, M is V itself, as this step leaves it.
    if learner.subspace is not None:
        learner.subspace.update(kv_inputs, learner.memory)
        if cfg.memory == "rolling":
            give_memory(model, protected(learner, cfg))
    return loss.detach(), (logits.argmax(1) == y).sum()


# ---- LoRA on K and V, and the safe gradient of Theorem 3.1 ---------------------------------------
class LoRALinear(nn.Linear):
    """Eq. (1): a frozen linear layer W0 (the ViT's K or V) plus s B A, with A (r, d_in) and
    B (d_out, r) trained. M (d_in, m) is its block's orthonormal memory, set at each task's start
    (start_task). The gradients are safe, the chain rule's of G_safe = G (I - M M^T), with no G
    formed: forward splits A = A_out + A_in, A_in = A M M^T its part in span(M), and holds A_in
    constant, and B where it multiplies A_in. The output and dL/dx do not change. A's gradient
    flows through A_out = A P alone (P = I - M M^T), so dL/dA = (s B^T G) P = s B^T G_safe; B's
    flows through its copy times A_out, so dL/dB = s G (A P)^T = s G_safe A^T, as P is symmetric.
    The tests check both, and the output and dL/dx against autograd through W0 + s B A. With SGD,
    A then stays off M (reset_ starts it there), so s B A M = 0; Adam's per-coordinate scaling
    moves it into span(M) (the README's two-task test: 0.21 of the update's norm)."""

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
        # Theorem 3.1 through autograd, as the class's docstring derives: A_in and B's copy that
        # multiplies it are held constant. Under bf16, B's gradient is bf16-accurate, which is
        # harmless: while A M = 0, a change of B cannot change dW M = s dB (A M).
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
        if self.A.numel():  # rank 0, no adapter: nothing to draw
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
    sample in its own class's, with the gradient through them (ours: the paper does not say)."""
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
    # GR's Eqs. (6)-(7) use G_safe only through B^T G_safe = A.grad / s and G_safe A^T =
    # B.grad / s, the chain rule's, which autograd left. (Eq. (4) as printed, (dW)^T B and
    # A^T dW, has the shapes wrong and no s.)
    BtG = torch.stack([layer.A.grad for layer in layers]) / s  # B^T G_safe (L, r, d_in)
    GAt = torch.stack([layer.B.grad for layer in layers]) / s  # G_safe A^T (L, d_out, r)
    dA, dB = rectify_factors(BtG, GAt, A, B, s, delta)
    for layer, a, b in zip(layers, dA, dB):
        layer.A.grad.copy_(a)
        layer.B.grad.copy_(b)


def rectify_factors(BtG, GAt, A, B, scale, delta):
    """GR, Eqs. (6)-(7), from B^T G_safe (..., r, d_in) and G_safe A^T (..., d_out, r) alone:
    G_safe itself, d_out x d_in, is never formed. In float64, as the r x r systems can be
    ill-conditioned.

    Why it is right (delta -> 0, G = G_safe, P_B = B (B^T B)^-1 B^T, P_A = A^T (A A^T)^-1 A):
    s B dA = P_B G, R = (I - P_B) G and s dB A = R P_A. The residual (I - P_B) G (I - P_A) is
    orthogonal to every B X + Y A, so this is the exact minimiser of Eq. (5), a linear least
    squares problem in (dA, dB), not the non-convex one the paper names. If A M = 0, then
    P_A M = 0, and as G M = 0 the composite s (B dA + dB A) stays off M.

    What it asks of the optimizer: dA is sized 1 / sigma(B), so that s B dA = P_B G, and B's step
    holds only G's part outside span(B). Adam steps each entry by about lr whatever that size, so
    W moves by about ||B|| lr per step inside span(B). In a one-layer toy, once span(B) holds the
    target's directions, B's gradient vanishes and ||B|| stalls; in the demo's runs ||B|| stays a
    third of Fine-Tuning's, for reasons less certain (the README's "GR under Adam")."""
    dtype = BtG.dtype
    BtG, GAt, A, B = BtG.double(), GAt.double(), A.double(), B.double()
    eye = delta * torch.eye(B.shape[-1], dtype=B.dtype, device=B.device)  # (r, r)
    dA = spd_solve(gram(B) + eye, BtG) / scale  # Eq. (6), with Appendix B's delta
    RAt = GAt - scale * B @ (dA @ A.mT)  # R A^T = G A^T - s B (dA A^T): neither R nor G formed
    # Eq. (7) transposed, dB^T = (A A^T)^-1 (R A^T)^T / s, as spd_solve solves from the left.
    dB = spd_solve(gram(A.mT) + eye, RAt.mT).mT / scale
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
        self.V = fresh_basis([torch.zeros(dim, 0, device=device)] * blocks, k)  # (L, D, k)
        self.t = 0  # the steps so far, the task's (the run's under --memory rolling): eta decays

    @torch.no_grad()
    def update(self, X, memory):
        """One step of OE on each block, a damped block power iteration on the batch's K/V inputs:
        V <- orth((1 - eta) V + eta X_p^T X_p V S^-1), with S = V^T X_p^T X_p V and eta =
        oe_lr n / (n + t) after t steps. It is a step on Eq. (8), (1/2) ||X_p - X_p V V^T||^2,
        preconditioned by S^-1 (ours), as the comment below derives. The samples X_p are all the
        batch's tokens, off the memory: X_p = X (I - M M^T) (ours). X: each block's K/V inputs
        (..., D); memory: each block's M (D, m)."""
        V, M = self.V, stack_blocks(memory)  # (L, D, k), (L, D, m)
        if V.shape[-1] == 0:  # a full memory leaves nothing to learn
            return
        # The derivation. Let C = X_p^T X_p V. Eq. (8)'s gradient is -2 C + C V^T V + V V^T C,
        # which is -(I - V V^T) C where V^T V = I. As M^T V = 0, X_p V = X V, and so S = V^T C.
        # The preconditioned gradient is -(I - V V^T) C S^-1, and V minus eta times it is
        # (1 - eta) V + eta C S^-1, the ridge aside. At eta = 1 that is C S^-1, whose columns span
        # X_p^T X_p V: one step of subspace iteration. As V^T times the preconditioned gradient is
        # 0, V~^T V~ = I + eta^2 (its Gram matrix) >= I, so that qr_q's Cholesky is safe.
        power = []  # per block, X^T X_p V S^-1 (D, k): the power iteration's product
        for x, v in zip(X, V):
            x = x.reshape(-1, v.shape[0]).float()  # (n, D)
            xv = x @ v  # (n, k): X_p V
            S = ridge(gram(xv), 1e-6)  # (k, k); its diagonal: each column's energy
            # S^-1 before X^T: after it, S^-1 would blow X^T's round-off up along the directions
            # where S is singular (a batch of fewer tokens than k), in which the step is 0.
            power.append(x.T @ spd_solve(S, xv.mT.double()).mT.to(x.dtype))
        power = off_span(torch.stack(power), M)  # (I - M M^T) X^T = X_p^T: now C S^-1
        precond_grad = -(power - V @ (V.mT @ power))  # Eq. (8)'s gradient, times S^-1 (ours)
        # eta = oe_lr n / (n + t), 5 / (5 + t) with the defaults (ours): it averages the noise.
        eta = self.lr * self.decay_steps / (self.decay_steps + self.t)
        V_tilde = V - eta * precond_grad  # Eq. (9), its step preconditioned (ours)
        Q = qr_q(V_tilde)  # Eq. (10): V <- Q of V_tilde = QR; ours: R's diagonal > 0, no flips
        self.V = off_span(Q, M)  # off M again, so that no round-off leaks into span(M)
        self.t += 1

    @torch.no_grad()
    def energies(self, X, memory):
        """What merge weighs, per block, over a batch's tokens X (each block's K/V inputs): their
        energy ||X||^2, the part of it in span(M), ||X M||^2, and V^T X^T X V."""
        total, held, S = [], [], []
        for x, v, m in zip(X, self.V, stack_blocks(memory)):
            x = x.flatten(0, -2).float()  # (n, D): the batch's tokens
            xv = x @ v
            total.append(x.square().sum())
            held.append((x @ m).square().sum())
            S.append(xv.T @ xv)
        return torch.stack(total), torch.stack(held), torch.stack(S)

    @torch.no_grad()
    def merge(self, memory, energies=(), share=1.0):
        """A task's end: each block's M takes all of V, the paper's k columns (or fewer, where M
        has no room for k). Ours, with `energies` (a list of energies(), over the task's batches):
        the fewest of V's directions, the most energetic first, that bring the share of the task's
        K/V-input energy in span(M) to `share`. Returns the new memory, and starts a fresh V off
        it for the next task."""
        V = self.V  # (L, D, k)
        n = [min(self.k, M.shape[0] - M.shape[1]) for M in memory]  # V's columns, each block's
        if energies and share < 1:
            total, held, S = (sum(e) for e in zip(*energies))  # (L,), (L,), (L, k, k)
            # V U, U the eigenvectors of S: V's directions, each holding its eigenvalue's energy
            # (V is off M, so a direction adds its energy to that in span(M) whole).
            energy, U = torch.linalg.eigh(S.double())
            energy, U = energy.flip(-1), U.flip(-1)  # the most energetic first
            # Directions join until the energy held plus the energy added reaches share x total:
            # before[i] is the energy in span(M) before direction i joins.
            before = held[:, None] + energy.cumsum(-1) - energy
            wanted = (before < share * total[:, None]).sum(-1).tolist()
            n = [min(j, room) for j, room in zip(wanted, n)]
            V = V @ U.to(V.dtype)
        memory = [torch.linalg.qr(torch.cat([M, v[:, :j]], dim=-1)).Q
                  for M, v, j in zip(memory, V, n)]
        self.V = fresh_basis(memory, self.k)
        return memory


def fresh_basis(memory, k):
    """A random orthonormal V (L, D, k) off each block's memory M (D, m), uniform (Haar) among
    those. A block with room for fewer than k columns, D - m, gets that many, then zero columns;
    a full memory leaves no room at all."""
    M = stack_blocks(memory)  # (L, D, m)
    L, D, _ = M.shape
    room = torch.tensor([min(k, D - m.shape[1]) for m in memory])  # (L,)
    # drawn on the CPU, so that a run's random numbers do not depend on the device
    V = torch.randn(L, D, int(room.max())).to(M.device)
    # Q with R's diagonal > 0, as Gram-Schmidt's: uniform. A QR's Q alone is not (LAPACK's gives
    # R a negative diagonal), and its signs would depend on the device's QR.
    Q, R = torch.linalg.qr(off_span(V, M))
    keep = torch.arange(V.shape[-1]) < room[:, None]  # (L, k): the columns each block has room for
    return Q * (R.diagonal(dim1=-2, dim2=-1).sign() * keep.to(M.device))[..., None, :]


def off_span(V, M):
    """(I - M M^T) V: V's columns without their part in span(M)."""
    return V - M @ (M.mT @ V)


def rows_off_span(G, M):
    """G (I - M M^T): G's rows off span(M), Theorem 3.1's form for a dense G (..., d_out, d_in)."""
    return G - (G @ M) @ M.mT


def stack_blocks(memory):
    """Each block's memory (D, m_i) as one (L, D, m), zero columns padding the narrower ones."""
    m = max(M.shape[1] for M in memory)
    return torch.stack([F.pad(M, (0, m - M.shape[1])) for M in memory])


def qr_q(V):
    """Eq. (10)'s Q of V = QR (..., n, k) with R's diagonal > 0: V^T V = R^T R, so R^T is the
    Cholesky factor of V^T V, and Q = V R^-1. OE's V~^T V~ >= I (OnlineSubspace.update) keeps the
    Cholesky safe; in float64, far faster than QR."""
    G = gram(V)
    G = G + torch.diag_embed((G.diagonal(dim1=-2, dim2=-1) == 0).to(G.dtype))  # a zero column: 0
    R = torch.linalg.cholesky_ex(G).L.mT
    return torch.linalg.solve_triangular(R, V.double(), upper=True, left=False).to(V.dtype)


# ==== 2. Ours and the baselines ===================================================================
# ---- Ours: --rectify update, GR on Adam's step, which Adam's scaling moved off the safe set ------
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
    for _, kv_inputs, _ in batches(model, images, cfg, "the K/V covariance"):
        X = [x.float().flatten(0, 1) for x in kv_inputs]  # (B * (N+1), D) per block
        C = C + torch.stack([x.T @ x for x in X])
        n += X[0].shape[0]
    return C / n


def gpm_extend(M, C, threshold):
    """GPM: M (D, m) plus the fewest leading directions of (I - M M^T) C that bring the captured
    share of C's energy to the threshold; a direction's energy is its squared singular value."""
    C, M64 = C.double(), M.double()  # once per task: float64 keeps the memory orthonormal
    total = torch.linalg.svdvals(C).square().sum()
    U, s, _ = torch.linalg.svd(off_span(C, M64))
    e = s.square() / total  # (D,): each residual direction's share
    before = (1 - e.sum()) + torch.cumsum(e, 0) - e  # the share held before adding direction i
    r = min(int((before < threshold).sum()), C.shape[0] - M.shape[1])  # never past the width
    return torch.cat([M, U[:, :r].to(M.dtype)], dim=1)


def inflora_a(C, M, rank):
    """InfLoRA's A (r, D), off span(M): the top-r left singular vectors of (I - M M^T) C, over
    sqrt(3) as its code scales them."""
    C, M64 = C.double(), M.double()  # float64: the trailing vectors' round-off stays off M
    U = off_span(torch.linalg.svd(off_span(C, M64)).U[:, :rank], M64)
    return (U.T / math.sqrt(3)).to(M.dtype)


# ==== 3. The protocol: InfLoRA's (a head per task, no exemplars, no task id at test) =============
def build_model(cfg):
    """The backbone of cfg.model with LoRA on K and V, loaded from cfg.weights, in eval mode for
    good (the ViT has no dropout)."""
    torch.manual_seed(0)  # with --weights none, one random backbone plays the checkpoint for all
    kv_layer = partial(LoRALinear, rank=cfg.rank, scale=cfg.lora_scale)
    model = vit.PRESETS[cfg.model](img_size=cfg.img_size, patch_size=cfg.patch_size,
                                   kv_layer=kv_layer)
    vit.load_pretrained(model, cfg.weights)
    model.requires_grad_(False)  # frozen: start_task lets the LoRA factors train
    return model.eval()


def compiled(cfg):
    """Whether the ViT's blocks run compiled. --compile auto compiles on CUDA, where a whole run
    gains from it, and not on a CPU, where TorchInductor needs a C++ compiler."""
    return cfg.compile == "on" or (cfg.compile == "auto" and cfg.device.startswith("cuda"))


def start_learner(cfg, seed, backbone):
    """A learner for one seed: a copy of the backbone, fresh LoRA pairs and OE, no memory yet."""
    torch.manual_seed(seed)  # the only generator a run draws from; the loaders seed their own
    model = copy.deepcopy(backbone).to(cfg.device)
    for layer in lora_layers(model):
        layer.reset_()  # the first task's A comes from this seed too
    if compiled(cfg):  # ours: compiled in place, so the checkpoints' names stay the same
        # A block is traced anew for each width of the memory, with and without gradients, before
        # the width becomes a dynamic size: more traces than dynamo's default of 8.
        torch._dynamo.config.cache_size_limit = 64  # recompile_limit's name in every torch >= 2.4
        for block in model.blocks:
            block.compile()
    L, D = len(model.blocks), model.embed_dim
    subspace = None
    if cfg.oe and cfg.memory != "gpm":
        subspace = OnlineSubspace(L, D, cfg.k, cfg.oe_lr, cfg.oe_decay_steps, cfg.device)
    return Learner(model=model, heads=nn.ModuleList(), subspace=subspace,
                   memory=[torch.zeros(D, 0, device=cfg.device)] * L,  # task 1 protects nothing
                   prototypes=torch.zeros(0, D, device=cfg.device))


def new_record(seed):
    """What a seed's run measures, task by task: results.json's entry before its metrics."""
    return {"seed": seed, "acc_matrix": [], "task_aware": [], "sample_acc": [], "task_seconds": [],
            "throughput": [], "violation": {"k": [], "v": []}, "interference": [], "geometry": [],
            "memory": []}


def run_seed(learner, record, splits, cfg, after_task):
    """One seed: every task not finished yet, in turn, measured into `record` (a row of each
    accuracy matrix, and the paper's analyses). after_task(learner, record) is the program's: it
    saves them, before anything reports on them."""
    tasks = data.task_classes(splits.num_classes, cfg.tasks)
    for t in range(len(record["acc_matrix"]), cfg.tasks):
        start = time.time()  # a task's time: training and the method's passes, not the evaluation
        start_task(learner, t, tasks, splits, cfg)
        memory = [layer.M.clone() for layer in lora_layers(learner.model)[::2]]  # what it protects
        record["throughput"].append(train_task(learner, t, tasks, splits, cfg, record["seed"]))
        factors = end_task(learner, t, tasks, splits, cfg)
        record["task_seconds"].append(time.time() - start)
        acc, aware, sample, probed = evaluate(learner, splits, tasks, factors, cfg)
        record["acc_matrix"].append(acc)
        record["task_aware"].append(aware)
        record["sample_acc"].append(sample)
        analyses = record_analyses(record, learner, t, factors, memory, probed, tasks, cfg)
        after_task(learner, record)
        print(f"seed {record['seed']} task {t + 1} accuracy per task: "
              f"{' '.join(f'{a:.2f}' for a in acc)}  | mean {sum(acc) / len(acc):.2f}  | over "
              f"samples {sample:.2f}  | task-aware mean {sum(aware) / len(aware):.2f}  | "
              f"{record['task_seconds'][-1]:.1f} s\n{analyses}", flush=True)


def start_task(learner, t, tasks, splits, cfg):
    """Task t's start: a fresh head, each LoRA layer given the memory it protects; with --lora-a
    inflora, InfLoRA's A, designed from the task's K/V inputs off the memory, and frozen."""
    model = learner.model
    learner.heads.append(nn.Linear(model.embed_dim, len(tasks[t])).to(cfg.device))
    M = protected(learner, cfg)
    give_memory(model, M)
    for layer in lora_layers(model):
        layer.A.requires_grad_(cfg.lora_a == "trained" and cfg.rank > 0)  # InfLoRA: B alone
        layer.B.requires_grad_(cfg.rank > 0)  # rank 0: no adapter, the backbone frozen
    if learner.subspace is not None and cfg.memory == "tasks":  # --memory rolling's V goes on:
        learner.subspace.t = 0  # each task's fresh V starts with large steps
    if cfg.lora_a == "inflora":
        C = kv_covariance(model, data.subset(splits.train_eval, tasks[t]), cfg)  # (L, D, D)
        A = [inflora_a(C_i, M_i, cfg.rank) for C_i, M_i in zip(C, M)]  # K and V share an A
        with torch.no_grad():
            for j, layer in enumerate(lora_layers(model)):
                layer.A.copy_(A[j // 2])


def protected(learner, cfg):
    """Each block's M that its LoRA pairs stay off during a task: the finished tasks' memory; or,
    with --memory rolling (the paper's words read literally), OE's V as it stands now."""
    if cfg.memory == "rolling" and learner.subspace is not None:
        return list(learner.subspace.V)
    return learner.memory


def give_memory(model, memory):
    """Each K/V layer's M: its block's memory, as K and V of block j // 2 share their input."""
    for j, layer in enumerate(lora_layers(model)):
        layer.M = memory[j // 2]


class Diverged(Exception):
    """The loss is no longer finite: the run cannot go on."""


def train_task(learner, t, tasks, splits, cfg, seed):
    """Task t's training: cfg.epochs epochs of train_step, a line per epoch; after the run's first
    epoch, a note of how long the run takes at that speed. Returns the images per second of each
    epoch."""
    local = torch.full((splits.num_classes,), -1, device=cfg.device)  # class id -> head's index
    local[tasks[t]] = torch.arange(len(tasks[t]), device=cfg.device)
    images = data.subset(splits.train, tasks[t])
    # The loader's own generator draws its order, crops and flips.
    loader = data.make_loader(images, cfg.batch_size, True, cfg.workers, seed * 1000 + t,
                              cfg.device)
    opt = adam(learner, cfg)
    speeds = []
    for epoch in range(cfg.epochs):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(epoch, cfg.epochs, cfg.schedule)
        start = time.time()
        loss_sum, correct, seen = 0.0, 0, 0
        for x, y in reported(loader, f"seed {seed} task {t + 1} epoch {epoch + 1}"):
            x, y = x.to(cfg.device, non_blocking=True), local[y.to(cfg.device)]
            loss, right = train_step(learner, opt, x, y, cfg)
            loss_sum = loss_sum + loss * len(y)  # tensors, read once per epoch
            correct = correct + right
            seen += len(y)
        loss = float(loss_sum) / seen
        if not math.isfinite(loss):  # a diverged run must not go on to write results
            raise Diverged(f"task {t + 1} epoch {epoch + 1}: the loss is {loss}: lower --lr (a "
                           "new run, in a folder of its own)")
        speeds.append(seen / (time.time() - start))
        print(f"seed {seed} task {t + 1}/{cfg.tasks} epoch {epoch + 1}/{cfg.epochs}  loss "
              f"{loss:.4f}  train acc {100.0 * float(correct) / seen:5.2f}%  "
              f"{speeds[-1]:7.1f} img/s", flush=True)
        if t == 0 and epoch == 0 and seed == cfg.seeds[0]:  # a ViT-B on a CPU takes days
            print(estimate(speeds[-1], splits, cfg), flush=True)
    return speeds


def estimate(speed, splits, cfg):
    """How long the run takes at `speed` images per second: its training, and at most as long
    again per image for its passes without gradients (a forward pass costs less than a step):
    each task's end, and the evaluation and analyses of the seen tasks' test images."""
    counts = torch.bincount(torch.tensor(splits.test.targets), minlength=splits.num_classes)
    test = int(counts.view(cfg.tasks, -1).sum(1).cumsum(0).sum())  # the seen tasks' after each
    trained, passes = cfg.epochs * len(splits.train), len(splits.train) + test
    return (f"note: at {speed:.1f} img/s on {cfg.device}, the run takes about "
            f"{duration(len(cfg.seeds) * trained / speed)} to train ({cfg.epochs} epoch(s) of "
            f"{len(splits.train)} images, {len(cfg.seeds)} seed(s)), and at most "
            f"{duration(len(cfg.seeds) * passes / speed)} more for {passes} images per seed "
            "without gradients (the ends of tasks, the evaluations and analyses)")


def reported(loader, what):
    """The loader's batches, with a line every 30 s that says how far `what` has come."""
    start = last = time.time()
    for i, batch in enumerate(loader, 1):
        yield batch
        if time.time() - last > 30:
            last = time.time()
            print(f"  {what}: {i} of {len(loader)} batches in {duration(last - start)}", flush=True)


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
    merging = cfg.oe and cfg.memory == "tasks"  # V joins M at the task's end
    weighed = merging and cfg.oe_share < 1  # ours: the energies that --oe-share weighs
    measure = (lambda X, y: learner.subspace.energies(X, learner.memory)) if weighed else None
    z, y, energies = features(learner.model, images, cfg, measure, f"the end of task {t + 1}")
    learner.prototypes = torch.cat([learner.prototypes, class_prototypes(z, y, tasks[t])])
    if merging:  # V joins the memory: its k columns, or (ours) as many as --oe-share asks
        learner.memory = learner.subspace.merge(learner.memory, energies, cfg.oe_share)
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
def evaluate(learner, splits, tasks, factors, cfg):
    """One pass over the seen tasks' test images: row t of the accuracy matrices, task-agnostic
    (InfLoRA's: the argmax over all heads) and task-aware (ours: the true task's head); the
    accuracy over the samples; and for the analyses, the change that the task's factors made to
    the K/V outputs (from task 2 on), and the current task's z and y."""
    heads, t = learner.heads, len(learner.heads) - 1
    seen = torch.tensor([c for classes in tasks[:t + 1] for c in classes], device=cfg.device)
    change = partial(output_change, factors=factors, current=tasks[t], scale=cfg.lora_scale)
    z, y, changes = features(learner.model, data.subset(splits.test, seen.tolist()), cfg,
                             change if t and factors else None, "the evaluation and analyses")
    task_of = torch.empty(int(seen.max()) + 1, dtype=torch.long, device=cfg.device)
    for i, classes in enumerate(tasks[:len(heads)]):
        task_of[classes] = i
    logits = torch.cat([head(z) for head in heads], dim=1)  # (n, seen classes), in `seen`'s order
    other_task = task_of[seen][None, :] != task_of[y][:, None]  # (n, seen classes)
    agnostic = seen[logits.argmax(1)]
    aware = seen[logits.masked_fill(other_task, -math.inf).argmax(1)]
    rows = [[100.0 * float((pred == y)[task_of[y] == i].float().mean()) for i in range(t + 1)]
            for pred in (agnostic, aware)]
    now = task_of[y] == t
    energy = sum(e for e, _ in changes) / sum(n for _, n in changes) if changes else None
    return rows[0], rows[1], 100.0 * float((agnostic == y).float().mean()), (energy, z[now], y[now])


@torch.no_grad()
def features(model, images, cfg, measure=None, what="a pass"):
    """z (n, D) and the labels y (n,) of the images, in their order; and, if given, measure(K/V
    inputs, y) of each batch."""
    zs, ys, measured = [], [], []
    for z, kv_inputs, y in batches(model, images, cfg, what):
        zs.append(z)
        ys.append(y)
        if measure is not None:
            measured.append(measure(kv_inputs, y))
    return torch.cat(zs), torch.cat(ys), measured


def batches(model, images, cfg, what="a pass"):
    """(z, K/V inputs, y) of each batch of the images in order, under the run's autocast."""
    loader = data.make_loader(images, cfg.batch_size, False, cfg.workers, 0, cfg.device)
    for x, y in reported(loader, f"{what} over {len(images)} images"):
        x = x.to(cfg.device)
        with torch.autocast(x.device.type, torch.bfloat16,
                            enabled=x.is_cuda and cfg.precision == "bf16"):  # as train_step
            z, kv_inputs = model.encode(x)
        yield z.float(), kv_inputs, y.to(cfg.device)


def acc_maa_bwt(acc):
    """ACC, MAA, BWT (Sec. 4.1) of acc[t][i], the accuracy (%) on task i after task t (i <= t is
    read); BWT is undefined (None) with one task."""
    T = len(acc)
    maa = sum(sum(acc[t][: t + 1]) / (t + 1) for t in range(T)) / T
    bwt = sum(acc[T - 1][i] - acc[i][i] for i in range(T - 1)) / (T - 1) if T > 1 else None
    return sum(acc[T - 1][:T]) / T, maa, bwt


# What a run reports of each seed, from its record: name: (its value, its format, what it is). The
# summary, results.json, table.md and its note read this table: a metric is one entry.
METRICS = {
    "ACC": (lambda r: acc_maa_bwt(r["acc_matrix"])[0], ".2f", "Sec. 4.1's, task-agnostic as the "
            "paper's (the argmax over all seen tasks' heads): the mean accuracy (%) on all tasks "
            "after the last"),
    "MAA": (lambda r: acc_maa_bwt(r["acc_matrix"])[1], ".2f", "Sec. 4.1's: the mean over the "
            "tasks of the mean accuracy on the tasks seen"),
    "BWT": (lambda r: acc_maa_bwt(r["acc_matrix"])[2], ".2f", "Sec. 4.1's: the mean change of a "
            "task's accuracy from its end to the run's (< 0: forgetting)"),
    "task-aware ACC": (lambda r: acc_maa_bwt(r["task_aware"])[0], ".2f", "ours: ACC with the "
                       "true task's head alone"),
    "task-aware BWT": (lambda r: acc_maa_bwt(r["task_aware"])[2], ".2f", "ours: BWT with the "
                       "true task's head alone"),
    "sample ACC": (lambda r: r["sample_acc"][-1], ".2f", "InfLoRA's logs': the accuracy over all "
                   "test samples after the last task"),
    "past change": (lambda r: mean([v for i in r["interference"] if i for v in i["past"]]), ".3g",
                    "Fig. 2 on real inputs: the RMS change that each task's update makes to the "
                    "K/V outputs of the past tasks' test images (the mean over tasks 2..T and the "
                    "K/V layers)"),
    "current change": (lambda r: mean([v for i in r["interference"] if i for v in i["current"]]),
                       ".3g", "the same of the current task's test images: the method keeps the "
                       "past change small, not this one"),
    "violation": (lambda r: mean([v for n in "kv" for vs in r["violation"][n] for v in vs]), ".2e",
                  "Fig. 2: the share of each update on the memory M, ||dW M|| / ||dW||"),
    "danger": (lambda r: mean([g["danger"] for g in r["geometry"] if g]), ".3f", "Fig. 3: the "
               "share of the test images with a cosine above 0.5 to an old class's prototype"),
    "M width": (lambda r: mean(r["memory"][-1]), ".1f", "the columns of a block's memory M after "
                "the last task, the mean over the blocks"),
    "s / task": (lambda r: mean(r["task_seconds"]), ".1f", "a task's training time, with the "
                 "method's own passes, without evaluation"),
}


# ---- The paper's analyses after each task: the null-space violation against the memory and on
# real activations (Fig. 2), DML's geometry (Fig. 3 and the appendix's density) --------------------
def record_analyses(record, learner, t, factors, memory, probed, tasks, cfg):
    """Task t's analyses into record, and their line; factors: its (A, B) per layer; memory: the
    M it protected; probed: evaluate's output change, and the current task's test z and y."""
    for j, name in enumerate("kv"):  # factors[j::2]: each block's K (j = 0) or V (j = 1) pair
        pairs = zip(factors[j::2], memory)
        record["violation"][name].append([violation(A, B, M) for (A, B), M in pairs])
    record["memory"].append([M.shape[1] for M in protected(learner, cfg)])  # the next task's M
    lo, hi = min(record["memory"][-1]), max(record["memory"][-1])
    width = str(lo) if lo == hi else f"{lo}-{hi}"
    line = (f"seed {record['seed']} task {t + 1} analyses: M holds {width} of "
            f"{learner.model.embed_dim} columns per block")
    if full := record["memory"][-1].count(learner.model.embed_dim):  # blocks with all D columns
        line += (f" ({full} of {len(record['memory'][-1])} blocks full: their K and V learn "
                 f"nothing from task {t + 2} on)")
    if t == 0:  # no past tasks, no old prototypes
        record["interference"].append(None)
        record["geometry"].append(None)
        return line
    energy, z, y = probed
    past, now = energy.sqrt().tolist()
    record["interference"].append({"past": past, "current": now})
    record["geometry"].append(dml_geometry(z, y, learner.prototypes, tasks[t][0]))
    violations = [fmt(mean(record["violation"][n][-1]), ".2e") for n in "kv"]
    danger = 100 * record["geometry"][-1]["danger"]
    return (f"{line}; its K/V update changed the outputs of the past tasks' test images by "
            f"{mean(past):.3g} (RMS), its own by {mean(now):.3g} (Fig. 2); ||dW M|| / ||dW|| "
            f"{violations[0]} (K), {violations[1]} (V); {danger:.1f}% of its test images in "
            "DML's danger zone, a cosine above 0.5 to an old class (Fig. 3)")


@torch.no_grad()
def violation(A, B, M):
    """||dW M||_F / ||dW||_F of a task's update dW = s B A, never forming dW; None where it is
    undefined (no memory yet, or no update, as under a full memory)."""
    den = ((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt()  # ||B A||_F^2 = tr(B^T B A A^T)
    if M.shape[1] == 0 or den == 0:
        return None
    return float((B @ (A @ M)).norm() / den)


@torch.no_grad()
def output_change(kv_inputs, y, factors, current, scale):
    """Fig. 2 on real activations, over one batch: per K/V layer, the sums of ||x dW^T||^2,
    dW = s B A of the factors, over the past tasks' tokens x and over the current task's, (2,
    layers), and their numbers of tokens (2, 1). x: the K/V inputs of the model after the task
    (merged), not of the model that learned the past tasks."""
    now = (y[:, None] == torch.tensor(current, device=y.device)).any(1)  # (B,)
    e = []
    for j, (A, B) in enumerate(factors):  # K and V of block j // 2 share its input
        u = kv_inputs[j // 2].float() @ A.T  # (B, N+1, r)
        e.append(scale ** 2 * ((u @ (B.T @ B)) * u).sum((1, 2)))  # per image
    e = torch.stack(e, 1)  # (B, layers)
    tokens = torch.stack([(~now).sum(), now.sum()])[:, None] * kv_inputs[0].shape[1]
    return torch.stack([e[~now].sum(0), e[now].sum(0)]), tokens


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
    """A time span in the largest unit of which at least two have passed: 45 s, 2.5 min,
    6.1 days."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


# ==== 4. The program: flags, a run's folder and state, outputs, --reproduce, --benchmark =========
# --method NAME: its flags, and its name in the paper's tables.
METHODS = {"janus": ("", "Janus-LoRA"),
           "frozen": ("--rank 0 --no-oe --no-gr --no-dml", "the frozen backbone, heads alone "
                      "(the control of SimpleCIL, Zhou et al. 2023; ours)"),
           "janus-update": ("--rectify update", "Janus-LoRA, GR on Adam's step (ours)"),
           "janus-rolling": ("--memory rolling", "Janus-LoRA, M = V"),
           "finetune": ("--no-oe --no-gr --no-dml", "Fine-Tuning"),
           "lora-gpm": ("--memory gpm --no-gr --no-dml", "LoRA-GPM"),
           "lora-gpm-gr": ("--memory gpm --no-dml", "LoRA-GPM + GR"),
           "inflora": ("--memory gpm --lora-a inflora --no-gr --no-dml", "InfLoRA")}
# The flags that change no result: the machine's, where the data lie, which seeds (a run keeps
# each seed's numbers apart) and the modes. Another value of any other flag makes another run.
FREE = ("data_dir", "seeds", "device", "workers", "compile", "out", "resume", "method",
        "benchmark", "steps", "reproduce", "row", "dry_run")
EXAMPLES = """examples:
  python janus_min.py --reproduce demo --dataset synthetic --model vit_tiny --weights none
  python janus_min.py --dataset cifar100 --seeds 0 1 2 3 4   # again after a stop: it continues
  python janus_min.py --reproduce ablation --dataset imagenet-r --dry-run"""


class RunError(Exception):
    """Flags that cannot run together, or a run folder or file that cannot be used."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors in one line: --help gives the usage."""

    def error(self, message):
        self.exit(2, f"error: {message} (--help lists the flags)\n")


def flag(name):
    return "--" + name.replace("_", "-")


def parser():
    """The parser of Config's fields; what it returns holds only the flags typed."""
    p = Parser(prog="janus_min.py", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
               argument_default=argparse.SUPPRESS, allow_abbrev=False,  # --seed is no --seeds
               formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Config):
        kw = dict(f.metadata)
        if f.name in ("method", "reproduce"):
            kw["choices"] = METHODS if f.name == "method" else REPRODUCE
        if f.type is bool:  # a switch: --NAME and --no-NAME
            kw.update(action=argparse.BooleanOptionalAction,
                      help=kw["help"] + f" (default: {'on' if f.default else 'off'})")
        else:
            kw.setdefault("type", f.type)
            default = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            kw["help"] += "" if f.default is None else f" (default: {default})"
        p.add_argument(flag(f.name), **kw)
    return p


def parse(argv):
    """Every flag's value, the typed flags over their --method's preset; and the flags typed."""
    typed = vars(parser().parse_args(argv))
    preset = METHODS[typed["method"]][0].split() if "method" in typed else []
    return {**vars(parser().parse_args(preset)), **typed}, typed


def configure(argv=None):
    """argv's Config, filled in; with --resume DIR, the run's own flags under those typed."""
    values, typed = parse(argv)
    if "resume" in typed:
        if not (found := list(states(typed["resume"]))):
            raise RunError(f"--resume {typed['resume']}: no seed's state (seed<N>.pt) in that "
                           "folder")
        seeds = sorted({seed for state in found for seed in state["config"]["seeds"]})
        values = {**found[0]["config"], "seeds": seeds, **typed, "out": typed["resume"]}
    cfg = Config(**values)
    defaults = {k: v for k, v in data.DATASETS[cfg.dataset].items() if getattr(cfg, k, 0) is None}
    gpm = [0.98 if cfg.dataset == "imagenet-r" else 0.95, 1.0]  # InfLoRA's configs
    cores = os.cpu_count() or 1
    cfg = replace(cfg, **defaults, seeds=list(cfg.seeds), gpm_threshold=cfg.gpm_threshold or gpm,
                  workers=min(cores, cores if cfg.workers is None else cfg.workers))
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    check(cfg)
    if cfg.out is None:  # the same flags, the same folder: the same command continues its run
        changed = {k: v for k, v in result_values(asdict(cfg)).items() if v != getattr(Config, k)}
        digest = hashlib.sha256(json.dumps(changed).encode()).hexdigest()[:6]  # a new flag: none
        name = cfg.reproduce or method_of(asdict(cfg))
        cfg.out = os.path.join("runs", f"{name}-{cfg.dataset}-T{cfg.tasks}-{digest}")
    return cfg


def check(cfg):
    """Refuse in one line the flags that would run only to fail late or silently."""
    width = vit.PRESETS[cfg.model].keywords["embed_dim"]
    rows = REPRODUCE[cfg.reproduce][1] if cfg.reproduce else {}
    for ok, said in (
            (max(cfg.rank, cfg.k) <= width, f"--rank, --k: at most {cfg.model}'s width, {width}"),
            (cfg.img_size % cfg.patch_size == 0, "--img-size: a multiple of --patch-size"),
            (cfg.lora_a == "trained" or not cfg.gr, "--lora-a inflora freezes A, which GR "
             "trains: add --no-gr"),
            (cfg.rank > 0 or not cfg.gr, "--rank 0 trains no adapter for GR to rectify: add "
             "--no-gr"),
            (len(set(cfg.seeds)) == len(cfg.seeds), "--seeds: name each seed once"),
            (cfg.reproduce or not (cfg.row or cfg.dry_run), "--row and --dry-run go with "
             "--reproduce NAME"),
            (cfg.row in (None, *rows), f"--row {cfg.row}: not a row of --reproduce "
             f"{cfg.reproduce} ({', '.join(rows)})"),
            (cfg.dataset == "synthetic" or os.path.isdir(cfg.data_dir) or cfg.data_dir ==
             Config.data_dir, f"--data-dir {cfg.data_dir}: no such folder (the default, "
             f"{Config.data_dir}, is made for a download)"),
            (cfg.input_range != "checkpoint" or cfg.weights in vit.PRETRAINED_INPUT,
             "--input-range checkpoint needs a named --weights (for a file: half or imagenet)")):
        if not ok:
            raise RunError(said)
    data.task_classes(data.DATASETS[cfg.dataset]["num_classes"], cfg.tasks)  # T divides them


def result_values(config):
    """A config's values that change results: not FREE's; a weights file by its name alone."""
    return {k: os.path.basename(v) if k == "weights" else v for k, v in config.items()
            if k not in FREE}


@cache  # METHODS and Config do not change while the program runs
def presets():
    """Each --method's value of every flag that a --method sets: what tells the methods apart."""
    typed = {name: parse(flags.split())[1] for name, (flags, _) in METHODS.items()}
    flags = {k for t in typed.values() for k in t}
    return {name: {k: t.get(k, getattr(Config, k)) for k in flags} for name, t in typed.items()}


def method_of(config):
    """The --method whose flags a config (a dict) has, or 'custom'."""
    return next((name for name, values in presets().items()
                 if all(config[k] == v for k, v in values.items())), "custom")


def precision(cfg):
    """What the numbers run in: bf16 autocast is CUDA's, so a CPU runs in fp32."""
    return f"{cfg.device} {cfg.precision if cfg.device.startswith('cuda') else 'fp32'}"


# ---- A run: its folder, with a state file per seed, held by the process that runs the seed ------
STATE = ("config", "record", "learner", "rng")  # what a seed's state file holds, after each task


def seed_file(folder, seed):
    return os.path.join(folder, f"seed{seed}.pt")


@contextlib.contextmanager
def locked(path, wait=False):
    """The file at path, held by flock, which the system releases however the process ends.
    Where another process holds it: BlockingIOError at once, or with wait, a wait for it."""
    with open(path, "w") as lock:
        if fcntl:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        yield


def read_state(path, device="cpu"):
    """A seed's state, None where it has none."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 -- torch's unpickler fails in many ways on a bad file
        state = e
    if not isinstance(state, dict) or not set(STATE) <= state.keys():
        raise RunError(f"{path} is no seed's state of janus_min.py ({type(state).__name__}): move "
                       "it away, and that seed starts again")
    return state


def states(folder):
    """The state of each seed in a run folder, by seed, on the CPU, each read when it is reached."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    seeds = sorted(int(m[1]) for name in names if (m := re.fullmatch(r"seed(\d+)\.pt", name)))
    return (read_state(seed_file(folder, seed)) for seed in seeds)


def written(path, content):
    """A text or a state, written whole or not at all: to a temporary file, then renamed. A state
    is serialised first, so that a failed write says the system's reason (torch.save hides it)."""
    if not isinstance(content, str):
        buffer = io.BytesIO()
        torch.save(content, buffer)
        content = buffer.getvalue()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w" if isinstance(content, str) else "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    except OSError as e:  # named by the file that was to be written, not by its temporary one
        raise OSError(e.errno, e.strerror, path) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def run(cfg):
    """A run: each of its seeds that no other process runs, from the last task that its state
    file holds, its state saved after each task; then the outputs, from every finished seed's
    state in the folder, whichever process ran it."""
    os.makedirs(cfg.out, exist_ok=True)
    if state := next(states(cfg.out), None):  # a folder that holds a run of other flags: refused
        saved = result_values({**asdict(Config()), **state["config"]})
        ours = result_values(asdict(cfg))
        if other := [f"{flag(k)} {saved[k]} (not {ours[k]})" for k in ours if saved[k] != ours[k]]:
            raise RunError(f"{cfg.out} holds a run of {', '.join(other)}: choose another --out")
    load = cache(partial(load_data_and_backbone, cfg))  # loaded when a seed first needs them
    for seed in cfg.seeds:
        try:
            with locked(seed_file(cfg.out, seed) + ".lock"):
                run_one(cfg, seed, load)
        except BlockingIOError:  # one job of an array over the seeds: another runs this one
            print(f"seed {seed}: another process runs it: left to it", flush=True)
    with locked(os.path.join(cfg.out, "lock"), wait=True):  # the last writer sees every seed
        write_outputs(cfg)
    return 0


def run_one(cfg, seed, load):
    """One seed, from the last task saved in its state file (a finished seed is skipped); the
    state keeps the learner when the seed ends."""
    path = seed_file(cfg.out, seed)
    state = read_state(path, cfg.device)
    if state and len(state["record"]["acc_matrix"]) == cfg.tasks:
        return
    splits, backbone = load()
    learner, record = start_learner(cfg, seed, backbone), new_record(seed)
    if state:
        record = restore(learner, state)
        print(f"seed {seed}: continued after task {len(record['acc_matrix'])}")

    def save(learner, record):
        written(path, {"config": asdict(cfg), "record": record, "rng": torch.get_rng_state(),
                       "learner": learner_state(learner)})
    run_seed(learner, record, data.thin(splits, cfg.limit_per_class, seed), cfg, save)


def load_data_and_backbone(cfg):
    """A run's data and backbone, and its first lines."""
    kind = vit.PRETRAINED_INPUT[cfg.weights] if cfg.input_range == "checkpoint" else cfg.input_range
    splits = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.img_size,
                               *vit.MEAN_STD.get(kind, (0.0, 1.0)))  # unit: [0, 1] as it is
    backbone = build_model(cfg)
    print(f"{cfg.dataset}, T = {cfg.tasks}, {method_of(asdict(cfg))}, {precision(cfg)}: "
          f"{cfg.out}", flush=True)
    return splits, backbone


def learner_state(learner):
    """Each field of a learner as its state keeps it, for restore: the model by its K/V layers
    (W0 with each task's update, A and B: the rest is the checkpoint's), the heads by their
    tensors, OE by its attributes, and any other field as it is, so that a field added to Learner
    is kept with no edit here."""
    state = {f.name: getattr(learner, f.name) for f in fields(learner)}
    state["model"] = nn.ModuleList(lora_layers(learner.model)).state_dict()
    state["heads"] = [head.state_dict() for head in learner.heads]
    if learner.subspace is not None:
        state["subspace"] = vars(learner.subspace)
    return state


def restore(learner, state):
    """A seed's learner as after the last task of its state, each field as learner_state keeps
    it; returns the seed's record."""
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


# ---- The outputs: results.json, table.md (the summary) and the paper's figures -------------------
def summarize(runs):
    """Each metric's mean and sample std (n - 1) over the seeds; None where undefined."""
    values = {name: [r["metrics"][name] for r in runs] for name in METRICS}
    return {name: {"mean": None if None in v else statistics.fmean(v),
                   "std": None if None in v or len(v) < 2 else statistics.stdev(v)}
            for name, v in values.items()}


def finished(folder):
    """A run folder's config and its finished seeds' records, each with its metrics."""
    done = [s for s in states(folder) if len(s["record"]["acc_matrix"]) == s["config"]["tasks"]]
    runs = [dict(s["record"], metrics={k: f(s["record"]) for k, (f, _, _) in METRICS.items()})
            for s in done]
    return (done[0]["config"] if done else None), runs


def write_outputs(cfg):
    """results.json, table.md and the run's figures (Figs. 2, 3 and 5), from the finished seeds'
    states in its folder."""
    _, runs = finished(cfg.out)
    if not runs:
        return
    c = dict(asdict(cfg), seeds=[r["seed"] for r in runs])
    env = {"torch": torch.__version__, "torchvision": torchvision.__version__,
           "precision": precision(cfg), "device": torch.cuda.get_device_name(cfg.device)
           if cfg.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"}
    results = {"config": c, "environment": env, "runs": runs, "summary": summarize(runs)}
    written(os.path.join(cfg.out, "results.json"), json.dumps(results, indent=1))
    name = method_of(c)
    rows = {name: dict(results, flags=f"--method {name}" if name in METHODS else "custom")}
    title = f"{c['dataset']}, T={c['tasks']}, {name}"
    paths = [write_table(cfg.out, rows, title), *draw(cfg.out, RUN_FIGURES, rows, title)]
    print(f"wrote {os.path.join(cfg.out, 'results.json')} {' '.join(paths)}")


def write_table(out, rows, title, missing=()):
    """table.md: each row's metrics, the mean ± the sample std over the seeds it names, and what
    each metric is."""
    lines = [f"# {title}" + (f" (not finished, left out: {', '.join(missing)})" * bool(missing)),
             "", "| row | flags | seeds | " + " | ".join(METRICS) + " |",
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


# ---- The paper's figures, from rows {name: {"flags", "config", "runs"}}: a run is one row --------
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
    """Fig. 5: each row's mean accuracy on the tasks seen after each task, task-agnostic (the
    paper's) and task-aware, the mean over its seeds in a band of ± their sample std; beside it
    Fig. 2 on real inputs: the change of the past tasks' K/V outputs (filled) and of the current
    task's (hatched), on a log scale, as they differ by orders of magnitude (no bar: no change)."""
    *axes, bars = fig.subplots(1, 3, width_ratios=(3, 3, 2))
    for i, (name, row) in enumerate(rows.items()):
        for ax, key in zip(axes, ("acc_matrix", "task_aware")):
            seen = torch.tensor([[sum(a) / len(a) for a in r[key]] for r in row["runs"]])
            x, m = range(1, seen.shape[1] + 1), seen.mean(0)
            ax.plot(x, m, f"{'osD^v<>ph*'[i % 10]}-C{i % 10}", mfc="none", label=name)
            if len(seen) > 1:  # the sample std needs two seeds
                ax.fill_between(x, m - seen.std(0), m + seen.std(0), color=f"C{i % 10}", alpha=0.2)
            ax.set(xlabel="after task", xticks=x, ylabel="mean accuracy on the tasks seen (%)")
        change = [summarize(row["runs"])[k]["mean"] for k in ("past change", "current change")]
        bars.bar([i - 0.2, i + 0.2], [nan(c or None) for c in change], 0.4, color=f"C{i % 10}",
                 hatch=["", "//"], edgecolor="k")
    axes[0].set_title("task-agnostic (the paper's): the argmax over all heads", fontsize=9)
    axes[1].set_title("task-aware (ours): the true task's head", fontsize=9)
    bars.set(yscale="log", ylabel="RMS change of the K/V outputs")
    bars.set_xticks(range(len(rows)), list(rows), rotation=20)  # level, long names would meet
    bars.set_title("Fig. 2 on real inputs: the past tasks'\n(filled), the current task's (hatched)",
                   fontsize=9)


def plot_analyses(fig, rows):
    """Figs. 2 and 3 of a run's first seed: per block, the share of each task's K and V update on
    the memory, ||dW M|| / ||dW||, the mean over tasks 2..T; and the last task's test images by
    their cosine to the nearest old class's prototype and to their own class's."""
    r = next(iter(rows.values()))["runs"][0]
    *kv, angular = fig.subplots(1, 3)
    for ax, n, colour in zip(kv, "kv", ("C0", "C1")):
        means = [mean(block) for block in zip(*r["violation"][n])]
        ax.bar(range(len(means)), [nan(m) for m in means], color=colour)
        ax.set(xlabel="block", ylabel="||dW M|| / ||dW||", title=f"Fig. 2, {n.upper()} (no bar: "
               "no memory)")
    for t, g in [(t, g) for t, g in enumerate(r["geometry"], 1) if g][-1:]:  # none in task 1
        angular.scatter(g["cos_old"], g["cos_own"], s=6, alpha=0.5, label=f"task {t}'s images")
        angular.axvline(0.5, color="r", ls="--", label=f"danger (cos_old > 0.5): {g['danger']:.3f}")
    angular.set(xlabel="cos_old: to the nearest old prototype", ylabel="cos_own: to its own",
                title="Fig. 3: the last task's test images")


def plot_gr_plugin(fig, rows):
    """Fig. 6: ACC, MAA and BWT of each row (before GR, then after), the mean over its seeds, ±
    their sample std, its value above it."""
    for ax, metric in zip(fig.subplots(1, 3), ("ACC", "MAA", "BWT")):
        stats = [summarize(row["runs"])[metric] for row in rows.values()]
        bars = ax.bar(list(rows), [nan(s["mean"]) for s in stats], capsize=4,
                      yerr=[s["std"] or 0 for s in stats], color=["C0", "C1"])
        ax.bar_label(bars, [fmt(s["mean"]) for s in stats], padding=3)
        ax.set(title=metric, ylabel="points (< 0: forgetting)" if metric == "BWT" else "%")


def plot_sweep(fig, rows):
    """Fig. 4a, 4b and the appendix's lambda figure: ACC and MAA, and BWT, over the value that the
    rows sweep, the mean over the seeds with ± their sample std as error bars."""
    key = next(iter(parse(next(iter(rows.values()))["flags"].split())[1]))  # the row's one flag
    x = [row["config"][key] for row in rows.values()]
    stats = [summarize(row["runs"]) for row in rows.values()]
    for ax, metrics in zip(fig.subplots(1, 2), (("ACC", "MAA"), ("BWT",))):
        for metric in metrics:
            ax.errorbar(x, [nan(s[metric]["mean"]) for s in stats], capsize=4, marker="o",
                        yerr=[s[metric]["std"] or 0 for s in stats], label=metric)
        ax.set(xlabel=flag(key), xticks=x, ylabel="points" if metric == "BWT" else "%")


def plot_efficiency(fig, rows):
    """The appendix's efficiency figures: each row's training time per task, the cumulative time
    and each epoch's throughput over the run, the mean over its seeds."""
    axes = fig.subplots(1, 3)
    for i, (name, row) in enumerate(rows.items()):
        seconds = torch.tensor([r["task_seconds"] for r in row["runs"]]).mean(0)  # (T,)
        speeds = torch.tensor([sum(r["throughput"], []) for r in row["runs"]]).mean(0)  # (T E,)
        for ax, y in zip(axes, (seconds, seconds.cumsum(0), speeds)):
            ax.plot(range(1, len(y) + 1), y, f"{'osD^v<>ph*'[i % 10]}-C{i % 10}", mfc="none",
                    label=name)
    labels = [("training time per task", "task", "s"), ("cumulative training time", "task", "s"),
              ("throughput", "epoch of the run", "images / s")]
    for ax, (title, x, y) in zip(axes, labels):
        ax.set(title=title, xlabel=x, ylabel=y)


def nan(value):
    """A value for matplotlib: None (undefined) as NaN, which matplotlib leaves out."""
    return math.nan if value is None else value


FIG5 = {"trajectories.png": ("Fig. 5: the mean accuracy on the tasks seen; Fig. 2 on real inputs",
                             plot_trajectories)}
RUN_FIGURES = {**FIG5, "analyses.png": ("Figs. 2 and 3: the null-space violation and DML's "
                                        "geometric effect", plot_analyses)}


# ---- --reproduce: every row of a table or figure of the paper, in one command --------------------
# NAME: (what it reproduces, {row: its flags}, its figures); the sweeps take the values that the
# paper's text gives
REPRODUCE = {
    "demo": ("the quick start (ours): Janus-LoRA beside the frozen backbone and Fine-Tuning",
             {m: f"--method {m}" for m in ("frozen", "finetune", "janus")}, FIG5),
    "ablation": ("Table 1: OE, GR, DML on and off (rows 1-7)", dict(zip("1234567", [
        "--no-oe --no-gr --no-dml", "--no-oe --no-gr", "--no-gr --no-dml", "--no-oe --no-dml",
        "--no-dml", "--no-gr", ""])), FIG5),
    "methods": ("Tables 2 and 3: the methods we implement",
                {m: f"--method {m}" for m in ("frozen", "finetune", "lora-gpm", "inflora",
                                              "janus")}, FIG5),
    "oe-vs-gpm": ("Table 5: OE against GPM in one epoch (Janus-LoRA otherwise; our reading)",
                  {"gpm": "--memory gpm --epochs 1", "oe": "--epochs 1"},
                  {"efficiency.png": ("the appendix's efficiency figures: the time per task, the "
                                      "cumulative time, the throughput", plot_efficiency)}),
    "gr-plugin": ("Fig. 6: GR as a plug-in to LoRA-GPM",
                  {m: f"--method {m}" for m in ("lora-gpm", "lora-gpm-gr")},
                  {"gr_plugin.png": ("Fig. 6: before and after GR", plot_gr_plugin)}),
    "k": ("Fig. 4a: the rank k of the OE basis", {f"k{v}": f"--k {v}" for v in (25, 50, 75, 100)},
          {"sweep.png": ("Fig. 4a: ACC, MAA and BWT over k", plot_sweep)}),
    "margin": ("Fig. 4b: the DML margin m",
               {f"m{v}": f"--margin {v}" for v in (0.1, 0.2, 0.3, 0.4, 0.5)},
               {"sweep.png": ("Fig. 4b: ACC, MAA and BWT over m", plot_sweep)}),
    "lambda": ("the appendix's figure: the DML weight lambda",
               {f"l{v}": f"--lambda-dml {v}" for v in (0.5, 1.0, 1.5, 2.0)},
               {"sweep.png": ("the appendix's figure: ACC, MAA and BWT over lambda", plot_sweep)}),
    "backbones": ("Table 4: Janus-LoRA on other pre-trainings",
                  {w: f"--weights {w}" for w in ("in21k", "sam", "dino")}, {}),
}


def reproduce(cfg, argv):
    """Each row into OUT/<row>/ with the flags typed and its own; the seeds that other processes
    run are theirs, so that the jobs of an array share the rows. Then table.md and the figures
    of the rows done, whichever jobs ran them."""
    what, rows, figures = REPRODUCE[cfg.reproduce]
    print(f"--reproduce {cfg.reproduce}: {what}; into {cfg.out}")
    argv = [a for i, a in enumerate(argv) if a not in ("--dry-run", "--row")  # a row's command:
            and not a.startswith("--row=") and argv[i - 1:i] != ["--row"]]  # the set's, its row
    for row in [cfg.row] if cfg.row else rows:
        print(f"{row} ({rows[row] or 'no flag'}): {command(argv + ['--row', row])}", flush=True)
        if not cfg.dry_run:
            run(replace(configure(argv + rows[row].split()), reproduce=None,
                        out=os.path.join(cfg.out, row)))
    ends = {} if cfg.dry_run else {row: finished(os.path.join(cfg.out, row)) for row in rows}
    done = {row: {"flags": rows[row], "config": c, "runs": r} for row, (c, r) in ends.items() if r}
    if done:
        differ = len({tuple(r["seed"] for r in row["runs"]) for row in done.values()}) > 1
        title = (f"--reproduce {cfg.reproduce}: {what}; {cfg.dataset}, T={cfg.tasks}"
                 + " (the rows' seeds differ)" * differ)
        with locked(os.path.join(cfg.out, "lock"), wait=True):  # the last writer sees every row
            paths = [write_table(cfg.out, done, title, [r for r in rows if r not in done]),
                     *draw(cfg.out, figures, done, title)]
        print(f"wrote {' '.join(paths)}")
    return 0


# ---- --benchmark: the time of a step -------------------------------------------------------------
BENCHMARKED = {"plain": "finetune", "janus-grad": "janus", "janus-update": "janus-update"}


def benchmark(cfg):
    """Plain LoRA and Janus-LoRA (GR on the gradients, and ours on Adam's step), whatever --method
    says: a step of each in turn on one random batch; each one's median and its per-round ratio
    to plain LoRA's."""
    sync = torch.get_device_module(cfg.device).synchronize  # CUDA's kernels run asynchronously
    classes = data.DATASETS[cfg.dataset]["num_classes"] // cfg.tasks
    backbone = build_model(replace(cfg, weights="none"))  # random weights: the same cost
    m = min(cfg.k * (cfg.tasks // 2), backbone.embed_dim - cfg.k)  # the memory at mid-run
    images = torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, device=cfg.device)
    y = torch.randint(0, classes, (cfg.batch_size,), device=cfg.device)
    steps, ms = {}, {name: [] for name in BENCHMARKED}
    for name, method in BENCHMARKED.items():
        vcfg = replace(cfg, **presets()[method])
        learner = mid_run_learner(vcfg, backbone, m, classes)
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
    print(f"{cfg.model}, batch {cfg.batch_size}, {cfg.img_size} px, memory {m} columns per block, "
          f"{precision(cfg)}, compiled {compiled(cfg)}, {cfg.steps} rounds:\n"
          "variant        ms/step  images/s  x plain (median)")
    for name, t in ms.items():
        ratio = statistics.median(a / p for a, p in zip(t, ms["plain"]))
        median = statistics.median(t)
        print(f"{name:14s} {median:7.1f} {1e3 * cfg.batch_size / median:9.1f} {ratio:8.3f}")
    return 0


def mid_run_learner(cfg, backbone, m, classes):
    """A learner halfway through a run: a random memory of m columns per block, and V and A off
    it, old prototypes, and the current task's head."""
    learner = start_learner(cfg, 0, backbone)
    L, D = len(backbone.blocks), backbone.embed_dim
    if cfg.oe:
        learner.memory = list(torch.linalg.qr(torch.randn(L, D, m)).Q.to(cfg.device))
        if learner.subspace is not None:  # GPM's memory comes with no OE basis
            learner.subspace.V = fresh_basis(learner.memory, cfg.k)
        for j, layer in enumerate(lora_layers(learner.model)):
            layer.reset_(learner.memory[j // 2])
    prototypes = F.normalize(torch.randn(classes * (cfg.tasks // 2), D), dim=1)
    learner.prototypes = prototypes.to(cfg.device)
    start_task(learner, 0, [list(range(classes))], None, cfg)
    return learner


def sigterm(signum, frame):
    """SIGTERM, a scheduler's at a time limit or a pre-emption: it stops the run as Ctrl-C does."""
    raise KeyboardInterrupt(signum)


class Unbroken:
    """Standard output that a reader who has gone (| head) cannot break: what comes after goes to
    os.devnull, and the run goes on. Its other attributes are the stream's own."""

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
    """The command line that runs this program with argv, as it was started: python
    path/to/janus_min.py, or python -m janus_min."""
    return shlex.join(sys.orig_argv[:len(sys.orig_argv) - len(sys.argv) + 1] + argv)


# A file or folder that cannot be written: what to do, by the system's reason (main says the rest).
AGAIN = "then run the same command: the run goes on after its last saved task"
CANNOT_WRITE = {errno.ENOSPC: f"free some space, {AGAIN}", errno.EDQUOT: f"free some of the "
                f"quota, {AGAIN}", errno.EFBIG: f"raise the limit on a file's size (ulimit -f), "
                f"{AGAIN}"}


def main(argv=None):
    """python janus_min.py [flags] (--help). Bad input, and a file that cannot be written: one line
    that says what to do (exit 2). Ctrl-C and SIGTERM: the command that continues (exit 130, 143).
    Any other error is a bug, and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    handler = signal.signal(signal.SIGTERM, sigterm)
    stdout, sys.stdout = sys.stdout, Unbroken(sys.stdout)
    try:
        cfg = configure(argv)
        if cfg.benchmark:
            return benchmark(cfg)
        return reproduce(cfg, argv) if cfg.reproduce else run(cfg)
    except (RunError, data.DataError, vit.CheckpointError, Diverged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the run's folder or files: the rest are the data's and the weights'
        fix = CANNOT_WRITE.get(e.errno, "choose another --out, or make this one writable")
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
