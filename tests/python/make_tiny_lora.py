#!/usr/bin/env python3
"""Writes a LoRA adapter with random weights for a model made by make_tiny_model.py.

No adapter can be downloaded where kvsight's checks run, and routing needs none that means
anything: what matters is that vLLM loads it, serves it under its name and hashes its blocks
under it. The adapter is PEFT's on-disk shape, written by hand: `adapter_config.json` and
`adapter_model.safetensors` with `lora_A`/`lora_B` for every layer's q_proj and v_proj.

usage: make_tiny_lora.py MODEL_DIR OUT_DIR [--rank 8] [--seed 1]
"""
import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    cfg = json.loads((args.model_dir / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    out = {
        "q_proj": cfg["num_attention_heads"] * head_dim,
        "v_proj": cfg["num_key_value_heads"] * head_dim,
    }
    torch.manual_seed(args.seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, out_features in out.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(args.rank, hidden) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, args.rank) * 0.01
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(args.model_dir),
        "r": args.rank,
        "lora_alpha": 2 * args.rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(out),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (args.out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{args.out_dir}: rank {args.rank}, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
