#!/usr/bin/env python3
"""Writes a tiny Llama model with random weights around a tokenizer, for a real vLLM on CPU.

No model can be downloaded where kvsight's checks run, and none is needed: routing depends on
the token ids and the KV cache, not on what the model says. The model is a 2-layer Llama whose
vocabulary is the tokenizer's, saved by transformers itself (config.json, safetensors,
generation_config.json), with the tokenizer files copied beside it.

vLLM's CPU attention kernels need a head dimension of 64 (16 is refused).

usage: make_tiny_model.py TOKENIZER_DIR OUT_DIR [--model-type llama]
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--max-position-embeddings", type=int, default=4096)
    args = ap.parse_args()

    tok = json.loads((args.tokenizer_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    added = [t["id"] for t in tok.get("added_tokens", [])]
    vocab_size = max([vocab - 1, *added]) + 1
    cfg_json = json.loads((args.tokenizer_dir / "tokenizer_config.json").read_text())
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}

    def token_id(key):
        t = cfg_json.get(key)
        if isinstance(t, dict):
            t = t.get("content")
        return ids.get(t)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=args.max_position_embeddings,
        bos_token_id=token_id("bos_token"),
        eos_token_id=token_id("eos_token"),
        pad_token_id=token_id("pad_token"),
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = args.tokenizer_dir / name
        if src.exists():
            shutil.copy(src, args.out_dir / name)
    print(f"{args.out_dir}: vocab {vocab_size}")


if __name__ == "__main__":
    main()
