"""Train a tiny Llama on synthetic data twice, with transformers' RoPE and with rope_ext's, and
print the losses, step times and tokens per second side by side, and plot the two loss curves.

    python examples/train_tiny_llama.py [--steps 200] [--seq 256] [--batch 4] [--dtype float32]
                                        [--plot train_tiny_llama.png]

The model is built from a config (random weights, no download). Both runs start from the same
weights and see the same batches, so their loss curves should lie on each other (float32 rounding
apart). About a minute on two CPU cores at the defaults.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

from rope_ext.integrations import transformers as rope_hf  # noqa: E402


def build(args):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    return transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))


def batches(args):
    # A learnable synthetic language: each sequence counts up from a random start, mod the vocab.
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        start = torch.randint(0, 1024, (args.batch, 1), generator=g)
        yield (start + torch.arange(args.seq)) % 1024


def train(args, label):
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for ids in tqdm(batches(args), total=args.steps, desc=label, leave=False):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return losses, times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--plot", default="train_tiny_llama.png", help="where the loss curves go (PNG); '' for none")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    hf_losses, hf_times = train(args, "transformers RoPE")
    with rope_hf.patch(["llama"]):
        re_losses, re_times = train(args, "rope_ext RoPE")

    print(f"tiny Llama (4 layers, 8 heads / 2 kv heads, head dim 32), batch {args.batch} x seq {args.seq}, "
          f"{args.dtype}, {args.threads} threads")
    print(f"{'step':>5} {'loss (HF)':>10} {'loss (rope_ext)':>16} {'ms (HF)':>9} {'ms (rope_ext)':>14}")
    for i in sorted({0, *range(9, args.steps, 10), args.steps - 1}):
        print(f"{i + 1:5d} {hf_losses[i]:10.4f} {re_losses[i]:16.4f} "
              f"{hf_times[i] * 1e3:9.1f} {re_times[i] * 1e3:14.1f}")
    skip = min(3, args.steps - 1)  # warm-up steps
    hf_med = sorted(hf_times[skip:])[len(hf_times[skip:]) // 2]
    re_med = sorted(re_times[skip:])[len(re_times[skip:]) // 2]
    tokens = args.batch * args.seq
    print(f"median step: HF {hf_med * 1e3:.1f} ms, rope_ext {re_med * 1e3:.1f} ms ({hf_med / re_med:.2f}x); "
          f"largest loss difference {max(abs(a - b) for a, b in zip(hf_losses, re_losses, strict=True)):.2e}")
    print(f"tokens per second: HF {tokens / hf_med:.0f}, rope_ext {tokens / re_med:.0f}")
    if args.plot:
        plot(args, hf_losses, re_losses)


def plot(args, hf_losses, re_losses):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, or --plot '')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, args.steps + 1)
    ax.plot(steps, hf_losses, label="transformers' RoPE", linewidth=3, alpha=0.5)
    ax.plot(steps, re_losses, label="rope_ext", linewidth=1, linestyle="--")
    ax.set(xlabel="step", ylabel="loss", title=f"tiny Llama, batch {args.batch} x seq {args.seq}, {args.dtype}")
    ax.legend()
    fig.savefig(args.plot, dpi=100, bbox_inches="tight")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
