"""Fingerprint of the numerical kernels the stages use, under the project's CPU pins: the sha256
prefix of each op's output bytes (GEMM shapes, linear and conv forward/backward, elementwise
functions, reductions, softmax, an AdamW step, attention, float64 LAPACK, numpy's BLAS).

    PYTHONPATH=. .venv/bin/python tests/xcpu/fingerprint.py > mine.json
    PYTHONPATH=. .venv/bin/python tests/xcpu/fingerprint.py --compare tests/xcpu/intel-xeon-avx512.json

Two CPUs that give the same bytes for every stage agree on every op here; an op that differs
names the kernel (MKL, ATen, Sleef, oneDNN, OpenBLAS) that still follows the CPU.
tests/test_vendor_kernels.py compares this machine's fingerprint with the reference files beside
this one: intel-xeon-avx512.json (an Intel Xeon with AVX-512, torch 2.14.1) and amd-epyc.json (an
AMD EPYC with AVX-512, same torch).
"""
import hashlib  # noqa: I001  (stages first: it pins the CPU code paths before numpy and torch load)
import json
import sys

import stages  # noqa: F401  (applies the pins before torch / numpy load)
import numpy as np
import torch
import torch.nn.functional as F

from stages.core import numerics

numerics.pin_torch()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


def h(t) -> str:
    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous().cpu().numpy()
    return hashlib.sha256(np.ascontiguousarray(t).tobytes()).hexdigest()[:16]


def ops():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    out = {}
    out["randn"] = r(1000)
    for m, k, n in [(64, 64, 64), (256, 784, 128), (512, 32, 512), (1, 1000, 10), (100, 3, 7), (128, 4096, 64)]:
        a, b = r(m, k), r(k, n)
        out[f"matmul_{m}x{k}x{n}"] = a @ b
    a = r(300, 50)
    out["matvec"] = a @ r(50)
    out["bmm"] = torch.bmm(r(8, 16, 32), r(8, 32, 24))
    lin = torch.nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(r(32, 64) * 0.1)
        lin.bias.copy_(r(32) * 0.1)
    x = r(128, 64).requires_grad_()
    y = lin(x)
    (y.square().mean()).backward()
    out["linear_fwd"], out["linear_dx"], out["linear_dw"] = y, x.grad, lin.weight.grad
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(r(8, 3, 3, 3) * 0.2)
        conv.bias.zero_()
    xi = r(4, 3, 16, 16).requires_grad_()
    yc = conv(xi)
    yc.sum().backward()
    out["conv_fwd"], out["conv_dx"], out["conv_dw"] = yc, xi.grad, conv.weight.grad
    v = r(10000)
    for name, f in [("exp", torch.exp), ("log", lambda z: torch.log(z.abs() + 1e-3)), ("tanh", torch.tanh),
                    ("sigmoid", torch.sigmoid), ("gelu", F.gelu), ("silu", F.silu), ("erf", torch.erf),
                    ("sin", torch.sin), ("cos", torch.cos), ("sqrt", lambda z: z.abs().sqrt()),
                    ("pow1.5", lambda z: z.abs().pow(1.5)), ("softplus", F.softplus), ("rsqrt", lambda z: (z.abs() + 1).rsqrt())]:
        out[f"unary_{name}"] = f(v)
    m = r(64, 100)
    out["softmax"] = F.softmax(m, dim=1)
    out["log_softmax"] = F.log_softmax(m, dim=1)
    out["logsumexp"] = torch.logsumexp(m, dim=1)
    out["layer_norm"] = F.layer_norm(m, (100,))
    out["sum_big"] = r(1_000_003).sum()
    out["mean_dim"] = r(300, 777).mean(dim=1)
    out["var"] = r(300, 777).var(dim=0)
    out["cumsum"] = torch.cumsum(r(5000), 0)
    out["norm"] = torch.linalg.vector_norm(r(4096))
    out["cross_entropy"] = F.cross_entropy(r(256, 10), torch.randint(0, 10, (256,), generator=g))
    out["mse"] = F.mse_loss(r(256, 20), r(256, 20))
    out["dropout"] = F.dropout(r(1000), 0.3, training=True, generator=g) if "generator" in F.dropout.__code__.co_varnames else torch.zeros(1)
    emb = torch.nn.Embedding(50, 16)
    with torch.no_grad():
        emb.weight.copy_(r(50, 16))
    out["embedding"] = emb(torch.arange(50).flip(0))
    # An optimiser step, as every training loop takes.
    net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(r(*p.shape) * 0.1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    xb, yb = r(64, 20), torch.randint(0, 5, (64,), generator=g)
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
    out["adamw_5_steps"] = torch.cat([p.flatten() for p in net.parameters()])
    att = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(r(*p.shape) * 0.1)
    q = r(2, 10, 32)
    out["attention"] = att(q, q, q, need_weights=False)[0]
    out["sdpa"] = F.scaled_dot_product_attention(r(2, 4, 10, 8), r(2, 4, 10, 8), r(2, 4, 10, 8), is_causal=True)
    # float64 LAPACK (LDA's closed form) and numpy's BLAS.
    A = r(40, 40).double()
    S = A @ A.T + 40 * torch.eye(40, dtype=torch.float64)
    out["cholesky64"] = torch.linalg.cholesky(S)
    out["solve64"] = torch.linalg.solve(S, r(40, 3).double())
    out["eigh64"] = torch.linalg.eigh(S)[0]
    rng = np.random.default_rng(0)
    An = rng.standard_normal((200, 300))
    out["np_dot"] = An @ An.T
    out["np_dot32"] = An.astype(np.float32) @ An.T.astype(np.float32)
    out["np_exp"] = np.exp(rng.standard_normal(10000))
    out["np_log1p"] = np.log1p(np.abs(rng.standard_normal(10000)))
    out["np_solve"] = np.linalg.solve(An[:, :200] @ An[:, :200].T + 200 * np.eye(200), np.ones(200))
    out["np_sum"] = rng.standard_normal(1_000_003).sum()
    return {k: h(v) for k, v in out.items()}


if __name__ == "__main__":
    res = {"torch": torch.__version__, "numpy": np.__version__, "ops": ops()}
    if len(sys.argv) > 2 and sys.argv[1] == "--compare":
        with open(sys.argv[2]) as f:
            ref = json.load(f)["ops"]
        diff = [k for k in ref if ref[k] != res["ops"].get(k)]
        for k in diff:
            print(f"differs: {k}")
        print(f"{len(ref) - len(diff)} of {len(ref)} ops give the reference bytes")
        sys.exit(1 if diff else 0)
    json.dump(res, sys.stdout, indent=1, sort_keys=True)
    print()
