"""Compares two zl_step_check outputs (x86 and aarch64): tools/check_arm64.sh, tools/build_phone_runner.sh.

    python tools/compare_step.py X86.safetensors ARM64.safetensors [LOSS_RTOL [GRAD_ATOL]]

Each stage's loss and CE within LOSS_RTOL (relative, default 1e-5); its KL
term, a few thousandths and so relatively noisier, within LOSS_RTOL of the
stage's loss (absolute: it is a term of that loss); every gradient and hidden
state within GRAD_ATOL (absolute, default 1e-6). Prints one line per stage and
a summary; exit status 0 only when everything is within the limits.
"""
import sys
import numpy as np
from safetensors.numpy import load_file

x86, arm = load_file(sys.argv[1]), load_file(sys.argv[2])
loss_rtol = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-5
grad_atol = float(sys.argv[4]) if len(sys.argv) > 4 else 1e-6
if sorted(x86) != sorted(arm):
    print(f"different tensors: only x86 {sorted(set(x86) - set(arm))}, only arm64 {sorted(set(arm) - set(x86))}")
    sys.exit(1)
bad = [n for n in x86 if x86[n].shape != arm[n].shape or not (np.isfinite(x86[n]).all() and np.isfinite(arm[n]).all())]
if bad:
    print(f"different shapes or non-finite values: {bad}")
    sys.exit(1)
ok = True
stages = sorted({int(n.split(".")[0][5:]) for n in x86})
for k in stages:
    loss, task, kl = (f"stage{k}.{t}" for t in ("loss", "task_loss", "consistency_loss"))
    rel = {n: abs(float(x86[n]) - float(arm[n])) / abs(float(x86[n])) for n in (loss, task)}
    kl_diff = abs(float(x86[kl]) - float(arm[kl]))
    ok &= max(rel.values()) <= loss_rtol and kl_diff <= loss_rtol * abs(float(x86[loss]))
    print(f"stage{k}.loss: x86 {float(x86[loss]):.9g} arm64 {float(arm[loss]):.9g} rel diff {rel[loss]:.3g}; "
          f"CE rel diff {rel[task]:.3g}; KL x86 {float(x86[kl]):.6g} arm64 {float(arm[kl]):.6g} abs diff {kl_diff:.3g}")
diffs = {n: float(np.abs(x86[n].astype(np.float64) - arm[n]).max()) for n in x86 if not n.endswith("loss")}
grads = [n for n in diffs if ".grad." in n]
worst_grad = max(diffs[n] for n in grads)
worst_hidden = max((diffs[n] for n in diffs if n.endswith(".hidden")), default=0.0)
scale = max(float(np.abs(x86[n]).max()) for n in grads)
ok &= max(diffs.values()) <= grad_atol
print(f"{len(grads)} LoRA gradients: max abs diff {worst_grad:.3g} (largest |g| {scale:.3g}, limit {grad_atol:g}); "
      f"hidden states: max abs diff {worst_hidden:.3g}; limits: loss and CE {loss_rtol:g} relative, KL {loss_rtol:g} of the loss")
sys.exit(0 if ok else 1)
