"""A training step end to end, stock against rope_ext's patch(): tokens per second and peak memory of
forward + backward + AdamW step, eager and under torch.compile.

    python benchmarks/bench_train_step.py                       # every model, float32, eager and compiled
    python benchmarks/bench_train_step.py --dtypes float32,bfloat16  # bfloat16 too (hours without AVX512-BF16)
    python benchmarks/bench_train_step.py --models qwen3 --dtypes float32 --modes compile --rounds 20
    python benchmarks/bench_train_step.py --device cuda --full  # the real widths, on a GPU

Models (random weights, the libraries' own classes; each keeps its checkpoint's attention: heads,
head dim, QK-norm and RoPE; on the CPU it has 2 layers and a narrower hidden size and MLP, so that a
step takes about a second, and --full gives the real widths with 2 layers):
  qwen3  Qwen3-0.6B: 16 query and 8 key/value heads of 128, q and k RMS-normalized per head, RoPE
         base 1e6; hidden 512 and MLP 1536 on the CPU (1024 and 3072 in the checkpoint); a
         vocabulary of 2048; 1 x 512 tokens (4 x 2048 with --full). Fused by patch(): norms + RoPE.
  llama  Llama-3.2-1B: 32 query and 8 key/value heads of 64, no QK-norm, llama3 RoPE scaling;
         hidden 512 and MLP 1536 on the CPU (2048 and 8192); the same vocabulary and tokens.
  wan    Wan 2.1 T2V-1.3B's transformer: 12 heads of 128, q and k RMS-normalized across heads, 3-D
         RoPE, cross-attention to 128 text tokens; 1536 wide with an MLP of 1536 on the CPU (8960), a
         2 x 32 x 32 latent video (512 tokens; 8 x 64 x 64, 8192 tokens, with --full). The loss: the
         mean squared error to a fixed random target. Fused by patch(): norms + RoPE.
Variants: stock (the libraries' code as installed) and patched (rope_ext.integrations.<library>
.patch(), its default: RoPE on rope_ext's ops and the q/k norms fused where the listing says so).
With --control both processes run stock: the "patched" column is then a second stock process, and
its ratio what two processes of one variant differ by (their memory layout, their threads' cores).

How it measures. Each variant of a (model, dtype, mode) runs in a process of its own, built from the
same seed, patched (or not) and compiled (or not) once; the processes take turns, one step each per
round, so that the machine's drift falls on both alike and a compiled model never recompiles (patch()
and unpatch() drop torch.compile's caches). Before timing, the first step is checked against stock's
(its loss, and each parameter's gradient norm and its gradient's projection on a seeded random
direction), and a profiled step shows which rope_ext ops each
variant runs (none for stock). Then the timed rounds, then --memory-rounds more steps for the peak
tensor memory over a step beyond what it starts with (torch.cuda.max_memory_allocated on a GPU, the
profiler's record of the CPU allocator's blocks on the CPU; the optimizer's state is held before
the step, the gradients are not). The table gives the medians, the patched/stock ratio of each
round's two times (median and quartiles: its spread), and the memory's.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import statistics
import sys
import time

MODELS = ("qwen3", "llama", "wan")
VARIANTS = ("stock", "patched")


# --- the models ---------------------------------------------------------------------------------


def _causal_lm(family: str, config_kwargs: dict, full: bool, device, dtype, tiny: bool):
    import transformers

    sizes = dict(hidden_size=512, intermediate_size=1536)
    if full:
        sizes = {}
    if tiny:
        sizes = dict(hidden_size=64, intermediate_size=96)
    config = getattr(transformers, f"{family}Config")(**{**config_kwargs, **sizes, "num_hidden_layers": 2,
                                                       "vocab_size": 2048, "tie_word_embeddings": True})
    config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{family}ForCausalLM")(config).to(device, dtype)
    batch, tokens = (4, 2048) if full else (1, 512)
    if tiny:
        batch, tokens = 1, 32
    g = torch_generator(1)
    ids = _torch().randint(0, config.vocab_size, (batch, tokens + 1), generator=g).to(device)

    def loss():
        return model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss

    return model, loss, batch * tokens


def qwen3(full, device, dtype, tiny=False):
    """Qwen3-0.6B's attention and norms (its config.json's values)."""
    return _causal_lm("Qwen3", dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                                    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                    max_position_embeddings=40960), full, device, dtype, tiny)


def llama(full, device, dtype, tiny=False):
    """Llama-3.2-1B's attention and RoPE scaling (its config.json's values)."""
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return _causal_lm("Llama", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_parameters=rope,
                                    max_position_embeddings=131072), full, device, dtype, tiny)


def wan(full, device, dtype, tiny=False):
    """Wan 2.1 T2V-1.3B's transformer (its config.json's values) with 2 layers."""
    from diffusers import WanTransformer3DModel

    torch = _torch()
    heads, ffn, frames, grid, text = 12, 1536, 2, 32, 128
    if full:
        ffn, frames, grid, text = 8960, 8, 64, 512
    if tiny:
        heads, ffn, frames, grid, text = 2, 64, 1, 8, 8
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128,
                                  in_channels=16, out_channels=16, text_dim=4096 if not tiny else 32, freq_dim=256,
                                  ffn_dim=ffn, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                  eps=1e-6, rope_max_seq_len=1024).to(device, dtype)
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):  # float32, as from_pretrained
        if any(keep in name.split(".") for keep in model._keep_in_fp32_modules):  # (torch_dtype=dtype) keeps
            tensor.data = tensor.data.float()
    g = torch_generator(1)
    latents = torch.randn(1, 16, frames, grid, grid, generator=g).to(device, dtype)
    context = torch.randn(1, text, model.config.text_dim, generator=g).to(device, dtype)
    target = torch.randn(latents.shape, generator=g).to(device, dtype)
    timestep = torch.tensor([500], device=device)

    def loss():
        out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]
        return torch.nn.functional.mse_loss(out.float(), target.float())

    return model, loss, frames * (grid // 2) ** 2


BUILDERS = {"qwen3": qwen3, "llama": llama, "wan": wan}
LIBRARY = {"qwen3": "transformers", "llama": "transformers", "wan": "diffusers"}


def _torch():
    import torch

    return torch


def torch_generator(seed):
    return _torch().Generator().manual_seed(seed)


# --- one variant's process ----------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_profile(**kwargs):
    """torch.profiler.profile, without the start and stop lines it writes to stderr."""
    from torch.profiler import profile

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            with profile(**kwargs) as prof:
                yield prof
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _PeakMemory:
    """The most tensor memory a step holds at once beyond what it started with, in bytes: on a GPU
    torch.cuda.max_memory_allocated's; on the CPU the same sum over the CPU allocator's blocks,
    from the profiler's record of each allocation and free (the C library's heap would hide it:
    it keeps freed blocks resident and serves later ones from them)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, step):
        torch = _torch()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        with _quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        # in time order; events at one timestamp keep the record's order (sorted is stable), so an
        # allocation recorded before a free stays before it
        events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                        key=lambda event: event[0])
        held = peak = 0
        for _, nbytes in events:  # (a free's nbytes is negative)
            held += nbytes
            peak = max(peak, held)
        return peak


def _variant_context(model_name, variant):
    if variant == "stock":
        return contextlib.nullcontext()
    import importlib

    return importlib.import_module(f"rope_ext.integrations.{LIBRARY[model_name]}").patch()


def worker(conn, model_name, dtype_name, mode, variant, full, device_name, threads, tiny):
    """Build the model, patch and compile it as told, report the first step (its loss, each
    parameter's gradient norm, the rope_ext ops a step runs), then answer each "step" with its
    seconds and each "memory" with a step's peak bytes."""
    torch = _torch()
    torch.set_num_threads(threads)
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    try:
        with _variant_context(model_name, variant):
            torch.manual_seed(0)
            model, loss_fn, tokens = BUILDERS[model_name](full, device, dtype, tiny)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            compute = torch.compile(loss_fn) if mode == "compile" else loss_fn
            memory = _PeakMemory(device)

            def step(check=None):
                loss = compute()
                loss.backward()
                if check is not None:
                    check.append(loss.item())
                    check.extend((name, _gradient_summary(i, p.grad)) for i, (name, p) in
                                 enumerate(model.named_parameters()))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()

            first = []
            step(first)  # (and, compiled, the compile)
            conn.send(("ready", tokens, first[0], first[1:], _ops_seen(step)))
            while (command := conn.recv()) != "stop":
                if command == "step":
                    start = time.perf_counter()
                    step()
                    conn.send((time.perf_counter() - start,))
                else:
                    conn.send((memory(step),))
    except Exception as error:  # the coordinator reports it
        conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        conn.close()


def _gradient_summary(index, grad):
    """(norm, projection) of a parameter's gradient, in float64: the projection on a random unit
    direction seeded by the parameter's index, the same in both processes. None for no gradient."""
    torch = _torch()
    if grad is None:
        return None
    g = grad.detach().double().flatten().cpu()
    direction = torch.randn(g.numel(), generator=torch_generator(index), dtype=torch.float64)
    return g.norm().item(), (g @ direction).item() / max(direction.norm().item(), 1e-300)


def _ops_seen(step):
    """The rope_ext ops one step runs (profiled): none for stock, and proof for patched."""
    with _quiet_profile() as prof:
        step()
    return sorted({e.name for e in prof.events() if e.name.startswith("rope_ext::")})


# --- the coordinator ----------------------------------------------------------------------------


def _tolerance(dtype_name):
    """The first step's loss and gradient norms, patched against stock (two builds from one seed).
    float32: the kernels' roundings differ by a few ulps per element (2^-24 relative each), and the
    norms and the loss average them, so 1e-4 leaves ample room; bfloat16: each rounded activation
    is 2^-8 relative off, stacked through two layers forward and back."""
    return 1e-4 if dtype_name == "float32" else 3e-2


def _gradients_differ(got, want, tolerance):
    """The first parameter whose gradient differs, as a message, or None: a gradient on one side
    only, or a norm or a projection off stock's by more than tolerance times stock's norm (each
    parameter on its own, so that a small one's error cannot hide behind a large one's)."""
    for (name, g), (_, w) in zip(got, want, strict=True):
        if (g is None) != (w is None):
            return f"{name} has a gradient only in {'stock' if g is None else 'patched'}"
        if g is None:
            continue
        scale = tolerance * max(w[0], 1e-12)
        if abs(g[0] - w[0]) > scale or abs(g[1] - w[1]) > scale:
            return f"{name}: gradient norm {g[0]:.6g} and projection {g[1]:.6g}, stock's {w[0]:.6g} and {w[1]:.6g}"
    return None


def run_config(model_name, dtype_name, mode, args):
    """{variant: (tokens, [seconds], [peak bytes], [rope_ext ops])}: the first step checked against
    stock's, then the timed rounds and the memory rounds, each interleaved."""
    ctx = multiprocessing.get_context("spawn")
    name = f"{model_name} {dtype_name} {mode}"
    procs, conns = {}, {}
    for variant in VARIANTS:
        parent, child = ctx.Pipe()
        built = "stock" if args.control else variant  # (--control: stock in both processes)
        procs[variant] = ctx.Process(target=worker, args=(child, model_name, dtype_name, mode, built, args.full,
                                                          args.device, args.threads, args.tiny), daemon=True)
        procs[variant].start()
        conns[variant] = parent

    def ask(variant, command):
        conns[variant].send(command)
        message = conns[variant].recv()
        if message[0] == "error":
            raise SystemExit(f"{name} {variant}: {message[1]}")
        return message[0]

    try:
        ready = {}
        for variant in VARIANTS:
            ready[variant] = conns[variant].recv()
            if ready[variant][0] == "error":
                raise SystemExit(f"{name} {variant}: {ready[variant][1]}")
        (_, tokens, stock_loss, stock_norms, stock_ops), (_, _, loss, norms, ops) = ready["stock"], ready["patched"]
        tolerance = _tolerance(dtype_name)
        if not abs(loss - stock_loss) <= tolerance * abs(stock_loss):
            raise SystemExit(f"{name}: patched loss {loss} against stock's {stock_loss}")
        if (differ := _gradients_differ(norms, stock_norms, tolerance)) is not None:
            raise SystemExit(f"{name}: {differ} (tolerance {tolerance})")
        if stock_ops or bool(ops) == args.control:
            raise SystemExit(f"{name}: rope_ext ops in a stock step {stock_ops}, in a patched one {ops}")
        times = {v: [] for v in VARIANTS}
        peaks = {v: [] for v in VARIANTS}
        for r in range(args.warmup + args.rounds + args.memory_rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # (neither always goes first)
            for variant in order:
                if r < args.warmup + args.rounds:
                    seconds = ask(variant, "step")
                    if r >= args.warmup:
                        times[variant].append(seconds)
                else:
                    peaks[variant].append(ask(variant, "memory"))
        return {v: (tokens, times[v], peaks[v], ready[v][4]) for v in VARIANTS}
    finally:
        for variant in VARIANTS:
            with contextlib.suppress(OSError, BrokenPipeError):
                conns[variant].send("stop")
            procs[variant].join(timeout=60)
            if procs[variant].is_alive():
                procs[variant].kill()


def _commit():
    """The checkout's commit, or "an unknown commit" outside a git checkout."""
    import subprocess

    try:
        run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.TimeoutExpired):
        return "an unknown commit"
    return run.stdout.strip() if run.returncode == 0 and run.stdout.strip() else "an unknown commit"


def _cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else platform's processor or machine."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _quartiles(values):
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], q[1], q[2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default="float32",
                        help="comma-separated; bfloat16 steps about 20x slower on a CPU without AVX512-BF16")
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-rounds", type=int, default=3, help="steps measured for peak memory, after")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="the checkpoints' widths (for a GPU)")
    parser.add_argument("--tiny", action="store_true", help="toy widths: the test's smoke run")
    parser.add_argument("--control", action="store_true",
                        help="stock in both processes: what two processes of one variant differ by")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.memory_rounds < 0:
        parser.error("--rounds must be at least 1, --warmup and --memory-rounds at least 0")
    import diffusers
    import torch
    import transformers

    print(f"rope_ext at {_commit()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"diffusers {diffusers.__version__}, {args.device}: " +
          (torch.cuda.get_device_name() if args.device == "cuda" else
           f"{_cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads")
          + f"; {args.rounds} interleaved rounds after {args.warmup}"
          + ("; CONTROL: stock in both processes" if args.control else ""), flush=True)
    print(f"{'model':<6} {'dtype':<9} {'mode':<8} {'tokens':>6} {'stock tok/s':>11} {'patched tok/s':>13} "
          f"{'time ratio (q1-q3)':>22} {'stock MiB':>9} {'patched MiB':>11} {'mem ratio':>9}  rope_ext ops")
    results = {}
    for model_name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            for mode in args.modes.split(","):
                r = run_config(model_name, dtype_name, mode, args)
                results[model_name, dtype_name, mode] = r
                tokens = r["stock"][0]
                ratios = [p / s for p, s in zip(r["patched"][1], r["stock"][1], strict=True)]
                q1, median, q3 = _quartiles(ratios)
                ops = " ".join(o.removeprefix("rope_ext::") for o in r["patched"][3])
                if args.memory_rounds:
                    stock_mem, patched_mem = (statistics.median(r[v][2]) for v in VARIANTS)
                    ratio = f"{patched_mem / stock_mem:9.3f}" if stock_mem > 0 else f"{'-':>9}"
                    memory = f"{stock_mem / 2**20:9.1f} {patched_mem / 2**20:11.1f} {ratio}"
                else:
                    memory = f"{'-':>9} {'-':>11} {'-':>9}"
                print(f"{model_name:<6} {dtype_name:<9} {mode:<8} {tokens:>6} "
                      f"{tokens / statistics.median(r['stock'][1]):11.0f} "
                      f"{tokens / statistics.median(r['patched'][1]):13.0f} "
                      f"{median:>10.3f} ({q1:.3f}-{q3:.3f}) {memory}  {ops}", flush=True)
    print("time ratio: patched/stock step time per round (below 1: patched is faster); memory: the step's peak")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
