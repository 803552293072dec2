"""Peak host memory of `npuspeed convert`, both directions, each in a fresh process.

A Llama made here with `transformers` from a config (random weights, nothing downloaded) and
saved in safetensors shards; `hf-to-megatron` converts it and `megatron-to-hf` converts the
result back (with the input's shard size, so both sides have the same shards), each as the
real CLI in its own process. Reported per direction:
- peak RSS of the process (the kernel's VmHWM, which the process prints as it ends), and the
  largest anonymous and file-backed RSS seen by sampling /proc/<pid>/status every few ms;
- the baseline: peak RSS of a process that imports what a conversion imports (torch,
  megatron.core with GPTModel and dist_checkpointing, npuspeed.convert) and converts nothing;
- the peak above that baseline, and its ratio to the largest input shard and largest tensor;
- the process's wall time (imports included).
The issue's target: above the baseline, < 2x the largest shard, on a model of 8 shards.

    python benchmarks/bench_convert_memory.py              # the 156M Llama below, 8 shards
    python benchmarks/bench_convert_memory.py --layers 2 --hidden 256 --vocab 4096 --shard 2MB
    python benchmarks/bench_convert_memory.py --layers 16 --hidden 2048 --ffn 5632 --vocab 128256 \
        --dtype bfloat16 --shard 300MB     # 1.3B parameters, a Llama 3 vocabulary, 8 shards
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20

#: what a conversion imports before it touches a tensor: the baseline process does only this
BASELINE = """
from npuspeed.convert import megatron_model, hf_to_megatron, megatron_to_hf, lazy_save, dcp_regions
megatron_model.runtime_first()
import megatron.core.dist_checkpointing, megatron.core.models.gpt, torch.distributed.checkpoint
from megatron.core.dist_checkpointing.strategies import torch as _strategies
"""
#: run in the measured process after its work: the kernel's record of its peak RSS
REPORT_PEAK = "\nprint('VmHWM', open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
CONVERT = "import sys\nfrom npuspeed.cli import main\nassert main(sys.argv[1:]) == 0"


def make_model(path: Path, args) -> None:
    """A random Llama of the given size saved as safetensors shards of at most args.shard."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=args.ffn, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    model.save_pretrained(str(path), max_shard_size=args.shard)


def tensor_sizes(path: Path) -> dict[str, int]:
    from safetensors import safe_open

    sizes = {}
    for file in glob.glob(str(path / "*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                n = 1
                for d in s.get_shape():
                    n *= d
                sizes[name] = n * {"F32": 4, "BF16": 2, "F16": 2}[s.get_dtype()]
    return sizes


def measure(cmd: list[str]) -> dict:
    """Run `cmd` (python -c CODE ...); its peak RSS and the largest RssAnon / RssFile sampled."""
    cmd = [cmd[0], "-c", cmd[2] + REPORT_PEAK, *cmd[3:]]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               NPUSPEED_DEVICE=os.environ.get("NPUSPEED_DEVICE", "cpu"))
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample():
        status = f"/proc/{proc.pid}/status"
        while not done.is_set():
            try:
                with open(status) as f:
                    for line in f:
                        key = line.split(":")[0]
                        if key in seen:
                            seen[key] = max(seen[key], int(line.split()[1]) * 1024)
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.stdout.read()
    proc.wait()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    peak = [line.split()[1] for line in output.splitlines() if line.startswith("VmHWM ")]
    return {"peak": int(peak[-1]) * 1024, "anon": seen["RssAnon"], "file": seen["RssFile"], "seconds": seconds}


def same_tensors(a: Path, b: Path) -> int:
    """Number of tensors, all bitwise equal between the two directories (else SystemExit)."""
    import torch
    from safetensors.torch import load_file

    def load(p):
        out = {}
        for f in glob.glob(str(p / "*.safetensors")):
            out.update(load_file(f))
        return out

    x, y = load(a), load(b)
    bad = [k for k in x if k not in y or x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k])]
    if bad or set(x) != set(y):
        raise SystemExit(f"round trip differs: {bad[:3]} {sorted(set(x) ^ set(y))[:3]}")
    return len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2304)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shard", default="70MB", help="max_shard_size of save_pretrained (default: 8 shards)")
    parser.add_argument("--workdir", default=None, help="keep the model here (made once) instead of a temp dir")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        base = Path(args.workdir or tmp)
        hf = base / f"llama-{args.layers}x{args.hidden}-v{args.vocab}-{args.dtype}-{args.shard}"
        if not (hf / "config.json").exists():
            make_model(hf, args)
        sizes = tensor_sizes(hf)
        shards = {Path(f).name: os.path.getsize(f) for f in glob.glob(str(hf / "*.safetensors"))}
        largest_shard, largest_tensor = max(shards.values()), max(sizes.values())
        py = sys.executable
        baseline = measure([py, "-c", BASELINE])
        work = Path(tmp)
        runs = {
            "hf-to-megatron": measure([py, "-c", CONVERT, "convert", "hf-to-megatron", "--hf", str(hf),
                                       "--save", str(work / "mg")]),
            "megatron-to-hf": measure([py, "-c", CONVERT, "convert", "megatron-to-hf", "--load",
                                       str(work / "mg"), "--save", str(work / "back"),
                                       "--max-shard-size", args.shard]),
        }
        count = same_tensors(hf, work / "back")

    print(f"model: {sum(sizes.values()) / MIB:.0f} MiB in {len(shards)} shards, {count} tensors, largest shard "
          f"{largest_shard / MIB:.1f} MiB, largest tensor {largest_tensor / MIB:.1f} MiB; round trip bitwise")
    print(f"baseline (imports only): peak RSS {baseline['peak'] / MIB:.0f} MiB")
    print(f"{'direction':<16}{'peak RSS':>10}{'above base':>12}{'/ shard':>9}{'/ tensor':>10}"
          f"{'max anon':>10}{'max file':>10}{'seconds':>9}")
    result = {"baseline_bytes": baseline["peak"], "largest_shard_bytes": largest_shard,
              "largest_tensor_bytes": largest_tensor, "shards": len(shards), "model_bytes": sum(sizes.values())}
    for name, r in runs.items():
        above = r["peak"] - baseline["peak"]
        print(f"{name:<16}{r['peak'] / MIB:>9.0f}M{above / MIB:>11.0f}M{above / largest_shard:>9.2f}"
              f"{above / largest_tensor:>10.2f}{r['anon'] / MIB:>9.0f}M{r['file'] / MIB:>9.0f}M{r['seconds']:>9.1f}")
        result[name] = dict(r, above_baseline_bytes=above, per_shard=above / largest_shard,
                            per_tensor=above / largest_tensor)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
